"""Sampling text from a trained model with a key/value cache: greedy, temperature, top-k and top-p (nucleus).

One compiled function per (batch size, prompt bucket, sampling settings) does the whole job: a prefill of
the prompts into the cache (`GPT.decode`), then a `lax.while_loop` of one-token decode steps that ends when
every row has hit end-of-text or its token budget. There is no Python work per token and no recompilation
per prompt length (prompts are right-padded to a power-of-two bucket) or per `max_new_tokens`. Streaming runs
the same steps as a prefill and chunks of STREAM_CHUNK steps, called from Python, so no compiled program
calls back into Python and JAX's persistent cache keeps them all.

Batches of prompts of different lengths run together: each row keeps its own position, its cache slot for
position p holds the token at p, and attention sees only slots <= the row's position, so a row's result is
the one it would get alone. Randomness is per row and step: sample j of any prompt draws from
`fold_in(fold_in(key, j), step)`, so the same seed gives the same text whatever else is in the batch.

Rules, checked before any compilation (one-line `ConfigError`s):
  - a prompt must be shorter than the context (max_seq_len): longer prompts are refused, not truncated, and
    generation stops when the context is full (no position past the learned position table);
  - an empty prompt starts a new document: it is replaced by the end-of-text token;
  - `SamplingConfig` refuses impossible settings when it is made: temperature >= 0 (0 is greedy),
    top_k >= 0 (0: no limit), 0 < top_p <= 1 (1: no limit), max_new_tokens >= 0, num_samples >= 1.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt.config import ConfigError, SamplingConfig
from minigpt.nn.model import GPT, decoding_params
from minigpt.runtime import interrupts

TokenCallback = Callable[[np.ndarray, np.ndarray], None]
"""Streaming hook: called once per decode step with that step's tokens (B,) and which rows produced a new
token (B,) bool (False once a row has finished; its token is then meaningless)."""

MIN_PROMPT_BUCKET = 16


def sample_logits(
    logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """Next tokens (B,). Greedy when temperature == 0; else sample from softmax(logits / temperature),
    restricted to the top_k most likely tokens (0: all) and then to the smallest set of those whose
    probability reaches top_p (1: all; the most likely token is always kept)."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    V = logits_BV.shape[-1]
    k = top_k if 0 < top_k < V else V
    if k == V and top_p >= 1.0:
        return jax.random.categorical(key, logits_BV, axis=-1)
    vals_BK, idx_BK = jax.lax.top_k(logits_BV, k)  # sorted, most likely first
    if top_p < 1.0:
        probs_BK = jax.nn.softmax(vals_BK, axis=-1)
        mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
        vals_BK = jnp.where(mass_before_BK < top_p, vals_BK, -jnp.inf)
    choice_B = jax.random.categorical(key, vals_BK, axis=-1)
    return jnp.take_along_axis(idx_BK, choice_B[:, None], axis=-1)[:, 0]


def _sample_rows(logits_BV, row_keys, step, temperature, top_k, top_p):
    """Row b samples with fold_in(row_keys[b], step): independent of the other rows in the batch. The tests'
    reference decoder (no cache) samples through this too, so from equal logits both draw the same tokens."""

    def one(logits_V, row_key):
        return sample_logits(logits_V[None], jax.random.fold_in(row_key, step), temperature, top_k, top_p)[0]

    return jax.vmap(one)(logits_BV, row_keys)


STREAM_CHUNK = 8
"""Decode steps per device call when streaming: tokens reach `on_token` this many at a time, and Ctrl-C ends
decoding at the next chunk."""

_SAMPLING = ("temperature", "top_k", "top_p")


def _start(model: GPT, prompt_BP, lengths_B, budget_B):
    """Prefill: the prompts into a fresh cache. Returns the decode carry (step, next logits (B, V), cache,
    new-token counts (B,), done (B,))."""
    B, P = prompt_BP.shape
    positions_BP = jnp.broadcast_to(jnp.arange(P), (B, P))
    logits_B1V, cache = model.decode(prompt_BP, positions_BP, model.init_cache(B), out_index_B=lengths_B - 1)
    return jnp.int32(0), logits_B1V[:, 0], cache, jnp.zeros((B,), jnp.int32), budget_B <= 0


def _decode_steps(
    model: GPT, carry, row_keys_B, lengths_B, budget_B, stop_ids, *, temperature, top_k, top_p, steps
):
    """At most `steps` one-token decode steps from `carry`. Returns the new carry, each step's tokens and live
    rows (steps, B) (all False past the steps that ran), how many ran, and whether any row has more to come."""
    S = model.cfg.max_seq_len
    max_budget = jnp.max(budget_B)

    def more(carry):  # every step ends or extends each live row, so max(budget) steps always suffice
        step, _, _, _, done_B = carry
        return jnp.any(~done_B) & (step < max_budget)

    def body(state):
        i, (step, logits_BV, cache, count_B, done_B), tokens_KB, active_KB = state
        tok_B = _sample_rows(logits_BV, row_keys_B, step, temperature, top_k, top_p).astype(jnp.int32)
        active_B = ~done_B & ~jnp.isin(tok_B, stop_ids)
        count_B = count_B + active_B
        done_B = done_B | ~active_B | (count_B >= budget_B)
        # A live row's new token sits at length + count - 1 <= S - 1; finished rows are clamped and ignored.
        pos_B = jnp.clip(lengths_B + count_B - 1, 0, S - 1)
        logits_B1V, cache = model.decode(tok_B[:, None], pos_B[:, None], cache)
        carry = (step + 1, logits_B1V[:, 0], cache, count_B, done_B)
        return i + 1, carry, tokens_KB.at[i].set(tok_B), active_KB.at[i].set(active_B)

    B = budget_B.shape[0]
    init = (jnp.int32(0), carry, jnp.zeros((steps, B), jnp.int32), jnp.zeros((steps, B), jnp.bool_))
    n, carry, tokens_KB, active_KB = jax.lax.while_loop(lambda s: (s[0] < steps) & more(s[1]), body, init)
    return carry, tokens_KB, active_KB, n, more(carry)


def _row_keys(key, sample_idx_B):
    return jax.vmap(jax.random.fold_in, (None, 0))(key, sample_idx_B)


@functools.partial(jax.jit, static_argnames=("graphdef", *_SAMPLING))
def _generate_cached(
    graphdef,
    params,
    prompt_BP,
    lengths_B,
    budget_B,
    key,
    sample_idx_B,
    stop_ids,
    *,
    temperature,
    top_k,
    top_p,
):
    """Without streaming, one program: the prefill and every decode step (no budget exceeds the context).
    Returns each step's tokens and live rows (max_seq_len, B)."""
    model = nnx.merge(graphdef, params)
    carry = _start(model, prompt_BP, lengths_B, budget_B)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, steps=model.cfg.max_seq_len)
    row_keys_B = _row_keys(key, sample_idx_B)
    _, tokens_SB, active_SB, _, _ = _decode_steps(
        model, carry, row_keys_B, lengths_B, budget_B, stop_ids, **sampling
    )
    return tokens_SB, active_SB


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, params, prompt_BP, lengths_B, budget_B, key, sample_idx_B):
    """Streaming's first call: the decode carry after the prompts, and each row's sampling key (B,)."""
    return _start(nnx.merge(graphdef, params), prompt_BP, lengths_B, budget_B), _row_keys(key, sample_idx_B)


# The carry's cache is donated: chunks update it in place rather than holding two copies.
@functools.partial(jax.jit, static_argnames=("graphdef", *_SAMPLING, "steps"), donate_argnames=("carry",))
def _decode_chunk(graphdef, params, carry, row_keys_B, lengths_B, budget_B, stop_ids, **sampling):
    """Streaming's next `steps` decode steps (see `_decode_steps`)."""
    model = nnx.merge(graphdef, params)
    return _decode_steps(model, carry, row_keys_B, lengths_B, budget_B, stop_ids, **sampling)


def _decode(graphdef, params, args: tuple, stop_ids, sampling: dict, on_token: TokenCallback | None):
    """Each decode step's tokens and live rows (steps, B) as numpy. Streaming runs chunks of STREAM_CHUNK
    steps from a loop here, handing each to `on_token`, so no compiled program calls back into Python (JAX's
    persistent cache keeps no program that does) and Ctrl-C ends decoding at the next chunk."""
    if on_token is None:
        return jax.device_get(_generate_cached(graphdef, params, *args, stop_ids, **sampling))
    _, lengths_B, budget_B, _, _ = args
    carry, row_keys_B = _prefill(graphdef, params, *args)
    tokens, actives = [np.zeros((0, len(budget_B)), np.int32)], [np.zeros((0, len(budget_B)), bool)]
    more = True
    while more and not interrupts.requested():
        carry, tokens_KB, active_KB, n, more = _decode_chunk(
            graphdef, params, carry, row_keys_B, lengths_B, budget_B, stop_ids, steps=STREAM_CHUNK, **sampling
        )
        tokens_KB, active_KB, n, more = jax.device_get((tokens_KB, active_KB, n, more))
        for k in range(n):
            on_token(tokens_KB[k], active_KB[k])
        tokens.append(tokens_KB[:n])
        actives.append(active_KB[:n])
    return np.concatenate(tokens), np.concatenate(actives)


def prompt_bucket(n: int, max_seq_len: int) -> int:
    """Prefill length for a longest prompt of n tokens: the next power of two (at least 16), capped at the context."""
    return min(max_seq_len, max(MIN_PROMPT_BUCKET, 1 << max(n - 1, 0).bit_length()))


def _check_prompts(prompts: Sequence[Sequence[int]], eot_id: int, max_seq_len: int) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p] or [eot_id]  # an empty prompt starts a new document
        if len(p) >= max_seq_len:
            which = f"prompt {i + 1}" if len(prompts) > 1 else "prompt"
            raise ConfigError(
                f"{which} is {len(p)} tokens; the model's context is {max_seq_len}: shorten it "
                f"(at most {max_seq_len - 1} tokens, leaving room for one new token)"
            )
        out.append(p)
    return out


def _pad_prompts(rows: list[list[int]], max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts right-padded to their power-of-two bucket (B, P), and their lengths (B,)."""
    P = prompt_bucket(max(len(p) for p in rows), max_seq_len)
    prompt_BP = np.zeros((len(rows), P), np.int32)
    for b, p in enumerate(rows):
        prompt_BP[b, : len(p)] = p
    return prompt_BP, np.array([len(p) for p in rows], np.int32)


def generate_ids_batch(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompts_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    eot_id: int,
    max_seq_len: int,
    key: jax.Array | None = None,
    on_token: TokenCallback | None = None,
    stop_ids: Sequence[int] = (),
) -> list[list[list[int]]]:
    """New token ids for each prompt and each of its samples (`[prompt][sample] -> ids`), all decoded in one
    batch of len(prompts) * num_samples rows (prompt-major). Each sample ends before end-of-text (or another
    of `stop_ids`, a chat model's end-of-turn), after
    max_new_tokens, or when the context (max_seq_len) is full. `key` (default: PRNGKey(sampling.seed)) is for
    callers that derive their own keys. `on_token`, if given, is called from the decode loop with each step's
    tokens (see `TokenCallback`); rows are in the same prompt-major order."""
    num_samples, max_new_tokens = sampling.num_samples, sampling.max_new_tokens
    if not prompts_ids:
        return []
    prompts = _check_prompts(prompts_ids, eot_id, max_seq_len)
    if max_new_tokens == 0:
        return [[[] for _ in range(num_samples)] for _ in prompts]
    rows = [p for p in prompts for _ in range(num_samples)]
    prompt_BP, lengths_B = _pad_prompts(rows, max_seq_len)
    budget_B = np.minimum(max_new_tokens, max_seq_len - lengths_B).astype(np.int32)
    sample_idx_B = np.tile(np.arange(num_samples, dtype=np.int32), len(prompts))
    key = jax.random.PRNGKey(sampling.seed) if key is None else key
    args = (prompt_BP, lengths_B, budget_B, key, sample_idx_B)
    sampling_kw = dict(
        temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p)
    )
    stops = np.array(sorted({eot_id, *stop_ids}), np.int32)
    params = decoding_params(params, nnx.merge(graphdef, params).cfg)  # once, not every step
    tokens_KB, active_KB = _decode(graphdef, params, args, stops, sampling_kw, on_token)
    # A row's live steps come first: once finished it stays finished.
    samples = [[int(t) for t in tokens_KB[active_KB[:, b], b]] for b in range(len(rows))]
    return [samples[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]


def generate_ids(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: Sequence[int],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    eot_id: int,
    max_seq_len: int,
    key: jax.Array | None = None,
    on_token: TokenCallback | None = None,
    stop_ids: Sequence[int] = (),
) -> list[list[int]]:
    """New token ids per sample of one prompt, cut before end-of-text (or another of `stop_ids`), after
    max_new_tokens or at the end of the context. An empty prompt starts a new document (from end-of-text)."""
    return generate_ids_batch(
        graphdef,
        params,
        [prompt_ids],
        sampling,
        eot_id=eot_id,
        max_seq_len=max_seq_len,
        key=key,
        on_token=on_token,
        stop_ids=stop_ids,
    )[0]


def generate_batch(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokenizer,
    prompts: Sequence[str],
    sampling: SamplingConfig = SamplingConfig(),
    **kwargs,
) -> list[list[str]]:
    """Continue each prompt (`[prompt][sample] -> text`, prompt included), after the tokenizer's BOS where it
    has one, to one of its stop tokens; keywords (max_seq_len, key, on_token) as in `generate_ids_batch`."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    ids = [bos + tokenizer.encode(p) for p in prompts]
    samples = generate_ids_batch(
        graphdef, params, ids, sampling, eot_id=tokenizer.eot_id, stop_ids=tokenizer.stop_ids, **kwargs
    )
    return [[p + tokenizer.decode(new) for new in s] for p, s in zip(prompts, samples, strict=True)]


def generate(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokenizer,
    prompt: str,
    sampling: SamplingConfig = SamplingConfig(),
    **kwargs,
) -> list[str]:
    """Continue `prompt` (an empty prompt starts a new document); keywords as in `generate_ids_batch`."""
    return generate_batch(graphdef, params, tokenizer, [prompt], sampling, **kwargs)[0]


class TextStreamer:
    """An `on_token` callback that prints row 0 (the prompt, then each new token as it is decoded) to a text
    stream, holding back an incomplete UTF-8 character; `finish(final_text)` prints whatever is left and a
    newline, so the stream ends up holding exactly `final_text`."""

    def __init__(self, tokenizer, prompt: str, file: TextIO | None = None) -> None:
        self.tokenizer, self.prompt, self.file = tokenizer, prompt, file
        self.ids: list[int] = []
        self.shown: str | None = None  # printed so far; None until the first token (after compilation)

    def _write(self, text: str) -> None:
        out = self.file if self.file is not None else sys.stdout
        out.write(text)
        out.flush()

    def __call__(self, tokens_B: np.ndarray, active_B: np.ndarray) -> None:
        if self.shown is None:
            self._write(self.prompt)
            self.shown = self.prompt
        if not active_B[0]:
            return
        self.ids.append(int(tokens_B[0]))
        text = self.prompt + self.tokenizer.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self._write(text[len(self.shown) :])
            self.shown = text

    def finish(self, final_text: str) -> None:
        shown = self.shown or ""
        self._write((final_text[len(shown) :] if final_text.startswith(shown) else "") + "\n")
