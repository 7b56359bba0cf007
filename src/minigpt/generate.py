"""Sampling text from a trained model: temperature and top-k, with an explicit PRNG key per call.

The whole decode loop is one compiled `lax.fori_loop` over a fixed-size token buffer, so there is one
compilation per (batch, buffer) shape and no Python work per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.config import ConfigError


def sample_logits(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """Greedy when temperature == 0; else sample from softmax(logits / temperature) over the top k (0: all)."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "n_prompt", "n_new", "temperature", "top_k", "eot_id")
)
def _decode(graphdef, params, buf_BT, key, *, n_prompt, n_new, temperature, top_k, eot_id):
    model = nnx.merge(graphdef, params)
    B = buf_BT.shape[0]

    def body(i, carry):
        buf, done, key = carry
        pos = n_prompt + i
        key, sub = jax.random.split(key)
        logits_BTV = model(buf)
        tok = sample_logits(logits_BTV[:, pos - 1], sub, temperature, top_k)
        tok = jnp.where(done, eot_id, tok)
        buf = buf.at[:, pos].set(tok)
        return buf, done | (tok == eot_id), key

    buf, _, _ = jax.lax.fori_loop(0, n_new, body, (buf_BT, jnp.zeros((B,), bool), key))
    return buf


def generate_ids(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: list[int],
    *,
    eot_id: int,
    max_new_tokens: int,
    max_seq_len: int,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    num_samples: int = 1,
) -> list[list[int]]:
    """New token ids per sample, cut at end-of-text or after max_new_tokens (within the context)."""
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0, got {top_k}")
    if len(prompt_ids) >= max_seq_len:
        raise ConfigError(
            f"prompt is {len(prompt_ids)} tokens; the model's context is {max_seq_len}: shorten it"
        )
    n_prompt = len(prompt_ids)
    n_new = min(max_new_tokens, max_seq_len - n_prompt)
    buf = jnp.zeros((num_samples, max_seq_len), jnp.int32).at[:, :n_prompt].set(jnp.asarray(prompt_ids))
    out = _decode(
        graphdef,
        params,
        buf,
        key,
        n_prompt=n_prompt,
        n_new=n_new,
        temperature=float(temperature),
        top_k=int(top_k),
        eot_id=eot_id,
    )
    samples = []
    for row in jax.device_get(out):
        new = [int(t) for t in row[n_prompt : n_prompt + n_new]]
        samples.append(new[: new.index(eot_id)] if eot_id in new else new)
    return samples


def generate(graphdef: nnx.GraphDef, params: nnx.State, tokenizer, prompt: str, **kwargs) -> list[str]:
    """Continue `prompt` (an empty prompt starts a new document); keyword arguments as in `generate_ids`."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    samples = generate_ids(graphdef, params, ids, eot_id=tokenizer.eot_id, **kwargs)
    return [prompt + tokenizer.decode(new) for new in samples]
