"""`minigpt profile`: a jax.profiler trace of a few training steps on random tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated

import tyro

from minigpt.commands.flags import parse_with_train
from minigpt.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ProfileArgs:
    """Write a jax.profiler trace of --trace-steps training steps (random tokens, after --warmup-steps) of the
    model on its --mesh layout and --batch-size, for TensorBoard's profile plugin or XProf."""

    logdir: str = "runs/profile"
    """Log directory: the trace goes to LOGDIR/plugins/profile/RUN/HOST.xplane.pb."""
    warmup_steps: int = 3
    trace_steps: int = 5
    vocab_size: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: as for bench)")] = None
    """Vocabulary of the random tokens."""


def parse(args: list[str]) -> tuple[ProfileArgs, TrainConfig]:
    return parse_with_train(ProfileArgs, args, "minigpt profile")


def load() -> Callable[[tuple[ProfileArgs, TrainConfig]], None]:
    from minigpt.tools.bench import profile

    def run(parsed: tuple[ProfileArgs, TrainConfig]) -> None:
        a, cfg = parsed
        profile(
            cfg, a.logdir, warmup_steps=a.warmup_steps, trace_steps=a.trace_steps, vocab_size=a.vocab_size
        )

    return run
