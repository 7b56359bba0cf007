"""The FLOPs model against XLA's own count, the convention's arithmetic, reading back a metrics.jsonl that a
killed run left torn, and the optional Weights & Biases run (offline, read back)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from conftest import subprocess_env

from minigpt.config import DataConfig, ModelConfig, TrainConfig
from minigpt.runtime.errors import DataWarning
from minigpt.training.metrics import (
    MetricsWriter,
    flops_per_step,
    flops_per_token,
    forward_flops_per_token,
    plot_losses,
    read_metrics,
    wandb_run_id,
)

# Three small shapes, each dominated by a different part of the model, so that the count of each part is
# checked: leaving a part out (or counting it twice) moves the total by more than the 10% tolerance.
SHAPES = {
    # name: (d_model, n_heads, d_ff, seq_len, vocab, batch, tied, the part that must carry > 25% of the FLOPs)
    "mlp-heavy": (256, 4, 1024, 64, 512, 4, True, "mlp"),
    "lm-head-heavy": (128, 2, 256, 32, 2048, 4, False, "lm_head"),
    "attention-heavy": (64, 2, 256, 256, 256, 2, True, "attention"),
}


def _config(d: int, heads: int, ff: int, seq: int, vocab: int, batch: int, tied: bool) -> TrainConfig:
    model = ModelConfig(vocab_size=vocab, max_seq_len=seq, d_model=d, n_layers=1, n_heads=heads, d_ff=ff,
                        tie_embeddings=tied)  # fmt: skip
    return TrainConfig(model=model, data=DataConfig(seq_len=seq), batch_size=batch, grad_accum=1)


@pytest.mark.parametrize("name", list(SHAPES))
def test_flops_model_agrees_with_xla_cost_analysis_of_the_train_step(name: str) -> None:
    """XLA's HloCostAnalysis of the compiled train step counts 2 flops per multiply-add in each dot, as we do,
    plus ~1 per element of every elementwise op (norms, GELU, softmax, the loss, AdamW's update) that our
    model-FLOPs convention leaves out: a few percent for these matmul-dominated shapes. Three differences are
    handled: XLA's CPU attention computes the whole T x T score matrix and then masks it, so we compare with
    `causal=False`; it counts a loop body once whatever the trip count, so grad_accum is 1 (the
    accumulation `lax.scan` runs once); and it counts a conditional's costlier branch, so the output layer's
    second pass, shifted by the logits' maxima, is counted although a step runs it only where exponentials
    overflow (`loss._nll_sum_fwd`)."""
    *shape, part = SHAPES[name]
    cfg = _config(*shape)
    _assert_matches_xla(cfg)
    parts = forward_flops_per_token(cfg.model, cfg.data.seq_len, causal=False)
    assert parts[part] / sum(parts.values()) > 0.25, parts  # the check above would notice this part missing


def _assert_matches_xla(cfg: TrainConfig) -> None:
    from minigpt.training.trainer import build, make_train_step

    setup = build(cfg, jax.devices()[:1])
    batch = jax.ShapeDtypeStruct((1, cfg.batch_size, cfg.data.seq_len + 1), jnp.int32)
    cost = make_train_step(setup).lower(setup.abstract_state, batch, cfg.steps).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ours = flops_per_step(cfg, causal=False)
    ours += 3 * forward_flops_per_token(cfg.model, cfg.data.seq_len)["lm_head"] * cfg.tokens_per_step
    assert cost["flops"] / ours == pytest.approx(1.0, abs=0.10), (cost["flops"], ours)


def test_flops_model_counts_grouped_query_attention_and_swiglu() -> None:
    """Narrower k/v projections (2 of 8 heads) and SwiGLU's third matrix: each is ~15% of this model."""
    cfg = _config(256, 8, 768, 64, 512, 4, True)
    modern = {"n_kv_heads": 2, "activation": "swiglu", "position": "rope", "norm": "rmsnorm", "bias": False}
    _assert_matches_xla(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **modern)))


def test_flops_convention_for_gpt2_small_by_hand() -> None:
    """GPT-2 small, T=1024, vocab padded to 50304: per token and layer 2*(4*d^2 + 2*d*ff) for the weights and
    2*2*d*(T+1)/2 for causal attention, 2*d*V for the head, the embedding lookup nothing; training is 3x."""
    m = ModelConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072)
    assert m.padded_vocab == 50304
    forward = 12 * 2 * (4 * 768**2 + 2 * 768 * 3072) + 12 * 2 * 2 * 768 * 1025 / 2 + 2 * 768 * 50304
    assert flops_per_token(m, 1024) == pytest.approx(3 * forward)
    assert flops_per_token(m, 1024) == 798_087_168
    # The causal mask saves (T - 1) / 2 of the T keys per query in QK^T and AV, forward and backward.
    saved = flops_per_token(m, 1024, causal=False) - flops_per_token(m, 1024)
    assert saved == pytest.approx(3 * 12 * 2 * 2 * 768 * (1024 - 1025 / 2))
    cfg = TrainConfig(model=m, data=DataConfig(seq_len=1024), batch_size=64, grad_accum=8)
    assert flops_per_step(cfg) == pytest.approx(flops_per_token(m, 1024) * 64 * 8 * 1024)


# ---------------------------------------------------------------------------------- metrics.jsonl, torn


def _records(steps: range) -> str:
    return "".join(json.dumps({"step": s, "kind": "train", "loss": 1.0 / s}) + "\n" for s in steps)


def test_a_torn_last_line_is_skipped_silently_and_the_loss_plot_still_draws(tmp_path: Path) -> None:
    """A run killed mid-append leaves half a record at the end of metrics.jsonl: every later read (the loss
    plot, time_to_quality) must still work."""
    (tmp_path / "metrics.jsonl").write_text(_records(range(1, 4)) + '{"step": 4, "kind": "tr')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the torn last line
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        assert plot_losses(tmp_path).is_file()


def test_an_unreadable_line_before_the_last_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        _records(range(1, 3)).encode() + b'{"step": 3, "ki\n\xff\xfe\n' + _records(range(4, 6)).encode()
    )
    with pytest.warns(DataWarning) as caught:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 4, 5]
    assert [str(w.message) for w in caught] == [
        f"{path} line 3 is not a JSON record; skipped",
        f"{path} line 4 is not a JSON record; skipped",
    ]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here")
def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path: Path) -> None:
    """tensorboardX imports torch wherever it is installed (seconds of every train's start); the writer keeps
    it out, and torch still imports afterwards for whoever wants it."""
    code = (
        "import sys\n"
        "from minigpt.training.metrics import MetricsWriter\n"
        "w = MetricsWriter(sys.argv[1])\n"
        "w.write(3, 'train', {'loss': 1.5})\n"
        "w.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import torch\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(),
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert b"train/loss" in events.read_bytes()


def test_the_writer_starts_a_fresh_line_after_a_torn_one(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(_records(range(1, 3)) + '{"step": 3, "kind": "tr')
    writer = MetricsWriter(tmp_path)
    writer.write(3, "train", {"loss": 0.5})
    writer.write(4, "train", {"loss": 0.25})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[2] == '{"step": 3, "kind": "tr'  # the torn record stays on a line of its own
    assert [json.loads(line)["step"] for line in lines[3:]] == [3, 4]
    with pytest.warns(DataWarning, match="line 3 is not a JSON record"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- Weights & Biases, offline

TINY_RUN = [
    "--model.d-model", "32", "--model.n-heads", "2", "--model.n-layers", "1", "--model.d-ff", "64",
    "--model.max-seq-len", "16", "--data.seq-len", "16", "--data.bpe-vocab-size", "300", "--batch-size", "4",
    "--max-time", "0", "--log-every", "2", "--eval-every", "4", "--eval-batches", "2", "--ckpt-every", "2",
    "--sample-tokens", "4",
]  # fmt: skip


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb's own files in tmp_path, no prompts, no error reports, and a server address nothing answers at:
    an offline run must not need the network, and a test must never reach W&B's servers."""
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name, value in {"WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false", "WANDB_DISABLE_GIT": "true",
                        "WANDB_DISABLE_CODE": "true", "WANDB_BASE_URL": "http://127.0.0.1:9"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def read_wandb_file(path: Path) -> list[Any]:
    """The records (wandb_internal_pb2.Record protobufs) of a .wandb file, read without wandb's service: a
    7-byte header (':W&B', magic, version), then LevelDB-log framing: 32 KiB blocks of chunks, each a 7-byte
    header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's last < 7 bytes
    are padding. wandb 0.31 has no Python reader of its own (wandb-core, in Go, reads them)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding: the end of what was written
            break
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(path: Path) -> tuple[str, dict[int, dict[str, float]]]:
    """(the run id, {step: {key: value}}) of the history an offline .wandb file holds."""
    run_ids, history = set(), {}
    for record in read_wandb_file(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_ids.add(record.run.run_id)
        elif kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.setdefault(record.history.step.num, {}).update(items)
    (run_id,) = run_ids
    return run_id, history


def _train_cli(*flags: str) -> dict:
    from minigpt.app.train import train
    from minigpt.commands.flags import parse_train

    return train(parse_train([*TINY_RUN, *flags], "minigpt train"))


def test_an_offline_wandb_run_logs_the_metrics_and_a_resumed_run_continues_it(
    small_corpus: Path, tmp_path: Path, offline_wandb: None
) -> None:
    """`--wandb.project X --wandb.mode offline` leaves an offline W&B run in the run directory whose history
    holds what metrics.jsonl holds (train loss at each logged step, val bits per byte at each evaluation),
    keyed kind/name at the same steps, and whose config is the run's. Resumed, the run logs to the same W&B
    run id; started again from step 0, to a new one."""
    run = tmp_path / "run"
    flags = ["--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), "--run-dir", str(run),
             "--wandb.project", "X", "--wandb.mode", "offline", "--wandb.tags", "tiny", "test"]  # fmt: skip
    _train_cli(*flags, "--steps", "4")
    (first,) = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    run_id, history = wandb_history(first)
    assert (run / "wandb" / "run_id").read_text().strip() == run_id
    records = read_metrics(run)
    train_rows = {r["step"]: r for r in records if r["kind"] == "train"}
    assert sorted(train_rows) == [2, 4] and [r["step"] for r in records if r["kind"] == "val"] == [4]
    for step, row in train_rows.items():
        assert history[step]["train/loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert history[step]["train/lr"] == pytest.approx(row["lr"], rel=1e-6)
    (val,) = [r for r in records if r["kind"] == "val"]
    assert history[4]["val/bpb"] == pytest.approx(val["bpb"], rel=1e-6) and 0 < val["bpb"] < 20
    config = {i.key: json.loads(i.value_json) for r in read_wandb_file(first) if r.HasField("run")
              for i in r.run.config.update}  # fmt: skip
    assert config["steps"] == 4 and config["model"]["d_model"] == 32 and config["wandb"]["project"] == "X"

    _train_cli(*flags, "--steps", "6")  # resumes from the checkpoint at step 4
    (second,) = set(run.glob("wandb/offline-run-*/run-*.wandb")) - {first}
    resumed_id, resumed = wandb_history(second)
    assert resumed_id == run_id and sorted(resumed) == [6]
    assert resumed[6]["train/loss"] == pytest.approx(read_metrics(run)[-2]["loss"], rel=1e-6)
    assert "val/bpb" in resumed[6]
    # A run that starts again from step 0 (--overwrite, or no checkpoint yet) is a new W&B run.
    new_id = wandb_run_id(run, resumed=False)
    assert new_id != run_id and wandb_run_id(run, resumed=True) == new_id


def test_without_wandb_installed_a_project_fails_at_start_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from minigpt.config import ConfigError, WandbConfig

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = TrainConfig(wandb=WandbConfig(project="X", mode="offline"))
    with pytest.raises(ConfigError) as caught:
        MetricsWriter(tmp_path, config=cfg)
    assert str(caught.value) == "--wandb.project needs wandb: pip install 'minigpt[wandb]'"
    assert not (tmp_path / "tb").exists()
    # No project, mode disabled, or not the writing process: wandb is never imported.
    for writer in (
        MetricsWriter(tmp_path / "a", config=TrainConfig()),
        MetricsWriter(tmp_path / "b", config=TrainConfig(wandb=WandbConfig(project="X", mode="disabled"))),
        MetricsWriter(tmp_path / "c", enabled=False, config=cfg),
    ):
        writer.write(1, "train", {"loss": 1.0})
        writer.close()
    assert not list(tmp_path.glob("*/wandb"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--wandb.entity", "me"], "wandb.entity is set but wandb.project is empty; name the project: --wandb.project NAME"),
        (["--wandb.tags", "a"], "wandb.tags is set but wandb.project is empty; name the project: --wandb.project NAME"),
        (["--wandb.project", "team/proj"], "wandb.project 'team/proj' must be at most 128 characters without any of / \\ # ? % :; give a team with --wandb.entity, not as part of the project"),
        (["--wandb.project", "p", "--wandb.name", ""], "wandb.name is empty; leave --wandb.name out for the default"),
        (["--wandb.project", "p", "--wandb.tags", "x" * 65], f"wandb.tags: '{'x' * 65}' must be 1 to 64 characters long (W&B's limit)"),
        (["--wandb.mode", "cloud"], "invalid choice 'cloud' for argument '--wandb.mode'"),
    ],
)  # fmt: skip
def test_bad_wandb_flags_are_refused_in_one_line(
    capsys: pytest.CaptureFixture, flags: list[str], message: str
) -> None:
    from conftest import cli_error

    assert message in cli_error(capsys, ["train", *flags])


def test_wandb_settings_round_trip_change_on_resume_and_old_configs_load() -> None:
    from minigpt.config import WandbConfig, config_changes, from_dict, to_dict

    cfg = TrainConfig(
        wandb=WandbConfig(project="p", mode="offline", entity="team", name="n", tags=("a", "b"))
    )
    saved = json.loads(json.dumps(to_dict(cfg)))
    assert saved["wandb"] == {"type": "WandbConfig", "project": "p", "mode": "offline", "entity": "team",
                              "name": "n", "tags": ["a", "b"]}  # fmt: skip
    assert from_dict(saved) == cfg
    del saved["wandb"]  # a config.json written before the tracker existed
    assert from_dict(saved).wandb == WandbConfig() and not WandbConfig().enabled
    assert config_changes(cfg, TrainConfig()) == []  # tracker settings may change when a run resumes
