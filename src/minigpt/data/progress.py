"""What preparing data says while it works: every size in one unit (MB, a million bytes) and counted the same
way (a source file by its size on disk), what a build for a run tokenizes, and the tokenizing progress with
its rate and ETA."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

PROGRESS_SECONDS = 15.0
"""How often progress is printed where there is no terminal for a progress bar."""


def megabytes(n_bytes: float) -> str:
    """A size in MB, with three significant digits below 100 MB (6.95 MB, 0.361 MB) and none after the point
    above (606 MB, 1,900 MB)."""
    x = n_bytes / 1e6
    if x >= 100:
        return f"{x:,.0f} MB"
    digits = np.format_float_positional(x, precision=3, unique=False, fractional=False, trim="-")
    return f"{digits} MB"


def files_named(files: Sequence[Path], sizes: Sequence[int]) -> str:
    """Source files and their sizes, for a line: "train.txt (6.95 MB)", "a.txt (1.20 MB) and b.txt (3.40
    MB)", "12 files (1,234 MB)"."""
    if len(files) > 2:
        return f"{len(files)} files ({megabytes(sum(sizes))})"
    return " and ".join(f"{Path(f).name} ({megabytes(s)})" for f, s in zip(files, sizes, strict=True))


def say_prefix(goal: int | None, train: str, val: str, whole: bool, paused: dict | None) -> None:
    """What a build for a run tokenizes (`train`, `val`: the files as `files_named` gives them), when it is
    not the whole corpus; `whole`: the goal holds the whole training text (a token is at least a byte)."""
    if goal is None:
        return
    both = f"{train} and, for validation, {val}" if val else train
    if whole:
        print(f"tokenizing {both} for this run")
    elif paused is None:
        print(
            f"tokenizing the first {goal:,} training tokens of {both} for this run (`minigpt prepare` "
            "tokenizes all of it)"
        )
    else:
        print(
            f"extending the token store of {train} from {paused['splits']['train']['tokens']:,} to {goal:,} "
            "training tokens for this run"
        )


class Progress:
    """Bytes tokenized (or, for a build that stops at a goal, training tokens), with the rate and an ETA: a
    tqdm bar on a terminal; elsewhere (a log file, CI), where a bar's carriage returns pile up, a line every
    PROGRESS_SECONDS. `train`: the training split's writer, whose tokens a goal counts."""

    def __init__(self, total: int, done: int, goal: int | None = None, train: Any = None) -> None:
        self.total, self.done, self.first = total, done, done
        self.goal, self.train = goal, train
        self.tokens_first = train.tokens if train is not None else 0
        self.started = self.shown = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            size = "{n:.3g}/{total:.3g} MB [{elapsed}<{remaining}, {rate_fmt}]"
            self.bar = tqdm(
                total=goal or total / 1e6,
                initial=self.tokens_first if goal else done / 1e6,
                desc="tokenize",
                unit="tok" if goal else "MB",
                unit_scale=bool(goal),
                leave=False,
                bar_format=None if goal else "{l_bar}{bar}| " + size,
            )

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(min(self.train.tokens, self.goal) - self.bar.n if self.goal else n / 1e6)
        elif time.monotonic() - self.shown >= PROGRESS_SECONDS:
            self.shown = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        seconds = max(time.monotonic() - self.started, 1e-9)  # since this run began
        rate = (self.done - self.first) / seconds
        if self.goal:
            tokens = self.train.tokens
            token_rate = (tokens - self.tokens_first) / seconds
            eta = tqdm.format_interval((self.goal - tokens) / token_rate) if token_rate > 0 else "?"
            return (
                f"tokenize: {tokens:,} of {self.goal:,} tokens ({min(tokens / self.goal, 1):.0%}) | "
                f"{rate / 1e6:.1f} MB/s | ETA {eta}"
            )
        eta = tqdm.format_interval((self.total - self.done) / rate) if rate > 0 else "?"
        return (
            f"tokenize: {megabytes(self.done)} of {megabytes(self.total)} "
            f"({self.done / max(self.total, 1):.0%}) | {rate / 1e6:.1f} MB/s | ETA {eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
