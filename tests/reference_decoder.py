"""The reference decoder: no cache, one full forward pass over the whole buffer per new token (what the seed
tutorial's generation does). Slow by design; the tests check that the KV-cache generator gives exactly its
tokens."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt.inference.generate import SamplingConfig, _check_prompts, _sample_rows


@functools.partial(
    jax.jit, static_argnames=("graphdef", "n_prompt", "n_new", "temperature", "top_k", "top_p")
)
def _generate_full_recompute(
    graphdef, params, buf_BS, key, eot_id, *, n_prompt, n_new, temperature, top_k, top_p
):
    model = nnx.merge(graphdef, params)
    B = buf_BS.shape[0]
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(B))

    def body(i, carry):
        buf_BS, done_B = carry
        logits_BV = model(buf_BS)[:, n_prompt + i - 1]
        tok_B = _sample_rows(logits_BV, row_keys, i, temperature, top_k, top_p).astype(jnp.int32)
        done_B = done_B | (tok_B == eot_id)
        return buf_BS.at[:, n_prompt + i].set(jnp.where(done_B, eot_id, tok_B)), done_B

    buf_BS, _ = jax.lax.fori_loop(0, n_new, body, (buf_BS, jnp.zeros((B,), bool)))
    return buf_BS


def generate_ids_full_recompute(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    *,
    eot_id: int,
    max_seq_len: int,
) -> list[list[int]]:
    """Reference decoder without a cache (one full forward pass per token); same results as `generate_ids`."""
    max_new_tokens, num_samples = sampling.max_new_tokens, sampling.num_samples
    (prompt,) = _check_prompts([prompt_ids], eot_id, max_seq_len)
    n_prompt = len(prompt)
    n_new = min(max_new_tokens, max_seq_len - n_prompt)
    buf = np.zeros((num_samples, max_seq_len), np.int32)
    buf[:, :n_prompt] = prompt
    out = _generate_full_recompute(
        graphdef,
        params,
        buf,
        jax.random.PRNGKey(sampling.seed),
        np.int32(eot_id),
        n_prompt=n_prompt,
        n_new=n_new,
        temperature=float(sampling.temperature),
        top_k=int(sampling.top_k),
        top_p=float(sampling.top_p),
    )
    samples = []
    for row in jax.device_get(out):
        new = [int(t) for t in row[n_prompt : n_prompt + n_new]]
        samples.append(new[: new.index(eot_id)] if eot_id in new else new)
    return samples
