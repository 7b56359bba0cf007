"""`minigpt plan`'s report: the memory plan of a training step (`training.memory`) as a table, beside XLA's own
figure for the compiled step (`measure`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from minigpt.config import TrainConfig
from minigpt.nn import loss
from minigpt.parallel import sharding
from minigpt.training.devices import device_kind, fmt_bytes
from minigpt.training.memory import HEADROOM, TERMS, Plan, device_model, flash_attention, planning_config
from minigpt.training.trainer import build, make_train_step


def _chunk_name(cfg: TrainConfig, kind: str) -> str:
    m = cfg.model
    if m.loss_chunk != -1:
        return str(m.loss_chunk or "off")
    platform = "cpu" if kind == "cpu" else "accelerator"
    positions = loss.chunk_positions(-1, cfg.batch_size, cfg.data.seq_len, m.padded_vocab, platform)
    return f"auto ({positions} positions)"


def format_plan(plan: Plan, measured: int | None = None, measure_note: str = "") -> str:
    """The plan as a markdown table (per device), with XLA's figure for the compiled step when measured."""
    cfg, (d, f, t) = plan.cfg, plan.mesh
    lines = [
        f"plan: {plan.devices} x {plan.kind} (mesh data {d} x fsdp {f} x tensor {t}), micro-batch {plan.micro_batch} "
        f"x {cfg.data.seq_len} tokens per device, grad_accum {cfg.grad_accum}, remat {cfg.model.remat}, "
        f"loss chunk {_chunk_name(cfg, plan.kind)}, vocab {cfg.model.vocab_size}",
        "",
        "| term | per device | what |",
        "|---|---:|---|",
    ]
    lines += [f"| {k} | {fmt_bytes(v)} | {TERMS[k]} |" for k, v in plan.terms.items()]
    lines.append(f"| **total** | **{fmt_bytes(plan.total)}** | resident terms + the largest transient |")
    lines.append(f"| capacity | {fmt_bytes(plan.capacity)} | {plan.capacity_note} |")
    if measured is not None:
        off = plan.total / measured - 1
        lines.append(
            f"| XLA, compiled step | {fmt_bytes(measured)} | argument + output - alias + temp ({off:+.0%} plan vs XLA) |"
        )
    elif measure_note:
        lines.append(f"| XLA, compiled step | n/a | {measure_note} |")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines += [
        "",
        f"{verdict}: {fmt_bytes(plan.total)} of {fmt_bytes(plan.usable)} usable per device ({HEADROOM:.0%} headroom kept)",
    ]
    return "\n".join(lines + _notes(plan))


def _notes(plan: Plan) -> list[str]:
    """What the plan assumes that the config does not say: how the device runs it."""
    m, planned = plan.cfg.model, device_model(plan.cfg, plan.kind)
    notes = []
    if m.remat != planned.remat:
        notes.append(f"note: XLA:CPU ignores remat {m.remat} in unrolled layers (add --model.scan-layers)")
    if m.dtype != planned.dtype:
        notes.append(f"note: planned in {planned.dtype} (--model.dtype {m.dtype} on {plan.kind})")
    if plan.kind == "cpu" and planned.dtype == "bfloat16":
        notes.append(
            "note: XLA:CPU's bfloat16 step also keeps float32 products and transposed copies the plan leaves "
            "out: it may need up to a quarter more (benchmarks/plan_check.py)"
        )
    if flash_attention(planned, plan.kind, plan.cfg.data.seq_len):
        kernel = "splash" if device_kind(plan.kind).is_tpu else "cuDNN's fused"
        notes.append(f"note: attention planned as the {kernel} kernel (softmax statistics, no T x T scores)")
    return notes


def measure(cfg: TrainConfig, devices: Sequence[Any] | None = None) -> int:
    """Per-device bytes XLA's compiled train step needs (argument + output - aliased + temp), compiled from
    abstract shapes on these devices (nothing is allocated)."""
    cfg = planning_config(cfg)
    setup = build(cfg, list(devices) if devices is not None else None)
    shape = (cfg.grad_accum, cfg.batch_size, cfg.data.seq_len + 1)
    batch = jax.ShapeDtypeStruct(
        shape, jnp.int32, sharding=sharding.batch_sharding(setup.mesh, micro_batches=True)
    )
    with sharding.set_mesh(setup.mesh):
        compiled = make_train_step(setup).lower(setup.abstract_state, batch, cfg.steps).compile()
    m = compiled.memory_analysis()
    m = m[0] if isinstance(m, list | tuple) else m
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    )
