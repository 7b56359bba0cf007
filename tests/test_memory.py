"""The memory plan of a training step: per-device terms planned from shapes, checked against the real sharded
state; the quick bound `train` checks first; `--grad-accum auto` picks a micro-batch that fits."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import run_on_devices

from minigpt.config import ConfigError, MeshConfig, TrainConfig, from_dict, get_preset, to_dict
from minigpt.training import devices, memory

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
from minigpt.config import MeshConfig, get_preset
from minigpt.training import memory
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
    terms = memory.make_plan(cfg, "cpu", 8).terms
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


@pytest.mark.parametrize(("kind", "scan"), [("tpu-v4", False), ("cpu", True)])
def test_remat_policies_order_the_activations(kind: str, scan: bool) -> None:
    """On accelerators every policy applies; XLA:CPU honours them in scanned layers only."""
    sizes = [
        memory.make_plan(_cfg(**{**SMALL, "scan_layers": scan, "remat": r}), kind, 1).terms["activations"]
        for r in ("none", "dots", "projections", "full")
    ]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1], sizes


def test_cpu_plans_unrolled_remat_as_none() -> None:
    none, full = (memory.make_plan(_cfg(**SMALL, remat=r), "cpu", 1).terms for r in ("none", "full"))
    assert none["activations"] == full["activations"]


def test_chunked_logits_are_smaller_than_unchunked() -> None:
    chunked, unchunked = (
        memory.make_plan(_cfg(vocab=50257, **SMALL, loss_chunk=c), "cpu", 1).terms["logits"] for c in (32, 0)
    )
    assert 2 * chunked < unchunked, (chunked, unchunked)


def test_the_total_counts_only_the_largest_transient_and_gpus_keep_jax_memory_fraction(monkeypatch) -> None:
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    p = memory.make_plan(_cfg(**SMALL), "h100", 1)
    resident = sum(p.terms[k] for k in memory.RESIDENT)
    assert p.total == resident + max(p.terms[k] for k in memory.TRANSIENT)
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
    assert 2 * memory.make_plan(cfg, kind, count).total <= memory.quick_bound(cfg, kind, count)


def test_train_traces_no_plan_for_a_step_far_from_the_memory() -> None:
    memory.residuals.cache_clear()
    memory.refuse_what_cannot_fit(_cfg(**SMALL))
    assert memory.residuals.cache_info().currsize == 0


def test_grad_accum_auto_keeps_the_global_batch_and_refuses_what_never_fits(monkeypatch) -> None:
    cfg = dataclasses.replace(_cfg(batch=64, seq=16, vocab=300, **TINY), grad_accum="auto")
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 3 * 2**20)
    lines: list[str] = []
    resolved = memory.resolve_grad_accum(cfg, log=lines.append)
    assert isinstance(resolved.grad_accum, int) and resolved.grad_accum > 1
    assert resolved.batch_size * resolved.grad_accum == 64 and memory.make_plan(resolved, "cpu", 1).fits
    assert lines[0].startswith(
        f"grad_accum auto: micro-batch {resolved.batch_size} x {resolved.grad_accum} = 64"
    )
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 2**18)
    with pytest.raises(ConfigError, match=r"^grad_accum auto: one sequence per device does not fit: needs"):
        memory.resolve_grad_accum(cfg)


def test_grad_accum_auto_is_a_config_value_that_needs_resolving() -> None:
    cfg = TrainConfig(grad_accum="auto")
    assert from_dict(to_dict(cfg)).grad_accum == "auto" and from_dict(to_dict(TrainConfig())).grad_accum == 1
    with pytest.raises(ConfigError, match="must be resolved"):
        cfg.tokens_per_step  # noqa: B018
    with pytest.raises(ConfigError, match="grad_accum must be positive or 'auto'"):
        TrainConfig(grad_accum="many")
    assert memory.resolve_grad_accum(TrainConfig(grad_accum=3)).grad_accum == 3


def test_a_tpu_plan_keeps_no_attention_scores_where_splash_runs() -> None:
    """On a TPU, auto runs sequences of 512 tokens or more through the splash kernel, which keeps softmax
    statistics for the backward pass instead of the (T, T) probabilities: the plan follows (it once planned
    gpt2-124m's batch 16 at 19.4 GiB where XLA's compiled step needed 12.5)."""
    long = _cfg(batch=8, seq=512, vocab=1000, **SMALL)
    xla = dataclasses.replace(long, model=dataclasses.replace(long.model, attention="xla"))
    fused, scores = (memory.make_plan(c, "tpu-v5e", 1).terms["activations"] for c in (long, xla))
    T, N = 512, SMALL["n_heads"]
    assert scores - fused >= SMALL["n_layers"] * 8 * N * T * T  # at least a bfloat16 (T, T) array per layer
    assert memory.flash_attention(long.model, "tpu-v5e", 512)
    assert not memory.flash_attention(long.model, "tpu-v5e", 256)  # short sequences: XLA's attention
