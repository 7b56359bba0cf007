"""Configs: presets are valid, every config round-trips through JSON and through the CLI, resume-safe fields."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import pytest

from minigpt.commands.flags import parse_train
from minigpt.config import (
    PRESETS,
    ConfigError,
    DataConfig,
    DistributedConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    WandbConfig,
    config_changes,
    from_dict,
    get_preset,
    is_resume_safe,
    load_json,
    resume_safe,
    save_json,
    subcommand_name,
    to_dict,
)
from minigpt.optim.optimizer import AdamW, CosineDecaySchedule, Lion, Optimizer, Schedule, WSDSchedule


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_json(name: str) -> None:
    cfg = PRESETS[name]
    assert from_dict(to_dict(cfg)) == cfg


def test_cli_flags_override_the_preset_and_round_trip() -> None:
    cfg = parse_train(
        ["--preset", "tutorial", "--steps", "7", "--model.n-layers", "2", "optimizer:lion", "--optimizer.b1", "0.8",
         "schedule:wsd-schedule", "--schedule.total-steps", "7", "--schedule.warmup-steps", "1"],
        "minigpt train",
    )  # fmt: skip
    assert cfg.steps == 7 and cfg.model.n_layers == 2 and cfg.model.d_ff == 256  # the rest stays the preset's
    assert isinstance(cfg.optimizer, Lion) and cfg.optimizer.b1 == 0.8
    assert isinstance(cfg.schedule, WSDSchedule) and cfg.schedule.total_steps == 7
    assert from_dict(to_dict(cfg)) == cfg


def test_padded_vocab_is_a_multiple() -> None:
    assert ModelConfig(vocab_size=50257).padded_vocab == 50304
    assert ModelConfig(vocab_size=4096).padded_vocab == 4096


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(d_model=100, n_heads=8), "must be divisible by model.n_heads"),
        (lambda: ModelConfig(dropout=1.0), "model.dropout must be in"),
        (lambda: MeshConfig(data=-1, fsdp=-1), "at most one mesh size may be -1"),
        (lambda: TrainConfig(grad_accum=0), "grad_accum must be positive"),
        (lambda: TrainConfig(weight_decay_passes=-1.0), r"weight_decay_passes must be .* >= 0 \(0: off\), got -1"),
        (lambda: TrainConfig(weight_decay_passes=float("nan")), "weight_decay_passes must be .*, got nan"),
        (lambda: TrainConfig(average_weights=1.0), r"average_weights must be a fraction of the run in \[0, 1\) \(0: off\), got 1.0"),
        (lambda: TrainConfig(average_weights=-0.1), r"average_weights must be .*, got -0.1"),
        (lambda: TrainConfig(average_weights=float("nan")), "average_weights must be .*, got nan"),
        (lambda: TrainConfig(sample_tokens=-1), r"sample_tokens must be >= 0 \(0: no samples\), got -1"),
        (lambda: TrainConfig(eval_every=-1), r"eval_every must be >= 0 \(0: only at the end\), got -1"),
        (lambda: TrainConfig(ckpt_every=-5), r"ckpt_every must be >= 0 \(0: only at the end\), got -5"),
        (lambda: TrainConfig(grad_accum="some"), "grad_accum must be positive or 'auto', got 'some'"),
        (lambda: ModelConfig(loss_chunk=-2), r"model.loss_chunk must be >= 0 or -1 \(auto\), got -2"),
        (lambda: ModelConfig(value_embeddings=-1), r"model.value_embeddings must be >= 0 \(0: none\), got -1"),
        (lambda: ModelConfig(remat="most"), "model.remat must be one of none, dots, projections, full, got 'most'"),
        (lambda: dataclasses.replace(PRESETS["cpu"], data=dataclasses.replace(PRESETS["cpu"].data, seq_len=999)),
         "exceeds model.max_seq_len"),
        (lambda: get_preset("nope"), "unknown preset 'nope'"),
    ],
)  # fmt: skip
def test_bad_values_are_refused(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_optimizer_and_schedule_fields_need_no_subcommand_and_any_order() -> None:
    """`--schedule.total-steps 3000` sets the preset's own schedule; top-level flags may come after it."""
    cfg = parse_train(
        ["--schedule.total-steps", "3000", "--optimizer.b1", "0.8", "--steps", "3000"], "minigpt train"
    )
    assert cfg.steps == 3000 and cfg.schedule.total_steps == 3000 and cfg.optimizer.b1 == 0.8
    assert type(cfg.schedule) is type(PRESETS["cpu"].schedule) and type(cfg.optimizer) is type(
        PRESETS["cpu"].optimizer
    )
    muon = parse_train(["--schedule.peak-lr", "0.02", "optimizer:muon", "--mesh.data", "-1"], "minigpt train")
    assert type(muon.optimizer).__name__ == "Muon" and muon.schedule.peak_lr == 0.02


# The fields a resumed run may change (bookkeeping, run length, device layout, how memory is traded for
# compute); mesh and dist as a whole.
RESUME_SAFE = {
    "run_dir", "overwrite", "steps", "max_time", "max_epochs", "log_every", "eval_every", "eval_batches", "ckpt_every",
    "keep_checkpoints", "sample_prompt", "sample_tokens", "mesh", "dist", "data.cache_dir", "data.gpt2_dir",
    "profile_steps", "peak_tflops", "data.tokenize_workers", "model.remat", "model.loss_chunk", "model.dtype", "wandb",
    "eval_tasks", "eval_tasks_every", "eval_tasks_limit", "eval_tasks_include_path", "average_weights",
}  # fmt: skip


def _marked(cls: type, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        if is_resume_safe(f):
            out.add(prefix + f.name)
        elif dataclasses.is_dataclass(f.default):
            out |= _marked(type(f.default), f"{prefix}{f.name}.")
    return out


def test_exactly_the_resume_safe_fields_are_marked() -> None:
    assert _marked(TrainConfig) == RESUME_SAFE


def test_resume_safe_changes_are_not_reported() -> None:
    old = PRESETS["cpu"]
    data = dataclasses.replace(old.data, cache_dir="/elsewhere", gpt2_dir="/gpt2", tokenize_workers=4)
    model = dataclasses.replace(old.model, remat="full", loss_chunk=0, dtype="bfloat16")
    new = dataclasses.replace(
        old, run_dir="runs/b", overwrite=True, steps=9000, max_time=60.0, max_epochs=9.0, log_every=1, eval_every=7,
        eval_batches=3, ckpt_every=11, keep_checkpoints=9, sample_prompt="Hi", sample_tokens=5,
        mesh=MeshConfig(data=2, fsdp=2, tensor=2, fsdp_min_mbytes=1.0),
        dist=DistributedConfig(coordinator="h:1", num_processes=2, process_id=1, auto=True, timeout_s=5),
        data=data, model=model, profile_steps="3:5", peak_tflops=100.0, wandb=WandbConfig(project="p"),
        eval_tasks=("hellaswag",), eval_tasks_every=50, eval_tasks_limit=0.5, eval_tasks_include_path="tasks",
        average_weights=0.3,
    )  # fmt: skip
    assert config_changes(old, new) == []
    for name in RESUME_SAFE:  # one at a time too (a change elsewhere cannot hide a reported one)
        owner, _, field = name.rpartition(".")
        if owner:  # data.*, model.*
            sub = dataclasses.replace(getattr(old, owner), **{field: getattr(getattr(new, owner), field)})
            one = dataclasses.replace(old, **{owner: sub})
        else:
            one = dataclasses.replace(old, **{field: getattr(new, field)})
        assert one != old and config_changes(old, one) == [], name


def test_unsafe_changes_are_reported_dotted() -> None:
    old = PRESETS["cpu"]

    def changes(**kwargs) -> list[str]:
        return config_changes(old, dataclasses.replace(old, **kwargs))

    assert changes(model=dataclasses.replace(old.model, d_ff=1024), seed=3) == [
        f"model.d_ff: {old.model.d_ff} -> 1024",
        "seed: 0 -> 3",
    ]
    assert changes(batch_size=64) == [f"batch_size: {old.batch_size} -> 64"]
    assert changes(data=dataclasses.replace(old.data, paths=("a.txt",))) == ["data.paths: [] -> ['a.txt']"]
    assert changes(optimizer=Lion()) == ["optimizer.type: 'Muon' -> 'Lion'"]  # one line, not one per field
    assert changes(optimizer=dataclasses.replace(old.optimizer, b1=0.7)) == ["optimizer.b1: 0.8 -> 0.7"]
    assert changes(schedule=dataclasses.replace(old.schedule, total_steps=900)) == [
        "schedule.total_steps: 0 -> 900"
    ]
    # A run's config.json read back compares equal to the config it was written from.
    assert config_changes(from_dict(to_dict(old)), old) == []


def test_a_new_field_is_unsafe_unless_marked() -> None:
    @dataclasses.dataclass(frozen=True)
    class Extended(TrainConfig):
        new_knob: int = 0
        new_bookkeeping: int = resume_safe(0)

    assert config_changes(Extended(), Extended(new_knob=1)) == ["new_knob: 0 -> 1"]
    assert config_changes(Extended(), Extended(new_bookkeeping=1)) == []
    fields = {f.name: f for f in dataclasses.fields(Extended)}
    assert not is_resume_safe(fields["new_knob"]) and is_resume_safe(fields["new_bookkeeping"])


@pytest.mark.parametrize("member", [*get_args(Optimizer), *get_args(Schedule)], ids=lambda c: c.__name__)
def test_subcommand_names_are_what_tyro_accepts(member: type) -> None:
    field = "optimizer" if member in get_args(Optimizer) else "schedule"
    args = ["--preset", "tutorial", f"{field}:{subcommand_name(member)}"]
    cfg = parse_train(args, "minigpt train")
    assert type(getattr(cfg, field)) is member
    assert subcommand_name(getattr(cfg, field)) == subcommand_name(member)  # an instance names its class


def test_subcommand_names() -> None:
    assert [subcommand_name(c) for c in (AdamW, WSDSchedule, CosineDecaySchedule)] == [
        "adam-w",
        "wsd-schedule",
        "cosine-decay-schedule",
    ]


def test_config_errors_are_not_value_errors() -> None:
    """tyro draws a multi-line box around ValueErrors raised while building a config; ConfigError gets through
    to the CLI's one-line handler, from the optimizer module's checks too."""
    assert not issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match=r"AdamW\.b1 must be in \[0, 1\), got 2"):
        AdamW(b1=2)
    with pytest.raises(ConfigError, match=r"AdamW\.b1 must be in \[0, 1\), got 2\.0"):
        parse_train(["optimizer:adam-w", "--optimizer.b1", "2"], "minigpt train")


@pytest.mark.parametrize("member", [*get_args(Optimizer), *get_args(Schedule)], ids=lambda c: c.__name__)
def test_every_optimizer_and_schedule_round_trips_through_json(member: type) -> None:
    field = "optimizer" if member in get_args(Optimizer) else "schedule"
    cfg = dataclasses.replace(PRESETS["tutorial"], **{field: member()})
    assert from_dict(to_dict(cfg)) == cfg


def test_resume_safe_fields_keep_their_help(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        parse_train(["--help"], "minigpt train")
    out = capsys.readouterr().out
    assert "--run-dir STR" in out and "Where config, metrics, plots and checkpoints go" in out
    assert "--max-time FLOAT" in out and "A training-time budget in seconds" in out
    assert "Processes that tokenize in parallel" in out and "--mesh.data INT" in out


def test_profile_steps_parse_as_a_half_open_window() -> None:
    from minigpt.config import parse_steps_window

    assert parse_steps_window("10:15") == (10, 15) and parse_steps_window("") is None
    assert TrainConfig(profile_steps="3:5").profile_window == (3, 5)
    for bad in ("10", "5:5", "7:3", "a:b"):
        with pytest.raises(ConfigError, match="START:END"):
            parse_steps_window(bad)
        with pytest.raises(ConfigError, match="START:END"):
            TrainConfig(profile_steps=bad)


def test_tokens_per_step_counts_every_micro_batch() -> None:
    cfg = TrainConfig(
        batch_size=8, grad_accum=4, data=DataConfig(seq_len=64), model=ModelConfig(max_seq_len=64)
    )
    assert cfg.tokens_per_step == 8 * 4 * 64


def _cpu_dict() -> dict:
    return json.loads(json.dumps(to_dict(PRESETS["cpu"])))


def _set(path: str, value: object) -> Callable[[dict], None]:
    *parents, last = path.split(".")

    def edit(d: dict) -> None:
        for p in parents:
            d = d[p]
        d[last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("future_flag", 1), "unknown key 'future_flag' (from another minigpt version?)"),
        (_set("optimizer.future", 1), "unknown key 'optimizer.future' (from another minigpt version?)"),
        (lambda d: d["model"].pop("type"), 'model has no "type" tag ("ModelConfig")'),
        (lambda d: d["schedule"].pop("type"),
         'schedule has no "type" tag ("CosineDecaySchedule" or "RsqrtDecaySchedule" or "WSDSchedule" or '
         '"ConstantSchedule")'),
        (_set("optimizer.type", "Adam"), "optimizer.type is 'Adam', not one of AdamW, SGD, Lion, Muon"),
        (_set("optimizer.type", "WSDSchedule"), "optimizer.type is 'WSDSchedule', not one of AdamW, SGD"),
        (_set("model", 3), "model is an integer, not a config object"),
        (_set("model.d_model", "256"), 'model.d_model must be int, not "256"'),
        (_set("model.d_model", 2.5), "model.d_model must be int, not 2.5"),
        (_set("model.qk_norm", "yes"), 'model.qk_norm must be bool, not "yes"'),
        (_set("model.norm", "batchnorm"), 'model.norm must be one of "layernorm", "rmsnorm", not "batchnorm"'),
        (_set("data.paths", "a.txt"), 'data.paths must be a list of str, not "a.txt"'),
        (_set("data.gpt2_dir", 3), "data.gpt2_dir must be str | None, not 3"),
        (_set("steps", None), "steps must be int, not null"),
        (_set("steps", -1), "steps must be positive, got -1"),  # the configs' own checks still apply
    ],
)  # fmt: skip
def test_from_dict_refuses_what_is_not_a_minigpt_config(edit: Callable[[dict], None], message: str) -> None:
    d = _cpu_dict()
    edit(d)
    with pytest.raises(ConfigError) as e:
        from_dict(d)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_from_dict_fills_missing_keys_and_reads_json_numbers() -> None:
    d = _cpu_dict()
    del d["model"]["dropout"], d["seed"]  # an older config: the defaults fill in
    d["schedule"]["peak_lr"] = 1  # JSON may write a float field as an integer
    cfg = from_dict(d)
    assert cfg.model.dropout == 0.0 and cfg.seed == 0
    assert cfg.schedule.peak_lr == 1.0 and isinstance(cfg.schedule.peak_lr, float)
    for saved, policy in ((True, "full"), (False, "none")):  # remat was a flag before it was a policy
        assert from_dict({**d, "model": {**d["model"], "remat": saved}}).model.remat == policy
    with pytest.raises(ConfigError, match="the config is a list, not an object"):
        from_dict([1, 2])


D = PRESETS["cpu"].model.d_model


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda text: text[: len(text) // 2], "it ends mid-way, at byte "),
        (lambda text: "", "it is empty"),
        (lambda text: text.replace('"steps": 100000,', '"steps": 100000,,'), "invalid JSON: Expecting property name"),
        (lambda text: text.replace('"seed": 0,', '"seed": 0, "zloss": 1e-4,'), "unknown key 'zloss'"),
        (lambda text: text.replace('"type": "WSDSchedule",', ""), 'schedule has no "type" tag'),
        (lambda text: text.replace(f'"d_model": {D}', f'"d_model": "{D}"'), f'model.d_model must be int, not "{D}"'),
        (lambda text: "[1, 2]", "the config is a list, not an object"),
    ],
)  # fmt: skip
def test_load_json_names_the_damaged_config_in_one_line(
    tmp_path: Path, damage: Callable[[str], str], why: str
) -> None:
    path = tmp_path / "config.json"
    save_json(PRESETS["cpu"], str(path))
    assert load_json(str(path)) == PRESETS["cpu"]
    text = path.read_text()
    damaged = damage(text)
    assert damaged != text
    path.write_text(damaged)
    with pytest.raises(ConfigError) as e:
        load_json(str(path))
    message = str(e.value)
    assert message.startswith(f"{path} is not a readable minigpt config (") and why in message, message
    assert message.endswith(
        f"restore it from a copy, or delete it and resume with `minigpt train --run-dir {tmp_path}` and the run's "
        "flags, which writes it again"
    )
    assert "\n" not in message


def test_token_stores_live_where_the_compilation_cache_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default --data.cache-dir follows $MINIGPT_CACHE_DIR, then $XDG_CACHE_HOME, as the compilation cache
    and the measured peak do; a run records the folder it resolved to."""
    from minigpt.config import DataConfig

    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "own"))
    assert DataConfig().cache() == tmp_path / "own"
    monkeypatch.delenv("MINIGPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert DataConfig().absolute().cache_dir == str(tmp_path / "xdg" / "minigpt")
    assert DataConfig(cache_dir=str(tmp_path / "mine")).cache() == tmp_path / "mine"
