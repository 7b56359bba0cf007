"""Startup, from the command to the first step: how long it took and where the time went (the stages
`open_run` and `compile_steps` time), said once the first step has run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator

import jax

from minigpt.app.hooks import Hook, Progress
from minigpt.parallel.distributed import say


def process_age() -> float:
    """Seconds since this process started, the command's start (Linux's /proc; elsewhere since this module
    was imported, which leaves out the interpreter's start and the imports before it)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


@dataclasses.dataclass
class StartupHook(Hook):
    """After the session's first step: how long that step took (`started`: just before it), and how long the
    command took to reach it (tokenizer, data, compiling)."""

    every: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds of startup's stages (`timed`), itemised on the line so a slow start says where it went."""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    done: bool = False

    def due(self, p: Progress) -> bool:
        return not self.done

    def __call__(self, p: Progress) -> None:
        jax.block_until_ready(p.state)
        self.done = True
        step_s, age = time.perf_counter() - self.started, process_age()
        parts = {**self.phases, f"step {p.step}": step_s}
        parts["the rest"] = max(0.0, age - sum(parts.values()))
        itemised = ", ".join(f"{name} {s:.0f} s" for name, s in parts.items() if s >= 0.5)
        say(
            f"took step {p.step} in {step_s:.1f} s; startup took {age:.0f} s (from the command to the first "
            f"step: {itemised})"
        )


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to `phases[name]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
