"""Training examples (conversations, prompt/completion pairs) in a token store, and packed into rows.

An example's tokens are stored with two flag bits above the token id, so a store, a window and a batch stay
one int array however they are cut: START on an example's first token (a new attention segment, positions
from 0, not a target) and MASKED on every token that is no target of the loss (the prompt, the template's
markup, padding). The train and eval steps take the flags apart (`minigpt.training.trainer`).

Rows are packed whole: each row of seq_len + 1 tokens holds whole examples (best-fit decreasing, as TRL's
packing does), the rest padded; an example longer than a row is cut to its first seq_len + 1 tokens.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import numpy as np

START = 1 << 29
"""Flag of an example's first token."""
MASKED = 1 << 30
"""Flag of a token that is not a target."""
ID_MASK = START - 1
"""The token id's bits: vocabularies up to 2**29 tokens."""
PAD = START | MASKED
"""Padding after a row's examples: each pad token its own segment, never a target (token id 0)."""


def flagged(ids: Sequence[int], target: Sequence[bool]) -> np.ndarray:
    """An example's tokens as the store keeps them: its first token START, non-targets MASKED."""
    out = np.asarray(ids, np.int64) | np.where(np.asarray(target, bool), 0, MASKED)
    if len(out):
        out[0] |= START
    return out


def pack(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, ...]:
    """Examples (by index) per row: best-fit decreasing, each example into the fullest row it still fits, so
    few rows are left part empty. `lengths` must be at most `capacity`. Deterministic, and remembered: a run
    packs its training split for the loader and for its epoch length, its validation split at every
    evaluation."""
    return _pack(np.asarray(lengths, np.int64).tobytes(), capacity)


@functools.lru_cache(maxsize=8)
def _pack(lengths_bytes: bytes, capacity: int) -> tuple[np.ndarray, ...]:
    lengths = np.frombuffer(lengths_bytes, np.int64)
    order = np.argsort(-lengths, kind="stable")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            bisect.insort(free, (capacity - n, len(rows) - 1))
            continue
        space, row = free.pop(at)
        rows[row].append(i)
        bisect.insort(free, (space - n, row))
    return tuple(np.asarray(sorted(r), np.int64) for r in rows)
