"""`minigpt plan`: per-device memory planned from shapes, checked against the real sharded state and XLA's
compiled step; `--grad-accum auto` picks a micro-batch that fits and records ints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import cli_error, run_on_devices
from test_cli import TINY_FLAGS

from minigpt.config import ConfigError, MeshConfig, TrainConfig, from_dict, get_preset, to_dict
from minigpt.tools import devices, plan

CPU = get_preset("cpu")


def _cfg(batch: int = 16, seq: int = 128, vocab: int = 4096, **model) -> TrainConfig:
    m = dataclasses.replace(CPU.model, vocab_size=vocab, max_seq_len=max(seq, 128), **model)
    return dataclasses.replace(
        CPU, model=m, data=dataclasses.replace(CPU.data, seq_len=seq), batch_size=batch
    )


SMALL = {"d_model": 128, "n_layers": 2, "n_heads": 2, "d_ff": 512}
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64}  # test_cli's TINY_FLAGS

STATE_WORKER = """
import dataclasses, json
import jax
from minigpt.tools import plan
from minigpt.config import MeshConfig, get_preset
from minigpt.training.trainer import build, init_state

cpu = get_preset("cpu")
model = dataclasses.replace(cpu.model, vocab_size=1000, d_model=128, n_layers=2, n_heads=4, d_ff=512)
out = {}
layouts = {"fsdp8": ((1, 8, 1), 0.0), "data2_fsdp2_tensor2_averaged": ((2, 2, 2), 0.3)}
for name, ((d, f, t), average) in layouts.items():
    cfg = dataclasses.replace(cpu, model=model, batch_size=16, average_weights=average,
                              mesh=MeshConfig(data=d, fsdp=f, tensor=t, fsdp_min_mbytes=0))
    state = init_state(build(cfg))
    dev = jax.devices()[0]
    mine = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                            if s.device == dev)
    terms = plan.make_plan(cfg, "cpu", 8).terms
    out[name] = {"plan": [terms["parameters"], terms["optimizer state"], terms["gradients"]],
                 "real": [mine(state.params), mine((state.opt_state, state.step, state.rng, state.average)), mine(state.params)],
                 "whole": sum(x.nbytes for x in jax.tree.leaves(state.params)), "average": mine(state.average)}
print(json.dumps(out))
"""


def test_state_terms_are_the_real_sharded_state_per_device_on_8_devices() -> None:
    """Parameters, optimizer state (with a weight average where the run keeps one) and gradients (float32,
    like the parameters) are exact: the plan's abstract mesh gives one device's shards the bytes a real
    8-device state has on device 0."""
    for layout, r in run_on_devices(STATE_WORKER, devices=8).items():
        assert r["plan"] == r["real"], layout
        assert r["real"][0] < r["whole"] / 2, layout  # really sharded, not replicated
        assert r["average"] == (r["real"][0] if layout.endswith("averaged") else 0), layout


@pytest.mark.parametrize(
    "model", [SMALL, {**SMALL, "scan_layers": True, "remat": "full"}], ids=["unrolled", "scanned-remat-full"]
)
def test_plan_total_is_within_15_percent_of_xla(model: dict) -> None:
    cfg = _cfg(**model)
    planned, measured = plan.make_plan(cfg, "cpu", 1).total, plan.measure(cfg)
    assert abs(planned / measured - 1) < 0.15, (planned, measured)


@pytest.mark.parametrize(("kind", "scan"), [("tpu-v4", False), ("cpu", True)])
def test_remat_policies_order_the_activations(kind: str, scan: bool) -> None:
    """On accelerators every policy applies; XLA:CPU honours them in scanned layers only."""
    sizes = [
        plan.make_plan(_cfg(**{**SMALL, "scan_layers": scan, "remat": r}), kind, 1).terms["activations"]
        for r in ("none", "dots", "projections", "full")
    ]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1], sizes


def test_cpu_plans_unrolled_remat_as_none() -> None:
    none, full = (plan.make_plan(_cfg(**SMALL, remat=r), "cpu", 1).terms for r in ("none", "full"))
    assert none["activations"] == full["activations"]


def test_chunked_logits_are_smaller_than_unchunked() -> None:
    chunked, unchunked = (
        plan.make_plan(_cfg(vocab=50257, **SMALL, loss_chunk=c), "cpu", 1).terms["logits"] for c in (32, 0)
    )
    assert 2 * chunked < unchunked, (chunked, unchunked)


def test_the_total_counts_only_the_largest_transient_and_gpus_keep_jax_memory_fraction(monkeypatch) -> None:
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    p = plan.make_plan(_cfg(**SMALL), "h100", 1)
    resident = sum(p.terms[k] for k in plan.RESIDENT)
    assert p.total == resident + max(p.terms[k] for k in plan.TRANSIENT)
    assert p.capacity == int(80 * 2**30 * 0.75) and p.fits


GPT2_BLOCK = {
    "position": "learned",
    "norm": "layernorm",
    "activation": "gelu",
    "bias": True,
    "qk_norm": False,
}
BOUNDED = {  # the blocks, dtypes, remat, loss and layouts a step's quick bound must stay above the plan for
    "cpu preset, unchunked": (_cfg(dtype="float32", loss_chunk=0), "cpu", 2),
    "GPT-2's block, tied, bfloat16": (_cfg(vocab=50257, **GPT2_BLOCK, tie_embeddings=True, dtype="bfloat16"), "cpu", 1),
    "Llama's, scanned, full remat, h100": (_cfg(**SMALL | {"n_heads": 8}, activation="swiglu", n_kv_heads=2,
                                                scan_layers=True, remat="full"), "h100", 8),
    "1024 positions, fsdp x tensor": (dataclasses.replace(_cfg(seq=1024, **SMALL), mesh=MeshConfig(2, 2, 2)), "cpu", 8),
    "one short row: the weights": (_cfg(batch=1, seq=32, vocab=512, **TINY), "cpu", 1),
    "grad_accum 4": (dataclasses.replace(_cfg(batch=8), grad_accum=4), "cpu", 1),
}  # fmt: skip


@pytest.mark.parametrize("name", BOUNDED)
def test_the_quick_bound_stays_twice_above_the_plan(name: str) -> None:
    """`train` skips the plan (seconds of tracing) for a step whose quick bound is within half the usable
    memory: that is only safe while the bound is above every plan, here with a margin of 2 (3.4 or more when
    QUICK_FLOATS was set)."""
    cfg, kind, count = BOUNDED[name]
    assert 2 * plan.make_plan(cfg, kind, count).total <= plan.quick_bound(cfg, kind, count)


def test_train_traces_no_plan_for_a_step_far_from_the_memory() -> None:
    plan.residuals.cache_clear()
    plan.refuse_what_cannot_fit(_cfg(**SMALL))
    assert plan.residuals.cache_info().currsize == 0


def test_a_plan_that_does_not_fit_exits_1_with_one_line_naming_the_largest_term(
    capsys: pytest.CaptureFixture,
) -> None:
    from minigpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--device", "tpu-v5e", "--batch-size", "8192", "--no-measure"])
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    assert "does NOT fit" in out and "| activations |" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("minigpt: error: does not fit: needs ") and "(tpu-v5e" in lines[0]
    assert "the largest term is activations" in lines[0] and "--grad-accum auto (micro-batch" in lines[0]


def test_plan_for_many_accelerators_and_a_bad_device(capsys: pytest.CaptureFixture) -> None:
    from minigpt.cli import main

    main(["plan", "--preset", "gpt2-124m", "--device", "h100", "--devices", "8", "--no-measure"])
    out = capsys.readouterr().out
    assert "8 x h100 (mesh data 8 x fsdp 1 x tensor 1)" in out and "fits:" in out
    err = cli_error(capsys, ["plan", "--device", "b200"])
    assert "unknown device kind 'b200'; choose one of: cpu, h100, h200, a100-40gb" in err
    err = cli_error(capsys, ["plan", "--devices", "3", "--mesh.data", "2", "--no-measure"])
    assert "mesh data x fsdp x tensor = 2x1x1 = 2 devices, but there are 3" in err


def test_grad_accum_auto_keeps_the_global_batch_and_refuses_what_never_fits(monkeypatch) -> None:
    cfg = dataclasses.replace(_cfg(batch=64, seq=16, vocab=300, **TINY), grad_accum="auto")
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 3 * 2**20)
    lines: list[str] = []
    resolved = plan.resolve_grad_accum(cfg, log=lines.append)
    assert isinstance(resolved.grad_accum, int) and resolved.grad_accum > 1
    assert resolved.batch_size * resolved.grad_accum == 64 and plan.make_plan(resolved, "cpu", 1).fits
    assert lines[0].startswith(
        f"grad_accum auto: micro-batch {resolved.batch_size} x {resolved.grad_accum} = 64"
    )
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 2**18)
    with pytest.raises(ConfigError, match=r"^grad_accum auto: one sequence per device does not fit: needs"):
        plan.resolve_grad_accum(cfg)


def test_grad_accum_auto_is_a_config_value_that_needs_resolving() -> None:
    cfg = TrainConfig(grad_accum="auto")
    assert from_dict(to_dict(cfg)).grad_accum == "auto" and from_dict(to_dict(TrainConfig())).grad_accum == 1
    with pytest.raises(ConfigError, match="must be resolved"):
        cfg.tokens_per_step  # noqa: B018
    with pytest.raises(ConfigError, match="grad_accum must be positive or 'auto'"):
        TrainConfig(grad_accum="many")
    assert plan.resolve_grad_accum(TrainConfig(grad_accum=3)).grad_accum == 3


@pytest.mark.slow
def test_train_with_grad_accum_auto_picks_a_micro_batch_and_records_ints(
    small_corpus: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture
) -> None:
    """A 64-sequence batch that does not fit a (pretend) 3 MiB host trains as 4 micro-batches of 16."""
    from minigpt.cli import main

    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 3 * 2**20)
    run = tmp_path / "run"
    flags = [*TINY_FLAGS, "--batch-size", "64", "--grad-accum", "auto", "--steps", "2", "--eval-every", "2"]
    main(["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"),
          "--run-dir", str(run), *flags, "--sample-tokens", "2", "--eval-batches", "1"])  # fmt: skip
    out = capsys.readouterr().out
    saved = json.loads((run / "config.json").read_text())
    assert saved["grad_accum"] > 1 and saved["batch_size"] * saved["grad_accum"] == 64
    assert f"grad_accum auto: micro-batch {saved['batch_size']} x {saved['grad_accum']} = 64 sequences" in out
    assert "done: step 2" in out


def test_train_refuses_a_step_that_cannot_fit_before_anything_else(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A batch no machine holds (2^20 sequences: terabytes) is refused by `train` in one line with the plan's
    figure and the flag that fits, before any text is read or program compiled (it once ended after 107 s
    in an allocation error); nothing is left in the run directory."""
    missing = tmp_path / "not-read.txt"
    err = cli_error(capsys, ["train", "--batch-size", str(2**20), "--data", str(missing), "--run-dir", "run"])
    assert (
        err.startswith("minigpt: error: the train step does not fit: needs ") and "--grad-accum auto" in err
    )
    assert not (tmp_path / "run").exists()
