"""The profiler window and reading its traces: which steps `jax.profiler` records, and how much of their
time went to collectives.

`ProfileWindow` traces steps START:END of any loop (the training run's `--profile-steps`, `minigpt profile`,
the benchmark's collective measurement) into `logdir/plugins/profile/<run>/<host>.xplane.pb`, where
TensorBoard's profile plugin and XProf look. `collective_share` reads such a trace back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")

COLLECTIVE_OP = re.compile(
    r"^(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|collective-broadcast)"
    r"|nccl|AllReduce|AllGather|ReduceScatter",
    re.IGNORECASE,
)
STEP_EVENT = "train"


def trace_files(logdir: str | Path) -> list[Path]:
    """The `.xplane.pb` traces under a log directory, oldest first (TensorBoard's plugins/profile/RUN/ layout)."""
    return sorted(Path(logdir).glob("plugins/profile/*/*.xplane.pb"), key=lambda p: (p.parent.name, p.name))


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def collective_share(profile: Any, n_devices: int) -> float | None:
    """Mean over the `n_devices` devices of the fraction of the profiled steps' wall time (the
    `StepTraceAnnotation("train")` events) spent in collective ops (all-reduce, all-gather, reduce-scatter,
    ... or NCCL kernels). None if the trace has no steps or shows no device execution.

    Accelerators: each `/device:*` plane is a device; its collective events are merged, overlaps counted once.
    CPU: XLA runs the devices' programs on a shared pool of `tf_XLA*` threads of the `/host:CPU` plane (a
    device's op may land on any of them), so the collective time summed over those threads is divided by
    n_devices. On CPU, time in a collective is mostly waiting at the rendezvous for the slowest device: load
    imbalance as much as communication."""
    if n_devices <= 1:
        return 0.0
    step_ns = sum(
        e.duration_ns
        for plane in profile.planes
        if plane.name.startswith("/host")
        for line in plane.lines
        for e in line.events
        if e.name == STEP_EVENT
    )
    if step_ns <= 0:
        return None

    def collective_ns(lines: Iterable[Any]) -> float:
        return sum(
            _union_ns([(e.start_ns, e.end_ns) for e in line.events if COLLECTIVE_OP.search(e.name)])
            for line in lines
        )

    devices = [p for p in profile.planes if p.name.startswith("/device:")]
    if devices:
        spans = [[(e.start_ns, e.end_ns) for line in p.lines for e in line.events if COLLECTIVE_OP.search(e.name)]
                 for p in devices]  # fmt: skip
        return float(np.mean([min(1.0, _union_ns(s) / step_ns) for s in spans]))
    for plane in profile.planes:
        if plane.name == "/host:CPU":
            workers = [line for line in plane.lines if line.name.startswith("tf_XLA")]
            if workers:
                return min(1.0, collective_ns(workers) / (n_devices * step_ns))
    return None


class ProfileWindow:
    """Trace a window of loop steps with `jax.profiler`, each labelled `StepTraceAnnotation("train", step_num=i)`.

    `steps` is (start, end): the steps whose 0-based index i (the number of steps done before it)
    has start <= i < end are traced, into `logdir/plugins/profile/<run>/<host>.xplane.pb`, where
    `tensorboard --logdir LOGDIR` (with tensorboard-plugin-profile) and `xprof --logdir LOGDIR` look. A resumed
    run that starts inside the window traces the rest of it; one past it traces nothing.

        with ProfileWindow((10, 15), run_dir / "tb") as window:
            for step in range(cfg.steps):
                state, metrics = window.run(step, train_step, state, batch)

    `run` waits for the last traced step's outputs before stopping the trace, so its device work is in it.
    `steps=None` makes every call a plain `fn(*args)`."""

    def __init__(self, steps: tuple[int, int] | None, logdir: str | Path) -> None:
        self.window = steps
        self.logdir = Path(logdir)
        self.active = False
        self.done = self.window is None
        self.traced_steps: list[int] = []

    def run(self, step: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, traced and annotated as step `step` if it falls in the window."""
        if self.done:
            return fn(*args)
        start, end = self.window  # type: ignore[misc]
        if not self.active and start <= step < end:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir))
            self.active = True
        if not self.active:
            return fn(*args)
        with jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=step):
            out = fn(*args)
        self.traced_steps.append(step)
        if step >= end - 1:
            jax.block_until_ready(out)
            self.close()
        return out

    def close(self) -> None:
        """Stop the trace if one is running (the loop ended inside the window); later steps are not traced."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
        self.done = True

    def __enter__(self) -> ProfileWindow:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_command(logdir: str | Path) -> str:
    return (
        f"xprof --logdir={logdir} --port=8791   (pip install xprof)\n"
        f"  or: tensorboard --logdir={logdir}   (pip install tensorboard tensorboard-plugin-profile; Profile tab)"
    )
