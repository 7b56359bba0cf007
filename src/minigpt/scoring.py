"""Scoring text with a trained model: the log-likelihood of a continuation after a context, and the bits per
byte of whole texts, for many variable-length requests at once. Task evaluation (`harness.py`) and
`minigpt eval --text` both read models through this module.

Requests are sorted longest first and cut into batches of a fixed number of rows, each right-padded to a
length bucket (a multiple of 32), so a handful of compiled forward passes serve any number of requests (padding
sits after a row's tokens and causal attention never reads it). A batch is one global array laid out over
the mesh's data axes from the same host rows on every process, so the model may be split any way the mesh
allows. Only the targets' log-probabilities and greedy flags come back to the host, never the logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from minigpt import sharding
from minigpt.metrics import bits_per_byte
from minigpt.trainer import Setup

Pair = tuple[Sequence[int], Sequence[int]]


def _scores(
    graphdef: nnx.GraphDef, params: Any, tokens_BT1: jax.Array, at_BC: jax.Array
) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params).token_scores(tokens_BT1[:, :-1], tokens_BT1[:, 1:], at_BC)


def length_bucket(n: int, max_length: int, step: int = 32) -> int:
    """A batch's padded length for a longest row of n: the next multiple of `step` (at least 16), capped at
    the context. A few compiled shapes, and little padding (84-token requests run as 96, not 128)."""
    return min(max_length, max(16, -(-n // step) * step))


class Scorer:
    """Log-likelihoods of continuations under one model on its mesh, `batch_size` rows per forward pass
    (rounded up to a multiple of the data-parallel size)."""

    def __init__(self, setup: Setup, params: Any, batch_size: int = 32, progress: bool = True) -> None:
        dp = sharding.data_parallel_size(setup.mesh)
        self.params, self.mesh, self.progress = params, setup.mesh, progress
        self.max_length = setup.cfg.model.max_seq_len
        self.batch_size = -(-max(batch_size, 1) // dp) * dp
        bs = sharding.batch_sharding(setup.mesh)
        self._fn = jax.jit(
            functools.partial(_scores, setup.graphdef),
            in_shardings=(setup.state_shardings.params, bs, bs),
            out_shardings=sharding.replicated(setup.mesh),
        )

    def _batch(self, rows: np.ndarray) -> jax.Array:
        """The same host rows on every process -> one global array laid out like a training batch."""
        return jax.make_array_from_callback(rows.shape, sharding.batch_sharding(self.mesh), lambda i: rows[i])

    def _batches(
        self, rows: list[list[int]], conts: list[int]
    ) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
        """(row indices, log-probabilities (B, C), greedy flags (B, C)) per batch, longest rows first: row b's
        continuation is its first conts[b] entries. Only the continuations' positions reach the output layer
        (a task's context is most of each row)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        starts = range(0, len(order), self.batch_size)
        for start in tqdm(starts, desc="scoring", unit="batch", disable=not self.progress or len(starts) < 2):
            idx = order[start : start + self.batch_size]
            T = length_bucket(len(rows[idx[0]]) - 1, self.max_length)
            C = length_bucket(max(conts[i] for i in idx), T, step=16)
            tokens = np.zeros((self.batch_size, T + 1), np.int32)
            at = np.zeros((self.batch_size, C), np.int32)
            for r, i in enumerate(idx):
                tokens[r, : len(rows[i])] = rows[i]
                n = len(rows[i]) - 1  # scored positions: targets rows[i][1:]
                at[r, : conts[i]] = np.arange(n - conts[i], n)
            logp, greedy = jax.device_get(self._fn(self.params, self._batch(tokens), self._batch(at)))
            yield idx, logp, greedy

    def loglikelihoods(self, pairs: Sequence[Pair]) -> list[tuple[float, bool]]:
        """For each (context, continuation) of token ids: the continuation's summed log-probability given the
        context, and whether greedy decoding would have produced it. A pair longer than the model's context
        keeps its last max_length + 1 tokens (the context is cut from the left), as lm-evaluation-harness does.
        """
        rows, conts = [], []
        for ctx, cont in pairs:
            if not ctx or not cont or len(cont) > self.max_length:
                raise ValueError(f"a request needs a context and 1..{self.max_length} continuation tokens")
            rows.append([int(t) for t in (*ctx, *cont)][-(self.max_length + 1) :])
            conts.append(len(cont))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for idx, logp, greedy in self._batches(rows, conts):
            for r, i in enumerate(idx):
                c = conts[i]
                out[i] = (float(logp[r, :c].astype(np.float64).sum()), bool(greedy[r, :c].all()))
        return out


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that predict every token of `tokens` exactly once, each with as much
    preceding text as the context allows: the first window starts from `prefix` (end-of-text), the others
    follow disjointly. lm-evaluation-harness's `get_rolling_token_windows` with context_len=1 followed by
    `make_disjoint_window` (tests check that the two agree)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix], tokens[:first])]
    done = first
    while done < len(tokens):
        end = min(len(tokens), done + max_length)
        windows.append((tokens[end - max_length - 1 : done], tokens[done:end]))
        done = end
    return windows


def rolling_loglikelihoods(scorer: Scorer, texts: Sequence[Sequence[int]], prefix: int) -> list[float]:
    """Each token sequence's total log-probability (nats), scored in `rolling_windows` all batched together."""
    pairs, owner = [], []
    for i, tokens in enumerate(texts):
        for window in rolling_windows(tokens, prefix, scorer.max_length):
            pairs.append(window)
            owner.append(i)
    totals = [0.0] * len(texts)
    for i, (logp, _) in zip(owner, scorer.loglikelihoods(pairs), strict=True):
        totals[i] += logp
    return totals


def text_bits_per_byte(scorer: Scorer, tokenizer: Any, texts: Sequence[str]) -> list[dict[str, float]]:
    """Bits per byte of each text as one document (every token predicted once, from end-of-text on), and
    its tokens and UTF-8 bytes; the same measure as the validation split's, on any text."""
    ids = tokenizer.encode_batch(list(texts))
    logps = rolling_loglikelihoods(scorer, ids, tokenizer.eot_id)
    return [
        {"bpb": bits_per_byte(-lp, len(t.encode())), "nats": -lp, "tokens": len(i), "bytes": len(t.encode())}
        for t, i, lp in zip(texts, ids, logps, strict=True)
    ]


def total_bits_per_byte(rows: Sequence[dict[str, float]]) -> float:
    """Bits per byte over several texts together (bytes-weighted, not a mean of ratios)."""
    nbytes = sum(r["bytes"] for r in rows)
    return bits_per_byte(sum(r["nats"] for r in rows), nbytes) if nbytes else math.nan
