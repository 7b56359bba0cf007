"""`minigpt bench`: step time, tokens/s, MFU and memory over batch sizes x mesh layouts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated

import tyro

from minigpt.commands.flags import parse_with_train
from minigpt.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    """Time the training step on random tokens for every batch size x mesh layout: compile time, median step
    time, tokens/s, MFU, memory. Writes bench.md/csv/json and tokens_per_s.png, mfu.png into --out.
    --batch-sizes and --layouts say what to run (`minigpt train`'s --batch-size and --mesh sizes do not)."""

    batch_sizes: tuple[int, ...] = (8, 16, 32)
    """Global batch sizes (sequences) to sweep."""
    layouts: Annotated[
        tuple[str, ...],
        tyro.conf.arg(help_behavior_hint="(default: every factorization of the device count)"),
    ] = ()
    """Mesh layouts DATAxFSDPxTENSOR, e.g. 8x1x1 4x1x2."""
    warmup_steps: int = 2
    """Untimed steps after compiling."""
    timed_steps: int = 5
    """Steps timed one by one; the table reports their median."""
    vocab_size: Annotated[
        int | None,
        tyro.conf.arg(
            help_behavior_hint="(default: --model.vocab-size, else 4096 or --data.bpe-vocab-size for bpe "
            "presets, 50257 for gpt2 ones)"
        ),
    ] = None
    """Vocabulary of the random tokens."""
    collectives: bool = True
    """Profile two more steps per point to measure the share of step time spent in collectives."""
    out: str = "runs/bench"
    """Where the table, CSV, JSON and plots go."""


def parse(args: list[str]) -> tuple[BenchArgs, TrainConfig]:
    return parse_with_train(BenchArgs, args, "minigpt bench")


def load() -> Callable[[tuple[BenchArgs, TrainConfig]], None]:
    from minigpt.tools.bench import bench

    def run(parsed: tuple[BenchArgs, TrainConfig]) -> None:
        a, cfg = parsed
        bench(cfg, a.batch_sizes, a.layouts, out_dir=a.out, warmup_steps=a.warmup_steps, timed_steps=a.timed_steps,
              vocab_size=a.vocab_size, peak_tflops=cfg.peak_tflops or None, collectives=a.collectives)  # fmt: skip

    return run
