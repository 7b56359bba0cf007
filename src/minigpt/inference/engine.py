"""Continuous batching: many requests decoded together, joining and leaving the running batch at step
boundaries, for a server.

The key/value cache is a fixed pool of `slots` rows, decoded in place (`nn/kv_pool.py`). A request takes a
free row when it is admitted, reads its prompt into it in chunks (several prompts' chunks in one call), then
decodes one token per step with every other decoding row, and gives the row back the step it ends (its stop
token, its token budget, or `cancel`). The rows in use are kept at the front of the pool (a row that leaves
takes the last one's place; those decoding come before those still reading their prompts), so a step runs
over the first n rows, n the decoding rows rounded up to a power of two: the decode step is compiled once per
such n (and per sampling mode and attention window), never per request, and a lone stream decodes at batch 1.

Between two decode steps the engine runs at most one prefill call, of at most `prefill_chunk` prompt tokens,
so a long prompt costs the running streams one chunk's time per step rather than its whole prefill. Sampling
is per row (its own temperature, top-k, top-p and seed), and the same seed gives the same tokens whatever
else is in the batch: row key fold_in(PRNGKey(seed), sample), step i's draw from fold_in(row key, i), as
`generate` keys its rows (without top-k and top-p, it draws what `generate` draws).

Everything that touches JAX runs in the engine's own thread; `submit` and `cancel` may be called from any
thread, and a request's `on_tokens` is called from the engine's thread, outside its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt.config import ConfigError
from minigpt.config.serving import EngineConfig
from minigpt.inference.generate import prompt_bucket
from minigpt.nn.kv_pool import pooled_decode
from minigpt.nn.model import decoding_params

TokensCallback = Callable[[list[int], str | None], None]
"""A request's hook: its new tokens (possibly none), and its finish reason once it ends ("stop": a stop
token, not included; "length": its token budget or the context; "cancelled"; "shutdown"), else None."""


class QueueFull(Exception):
    """The engine's queue is at its limit: the caller should try again later."""


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to continue. `max_new_tokens` is capped at what the context leaves."""

    prompt: Sequence[int]
    max_new_tokens: int
    on_tokens: TokensCallback
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    sample: int = 0
    """Which sample of the seed this is: the n choices of one API call differ by it."""
    # The engine's bookkeeping.
    slot: int = -1
    filled: int = 0
    generated: int = 0
    budget: int = 0
    cancelled: bool = False
    done: bool = False
    admitted: int = 0  # the order prompts are read in: first come, first read, wherever their rows moved


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _row_key(seed: int, sample: int) -> np.ndarray:
    return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), sample), np.uint32)


def _filters(r: Request, vocab: int) -> bool:
    return r.temperature > 0 and (0 < r.top_k < vocab or r.top_p < 1.0)


def sample_rows(logits_BV, keys_B2, steps_B, temp_B, top_k_B, top_p_B, *, mode: str):
    """Next token per row (B,), each row with its own settings. "greedy": every row has temperature 0.
    Otherwise a row draws argmax(logits / T + Gumbel noise of fold_in(key, step)) over the tokens its top-k
    and top-p keep ("filtered" works those out; "sample": no row restricts them), as
    `jax.random.categorical` draws; rows with temperature 0 take the argmax."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy_B
    V = logits_BV.shape[-1]
    scaled_BV = logits_BV.astype(jnp.float32) / jnp.where(temp_B > 0, temp_B, 1.0)[:, None]
    if mode == "filtered":
        sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
        k_B = jnp.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
        kept_BV = jnp.arange(V)[None] < k_B[:, None]
        probs_BV = jax.nn.softmax(jnp.where(kept_BV, sorted_BV, -jnp.inf), axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        kept_BV &= before_BV < top_p_B[:, None]
        last_B = jnp.sum(kept_BV, axis=-1) - 1  # the most likely token is always kept
        floor_B = jnp.take_along_axis(sorted_BV, last_B[:, None], axis=-1)
        scaled_BV = jnp.where(scaled_BV >= floor_B, scaled_BV, -jnp.inf)
    keys_B = jax.vmap(jax.random.fold_in)(keys_B2, steps_B)
    drawn_B = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys_B, scaled_BV).astype(jnp.int32)
    return jnp.where(temp_B > 0, drawn_B, greedy_B)


def _unpack(ints_6B, floats_2B):
    """(tokens, positions, steps, top_k, keys (B, 2) uint32) and (temperature, top_p) of the packed rows."""
    keys_B2 = jax.lax.bitcast_convert_type(ints_6B[4:6].T, jnp.uint32)
    return ints_6B[0], ints_6B[1], ints_6B[2], ints_6B[3], keys_B2, floats_2B[0], floats_2B[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "window"), donate_argnames=("cache",))
def _decode_rows(graphdef, params, cache, ints_6B, floats_2B, *, mode, window):
    """One decode step over the pool's first B rows: feed each row's last token at its position (all below
    `window`), sample the next. Returns the tokens (B,) and the cache."""
    tok_B, pos_B, steps_B, top_k_B, keys_B2, temp_B, top_p_B = _unpack(ints_6B, floats_2B)
    model = nnx.merge(graphdef, params)
    logits_B1V, cache = pooled_decode(model, tok_B[:, None], pos_B[:, None], cache, None, window=window)
    return sample_rows(logits_B1V[:, 0], keys_B2, steps_B, temp_B, top_k_B, top_p_B, mode=mode), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames=("cache",))
def _prefill_rows(graphdef, params, cache, slots_R, ids_RC, n_R, ints_6R, floats_2R, *, mode):
    """Read a chunk of each row's prompt (ids_RC[r, :n_R[r]] from the position in ints_6R) into its pool
    row; sample the token after each chunk (used where the chunk ends the prompt)."""
    _, start_R, steps_R, top_k_R, keys_R2, temp_R, top_p_R = _unpack(ints_6R, floats_2R)
    model = nnx.merge(graphdef, params)
    positions_RC = start_R[:, None] + jnp.arange(ids_RC.shape[1])[None]
    logits_R1V, cache = pooled_decode(model, ids_RC, positions_RC, cache, slots_R, out_index_B=n_R - 1)
    return sample_rows(logits_R1V[:, 0], keys_R2, steps_R, temp_R, top_k_R, top_p_R, mode=mode), cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def _move_row(cache, src, dst):
    return jax.tree.map(lambda c: c.at[:, dst].set(c[:, src]), cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _swap_rows(cache, a, b):
    both = jnp.stack([a, b])
    return jax.tree.map(lambda c: c.at[:, both].set(c[:, both[::-1]]), cache)


class Engine:
    """The pool of cache rows and the thread that decodes every admitted request, one step at a time."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        *,
        max_seq_len: int,
        stop_ids: Sequence[int],
        config: EngineConfig | None = None,
    ) -> None:
        config = config or EngineConfig()
        model = nnx.merge(graphdef, params)
        self.graphdef, self.params, self.config = graphdef, decoding_params(params, model.cfg), config
        self.max_seq_len, self.stop_ids = max_seq_len, frozenset(int(i) for i in stop_ids)
        self.vocab = model.cfg.vocab_size
        self.cache = model.init_cache(config.slots)
        self.padding = config.slots  # a row index past the pool: padding rows of a call write nothing
        self.rows: list[
            Request
        ] = []  # row i of the pool holds rows[i]: first those decoding, then those reading
        self.decoding = 0  # rows[:decoding] decode; the rest read their prompts
        self.admissions = 0
        self.ints = np.zeros((6, config.slots), np.int32)  # token, position, step, top_k, key (2)
        self.floats = np.ones((2, config.slots), np.float32)  # temperature, top_p
        self.waiting: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.steps = 0
        """Decode steps run so far (a row leaves within one step of being cancelled: the tests count)."""
        self.outbox: list[tuple[TokensCallback, list[int], str | None]] = []  # hooks to call, in order
        self.closing, self.thread = False, None
        self.error: BaseException | None = None

    # ---------------------------------------------------------------------------------- any thread

    def start(self, warmup: bool = False) -> Engine:
        """Start the engine's thread; with `warmup`, it first compiles (by running them on free rows) the
        decode step of every batch bucket and attention window, greedy and sampling, and the prefill of every
        chunk shape, so that no request waits for a compilation (top-k and top-p compile on first use)."""
        self.thread = threading.Thread(target=self._loop, args=(warmup,), name="minigpt-engine", daemon=True)
        self.thread.start()
        return self

    def _warmup(self) -> None:
        slots, chunk, graph = self.config.slots, self.config.prefill_chunk, (self.graphdef, self.params)
        powers = lambda top: [1 << i for i in range(top.bit_length()) if 1 << i <= top]
        for b, window, mode in itertools.product(
            powers(_bucket(slots)), self._windows(), ("greedy", "sample")
        ):
            n = min(b, slots)
            tokens, self.cache = _decode_rows(
                *graph, self.cache, self.ints[:, :n] * 0, self.floats[:, :n], mode=mode, window=window
            )
        widest = min(chunk, prompt_bucket(self.max_seq_len - 1, self.max_seq_len))
        for c in [c for c in powers(widest) if c >= 16]:
            for r in powers(min(chunk // c, _bucket(slots))):
                ints, floats = np.zeros((6, r), np.int32), np.zeros((2, r), np.float32)
                rows = (np.full(r, self.padding, np.int32), np.zeros((r, c), np.int32), np.ones(r, np.int32))
                tokens, self.cache = _prefill_rows(*graph, self.cache, *rows, ints, floats, mode="sample")
        jax.block_until_ready(tokens)

    def submit(self, request: Request) -> None:
        """Queue `request`; ConfigError if its prompt leaves no room in the context, QueueFull if the queue
        is at its limit, RuntimeError once the engine is closing."""
        n = len(request.prompt)
        if not 0 < n < self.max_seq_len:
            raise ConfigError(
                f"the prompt is {n} tokens; the model's context is {self.max_seq_len}: it must be "
                f"1 to {self.max_seq_len - 1} tokens, leaving room for one new token"
            )
        request.budget = min(request.max_new_tokens, self.max_seq_len - n)
        if request.budget < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        with self.lock:
            if self.error is not None:
                raise RuntimeError(
                    f"the engine stopped after an error ({type(self.error).__name__}); restart it"
                )
            if self.closing:
                raise RuntimeError("the server is shutting down")
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already")
            self.waiting.append(request)
            self.lock.notify()

    def cancel(self, request: Request) -> None:
        """End `request` at the next step boundary: its row is free before the next decode step."""
        with self.lock:
            request.cancelled = True
            self.lock.notify()

    def load(self) -> dict[str, int]:
        """Rows in use and free, requests waiting, decode steps so far."""
        with self.lock:
            busy = len(self.rows)
            return {"busy": busy, "free": self.config.slots - busy, "waiting": len(self.waiting),
                    "steps": self.steps}  # fmt: skip

    def close(self, grace: float = 0.0) -> None:
        """Refuse new requests, let those admitted or waiting run for up to `grace` seconds, end the rest
        ("shutdown"), and stop the thread."""
        deadline = time.monotonic() + grace
        with self.lock:
            self.closing = True
            self.lock.notify()
            while (self.rows or self.waiting) and self.thread is not None and self.thread.is_alive():
                if not self.lock.wait(timeout=max(deadline - time.monotonic(), 0)) and (
                    time.monotonic() >= deadline
                ):
                    break
            for r in [*self.rows, *self.waiting]:
                r.cancelled = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout=60)

    # ---------------------------------------------------------------------------------- engine thread

    def _loop(self, warmup: bool = False) -> None:
        try:
            if warmup:
                self._warmup()
            while self._admit():
                self._prefill()
                self._decode()
        except BaseException as e:  # a failed step fails every request rather than hanging them
            self.error = e
            with self.lock:
                for r in [*self.rows, *self.waiting]:
                    self._finish(r, "error")
                self.rows.clear()
                self.waiting.clear()
                self.decoding = 0
                self.lock.notify_all()
            self._flush()

    def _admit(self) -> bool:
        """Drop cancelled requests, give free rows to waiting ones; wait while there is nothing to do. False
        when the engine is closed and idle."""
        while True:
            with self.lock:
                for r in [r for r in self.rows if r.cancelled]:
                    self._release(r, "shutdown" if self.closing else "cancelled")
                while self.waiting and self.waiting[0].cancelled:
                    self._finish(self.waiting.popleft(), "shutdown" if self.closing else "cancelled")
                while self.waiting and len(self.rows) < self.config.slots:
                    self._place(self.waiting.popleft())
                busy, idle = bool(self.rows), not self.rows and not self.outbox
                if idle:
                    self.lock.notify_all()  # `close` waits for an empty pool
                    if not self.closing:
                        self.lock.wait()
            self._flush()
            if busy or (idle and self.closing):
                return busy

    def _flush(self) -> None:
        """Call the requests' hooks, outside the lock: a slow one holds up the engine, never a caller."""
        with self.lock:
            calls, self.outbox = self.outbox, []
        for on_tokens, tokens, reason in calls:
            on_tokens(tokens, reason)

    def _place(self, r: Request) -> None:
        self.admissions += 1
        r.slot, r.admitted = len(self.rows), self.admissions
        self.rows.append(r)
        key = _row_key(r.seed, r.sample).view(np.int32)
        self.ints[:, r.slot] = (0, 0, 0, r.top_k, key[0], key[1])
        self.floats[:, r.slot] = (r.temperature, r.top_p)

    def _release(self, r: Request, reason: str) -> None:
        """Free r's row, keeping the rows in use together: the last decoding row moves into a decoding hole,
        and the last row in use into what is left."""
        hole, last = r.slot, len(self.rows) - 1
        if hole < self.decoding:
            self.decoding -= 1
            if hole != self.decoding:
                self._move(self.decoding, hole)
            hole = self.decoding
        if hole != last:
            self._move(last, hole)
        self.rows.pop()
        self.ints[1, last] = 0  # a free row's position must not widen the steps' attention window
        self._finish(r, reason)

    def _move(self, src: int, dst: int) -> None:
        self.cache = _move_row(self.cache, np.int32(src), np.int32(dst))
        self.ints[:, dst], self.floats[:, dst] = self.ints[:, src], self.floats[:, src]
        self.rows[dst] = self.rows[src]
        self.rows[dst].slot = dst

    def _to_decoding(self, r: Request) -> None:
        """r has read its prompt: it joins the decoding rows (swapping places with the first reading one)."""
        a, b = r.slot, self.decoding
        if a != b:
            self.cache = _swap_rows(self.cache, np.int32(a), np.int32(b))
            self.ints[:, [a, b]], self.floats[:, [a, b]] = self.ints[:, [b, a]], self.floats[:, [b, a]]
            self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            self.rows[a].slot, self.rows[b].slot = a, b
        self.decoding += 1

    def _finish(self, r: Request, reason: str) -> None:
        if not r.done:
            r.done = True
            self.outbox.append((r.on_tokens, [], reason))

    def _windows(self) -> list[int]:
        """The cache prefixes a decode step may attend over: powers of two from 64, and the whole context."""
        S = self.max_seq_len
        return sorted({*(w for w in (64 << i for i in range(S.bit_length())) if w < S), S})

    def _mode(self, rows: Sequence[Request]) -> str:
        if all(r.temperature == 0 for r in rows):
            return "greedy"
        return "filtered" if any(_filters(r, self.vocab) for r in rows) else "sample"

    def _prefill(self) -> None:
        """One chunk of the prompts being read (as many prompts as fit in `prefill_chunk` tokens)."""
        pending = sorted((r for r in self.rows if r.filled < len(r.prompt)), key=lambda r: r.admitted)
        if not pending:
            return
        longest = max(len(r.prompt) - r.filled for r in pending)
        C = min(prompt_bucket(longest, self.max_seq_len), self.config.prefill_chunk)
        taken = pending[: max(1, self.config.prefill_chunk // C)]
        R = _bucket(len(taken))
        slots, ids, n = np.full(R, self.padding, np.int32), np.zeros((R, C), np.int32), np.ones(R, np.int32)
        ints, floats = np.zeros((6, R), np.int32), np.tile(np.float32([[0.0], [1.0]]), (1, R))
        for i, r in enumerate(taken):
            chunk = list(r.prompt[r.filled : r.filled + C])
            slots[i], n[i], ids[i, : len(chunk)] = r.slot, len(chunk), chunk
            ints[:, i], floats[:, i] = self.ints[:, r.slot], self.floats[:, r.slot]
            ints[1, i] = r.filled
        # One program for greedy and sampled rows alike (a row at temperature 0 takes the argmax): fewer to compile.
        mode = "filtered" if self._mode(taken) == "filtered" else "sample"
        tokens, self.cache = _prefill_rows(
            self.graphdef, self.params, self.cache, slots, ids, n, ints, floats, mode=mode
        )
        tokens = np.asarray(tokens)
        with self.lock:
            ended = []
            for i, r in enumerate(taken):
                r.filled += int(n[i])
                self.ints[1, r.slot] = r.filled  # a decode step before the next chunk writes here, harmlessly
                if r.filled == len(r.prompt) and not r.cancelled:
                    self._to_decoding(r)
                    ended += self._emit(r, int(tokens[i]))
            for r, reason in ended:
                self._release(r, reason)
        self._flush()

    def _decode(self) -> None:
        """One decode step of every row whose prompt is read, over the pool's first rows."""
        live = self.rows[: self.decoding]
        if not live:
            return
        B = min(_bucket(len(live)), self.config.slots)
        ints, floats = self.ints[:, :B], self.floats[:, :B]
        reach = int(ints[1].max()) + 1
        window = next(w for w in self._windows() if w >= reach)
        tokens, self.cache = _decode_rows(
            self.graphdef, self.params, self.cache, ints, floats, mode=self._mode(live), window=window
        )
        tokens = np.asarray(tokens)
        with self.lock:
            self.steps += 1
            ended = []
            for r in live:
                if not r.cancelled:  # a cancelled row leaves at the next boundary, its token unsent
                    ended += self._emit(r, int(tokens[r.slot]))
            for r, reason in ended:
                self._release(r, reason)
        self._flush()

    def _emit(self, r: Request, token: int) -> list[tuple[Request, str]]:
        """Hand r its new token; [(r, reason)] if r ends here."""
        if token in self.stop_ids:
            return [(r, "stop")]
        r.generated += 1
        length = r.generated >= r.budget
        self.outbox.append((r.on_tokens, [token], "length" if length else None))
        r.done = length
        self.ints[0:3, r.slot] = (token, len(r.prompt) + r.generated - 1, r.generated)
        return [(r, "length")] if length else []
