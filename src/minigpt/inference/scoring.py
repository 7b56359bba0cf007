"""Scoring text with a trained model: the log-likelihood of a continuation after a context, and the bits per
byte of whole texts, for many variable-length requests at once. Task evaluation (`harness.py`) and
`minigpt eval --text` both read models through this module.

Requests that share a context (a multiple-choice question's answers) share a row: the context once, then
each continuation, which attends to the context but not to the other continuations, at the positions it
would have alone (`pack`); the context's work is done once instead of once per answer. Rows are sorted longest
first and cut into batches of a fixed number of rows, each right-padded to a length bucket (a multiple of 32),
so a handful of compiled forward passes serve any number of requests (padding sits after a row's tokens and
causal attention never reads it). A batch is one global array laid out over
the mesh's data axes from the same host rows on every process, so the model may be split any way the mesh
allows. Only the targets' log-probabilities and greedy flags come back to the host, never the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from minigpt.data.tokenizer import document_start
from minigpt.parallel import sharding
from minigpt.runtime.errors import ConfigError
from minigpt.training.metrics import bits_per_byte
from minigpt.training.trainer import Setup

Pair = tuple[Sequence[int], Sequence[int]]


def _scores(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens: jax.Array,
    segments: jax.Array,
    positions: jax.Array,
    at: jax.Array,
    targets: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params).token_scores(tokens, segments, positions, at, targets)


def length_bucket(n: int, max_length: int, step: int = 32) -> int:
    """A batch's padded length for a longest row of n: the next multiple of `step` (at least 16), capped at
    the context. A few compiled shapes, and little padding (84-token requests run as 96, not 128)."""
    return min(max_length, max(16, -(-n // step) * step))


@dataclasses.dataclass
class Row:
    """One row of a batch: a context, then continuations that each see it but not one another (segments 1, 2,
    ...), every continuation at the positions it would have alone. A continuation's last token is only a
    target, so a continuation of n tokens adds n - 1 to the row. `scored` holds (request, at, targets)."""

    tokens: list[int]
    segments: list[int]
    positions: list[int]
    scored: list[tuple[int, list[int], list[int]]]

    @classmethod
    def of(cls, context: list[int]) -> Row:
        return cls(list(context), [0] * len(context), list(range(len(context))), [])

    def room(self, cont: list[int], max_length: int) -> bool:
        fits = len(self.tokens) + len(cont) - 1 <= max_length and self.n_scored + len(cont) <= max_length
        return not self.scored or fits

    def add(self, request: int, context_len: int, cont: list[int]) -> None:
        start = len(self.tokens)
        self.tokens += cont[:-1]
        self.segments += [len(self.scored) + 1] * (len(cont) - 1)
        self.positions += range(context_len, context_len + len(cont) - 1)
        self.scored.append((request, [context_len - 1, *range(start, start + len(cont) - 1)], cont))

    @property
    def n_scored(self) -> int:
        return sum(len(t) for _, _, t in self.scored)


def pack(pairs: Sequence[tuple[list[int], list[int]]], max_length: int) -> list[Row]:
    """Rows for (context, continuation) requests: the requests that share a context (a multiple-choice
    question's answers) share its row, so the context runs once rather than once per answer."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        by_context.setdefault(tuple(ctx), []).append(i)
    rows = []
    for ctx, requests in by_context.items():
        row = Row.of(list(ctx))
        for i in requests:
            if not row.room(pairs[i][1], max_length):
                rows.append(row)
                row = Row.of(list(ctx))
            row.add(i, len(ctx), pairs[i][1])
        rows.append(row)
    return rows


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
            in_shardings=(setup.state_shardings.params, bs, bs, bs, bs, bs),
            out_shardings=sharding.replicated(setup.mesh),
        )

    def _batch(self, rows: np.ndarray) -> jax.Array:
        """The same host rows on every process -> one global array laid out like a training batch."""
        return jax.make_array_from_callback(rows.shape, sharding.batch_sharding(self.mesh), lambda i: rows[i])

    def _arrays(self, rows: list[Row]) -> list[np.ndarray]:
        """A batch's (tokens, segments, positions, at, targets), right-padded to length buckets."""
        T = length_bucket(max(len(r.tokens) for r in rows), self.max_length)
        C = length_bucket(max(r.n_scored for r in rows), self.max_length, step=16)
        out = [np.zeros((self.batch_size, n), np.int32) for n in (T, T, T, C, C)]
        for b, row in enumerate(rows):
            at = [a for _, ats, _ in row.scored for a in ats]
            targets = [t for _, _, ts in row.scored for t in ts]
            for array, values in zip(
                out, (row.tokens, row.segments, row.positions, at, targets), strict=True
            ):
                array[b, : len(values)] = values
        return out

    def _batches(self, rows: list[Row]) -> Iterator[tuple[list[Row], np.ndarray, np.ndarray]]:
        """(rows, log-probabilities (B, C), greedy flags (B, C)) per batch, longest rows first."""
        rows = sorted(rows, key=lambda r: -len(r.tokens))
        starts = range(0, len(rows), self.batch_size)
        for start in tqdm(starts, desc="scoring", unit="batch", disable=not self.progress or len(starts) < 2):
            batch = rows[start : start + self.batch_size]
            arrays = [self._batch(a) for a in self._arrays(batch)]
            logp, greedy = jax.device_get(self._fn(self.params, *arrays))
            yield batch, logp, greedy

    def loglikelihoods(self, pairs: Sequence[Pair]) -> list[tuple[float, bool]]:
        """For each (context, continuation) of token ids: the continuation's summed log-probability given the
        context, and whether greedy decoding would have produced it. A pair longer than the model's context
        keeps its last max_length + 1 tokens (the context is cut from the left), as lm-evaluation-harness does.
        """
        return [(float(logp.sum()), greedy) for logp, greedy in self.token_loglikelihoods(pairs)]

    def token_loglikelihoods(self, pairs: Sequence[Pair]) -> list[tuple[np.ndarray, bool]]:
        """`loglikelihoods`, with each continuation token's log-probability (float64) in place of their sum."""
        cut = []
        for ctx, cont in pairs:
            if not ctx or not cont or len(cont) > self.max_length:
                raise ValueError(f"a request needs a context and 1..{self.max_length} continuation tokens")
            row = [int(t) for t in (*ctx, *cont)][-(self.max_length + 1) :]
            cut.append((row[: -len(cont)], row[-len(cont) :]))
        out: list[tuple[np.ndarray, bool]] = [(np.zeros(0), False)] * len(cut)
        for rows, logp, greedy in self._batches(pack(cut, self.max_length)):
            for b, row in enumerate(rows):
                c = 0
                for i, _, targets in row.scored:
                    n = len(targets)
                    out[i] = (logp[b, c : c + n].astype(np.float64), bool(greedy[b, c : c + n].all()))
                    c += n
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
    """Bits per byte of each text as one document (every token predicted once, from its BOS or end-of-text on), and
    its tokens and UTF-8 bytes; the same measure as the validation split's, on any text."""
    ids = tokenizer.encode_batch(list(texts))
    logps = rolling_loglikelihoods(scorer, ids, document_start(tokenizer))
    return [
        {"bpb": bits_per_byte(-lp, len(t.encode())), "nats": -lp, "tokens": len(i), "bytes": len(t.encode())}
        for t, i, lp in zip(texts, ids, logps, strict=True)
    ]


def total_bits_per_byte(rows: Sequence[dict[str, float]]) -> float:
    """Bits per byte over several texts together (bytes-weighted, not a mean of ratios)."""
    nbytes = sum(r["bytes"] for r in rows)
    return bits_per_byte(sum(r["nats"] for r in rows), nbytes) if nbytes else math.nan


def assistant_loss(scorer: Scorer, tokenizer: Any, examples: Sequence[Any]) -> dict[str, float]:
    """The loss on the assistant's tokens of conversation examples (`chat.Example`), each predicted from
    everything before it, as training on them with assistant-only loss counts it (an example's first token,
    which nothing before it predicts, is no target): mean nats per token, and bits per byte of the
    assistant's text."""
    pairs, texts = [], []  # texts: whether each continuation token stands for text bytes
    for ex in examples:
        ids, marked = list(ex.ids), [False, *ex.assistant[1:]]
        counts = tokenizer.text_bytes(ex.ids, opened=True, examples=True)
        for start, end in _runs(marked):
            for a in range(start, end, scorer.max_length):  # a span longer than the context, in pieces
                pairs.append((ids[:a], ids[a : min(end, a + scorer.max_length)]))
                texts.append(counts[a : min(end, a + scorer.max_length)])
    if not pairs:
        raise ConfigError("no example has an assistant message or completion to score")
    logps = [logp for logp, _ in scorer.token_loglikelihoods(pairs)]
    nats = -sum(float(logp.sum()) for logp in logps)
    # As the validation split counts it: tokens of no text (an end of turn) are out of bits per byte.
    nats_text = -sum(float(logp[c > 0].sum()) for logp, c in zip(logps, texts, strict=True))
    tokens, nbytes = sum(len(cont) for _, cont in pairs), int(sum(c.sum() for c in texts))
    return {"loss": nats / tokens, "bpb": bits_per_byte(nats_text, nbytes), "tokens": tokens, "bytes": nbytes}


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """The (start, end) of each run of True in `flags`."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs
