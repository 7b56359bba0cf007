"""`minigpt plan`: will it fit? The per-device memory of a training step, beside XLA's figure."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Annotated

import tyro

from minigpt.commands.flags import name_default_subcommands, read_flags, split_preset
from minigpt.config import ConfigError, TrainConfig, get_preset


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    """Will it fit? The per-device memory of one training step of the config `minigpt train` would run with
    the same flags (parameters, optimizer state, gradients, activations, the logits and other working sets),
    planned from shapes alone for --devices devices of a --device kind, against that kind's memory. On this
    process's own devices, also XLA's figure for the compiled step (--measure). Exit status 1 if it does not
    fit, with one line saying what would."""

    train: Annotated[TrainConfig, tyro.conf.arg(name="")]
    device: str | None = None
    """Device kind: cpu, h100, h200, a100-40gb, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e (default: this
    process's)."""
    devices: int | None = None
    """How many devices (default: this process's); the mesh sizes must multiply to it."""
    measure: bool = True
    """Also compile the real train step and report XLA's per-device figure, where the planned devices are
    this process's (same kind, enough of them)."""


def parse(args: list[str]) -> PlanArgs:
    preset, rest = read_flags(lambda: split_preset(args))
    default = PlanArgs(train=get_preset(preset or "cpu"))
    rest = name_default_subcommands(rest, default.train)
    return read_flags(lambda: tyro.cli(PlanArgs, default=default, args=rest, prog="minigpt plan"))


def load() -> Callable[[PlanArgs], None]:
    import jax

    from minigpt.tools.plan import format_plan, measure
    from minigpt.training.devices import device_kind, local_kind
    from minigpt.training.memory import does_not_fit, make_plan
    from minigpt.training.memory import resolve_grad_accum as resolve
    from minigpt.training.trainer import cpu_layout, split_cpu

    def run(a: PlanArgs) -> None:
        if a.devices is None:  # the devices `minigpt train` would split this CPU into, and their layout
            a = dataclasses.replace(a, train=cpu_layout(a.train, split_cpu(a.train, multi_process=False)))
        kind = device_kind(a.device).name if a.device else local_kind()
        n = jax.device_count() if a.devices is None else a.devices
        if n <= 0:
            raise ConfigError(f"--devices must be positive, got {n}")
        try:
            cfg = resolve(a.train, log=print, kind=kind, count=n)
        except ConfigError as e:  # --grad-accum auto: not even one sequence per device fits
            if a.train.grad_accum != "auto" or "does not fit" not in str(e):
                raise
            print(f"minigpt: error: {e}", file=sys.stderr)
            sys.exit(1)
        plan = make_plan(cfg, kind, n)
        here = kind == local_kind() and n <= jax.device_count()
        measured = measure(cfg, jax.devices()[:n]) if a.measure and here else None
        note = (
            ""
            if here or not a.measure
            else f"not this process's devices ({jax.device_count()} x {local_kind()})"
        )
        print(format_plan(plan, measured, note))
        if not plan.fits:
            print(f"minigpt: error: {does_not_fit(plan)}", file=sys.stderr)
            sys.exit(1)

    return run
