"""Decoding over a pool of cache rows: the rows a call names get what `GPT.decode` gives them in a cache of
their own, the other rows are untouched, a padding row (an index past the pool) writes nothing, and attending
over a window of the slots that holds every position gives the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.nn.kv_pool import pooled_decode
from minigpt.nn.model import GPT


@pytest.mark.parametrize(
    "options",
    [{}, {"scan_layers": True, "value_residual": True, "value_embeddings": 1, "n_kv_heads": 2}],
    ids=["unrolled", "scanned-value-residual-embeddings-gqa"],
)
def test_named_rows_decode_as_in_a_cache_of_their_own(options: dict) -> None:
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      norm="rmsnorm", position="rope", **options)  # fmt: skip
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    # Compiled, as the engine runs them (op by op they would each compile on their own).
    decode = jax.jit(lambda p, *a, **k: nnx.merge(graphdef, p).decode(*a, **k))
    pooled = jax.jit(lambda p, *a: pooled_decode(nnx.merge(graphdef, p), *a))
    model = nnx.merge(graphdef, params)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    alone, own = decode(params, tokens, positions, model.init_cache(2), out_index_B=jnp.array([5, 3]))
    pool = jax.tree.map(lambda c: c + 1.0, model.init_cache(4))  # rows hold something: it must stay
    rows = jnp.array([3, 1, 4])  # the third names no row: padding
    padded_tokens, padded_positions = (
        jnp.concatenate([tokens, tokens[:1]]),
        jnp.concatenate([positions] * 2)[:3],
    )
    logits, pool_after = pooled_decode(
        model, padded_tokens, padded_positions, pool, rows, jnp.array([5, 3, 0])
    )
    assert np.abs(np.asarray(logits[:2] - alone)).max() < 1e-5
    for (before, after), mine in zip(zip(pool, pool_after, strict=True), own, strict=True):
        np.testing.assert_array_equal(after[:, [0, 2]], before[:, [0, 2]])  # untouched rows
        np.testing.assert_allclose(after[:, [3, 1], :, :6], mine[:, :, :, :6], atol=1e-6)
        np.testing.assert_array_equal(after[:, [3, 1], :, 6:], before[:, [3, 1], :, 6:])
    # One more token for row 3 only, at position 6: what the cache of its own gives next.
    nxt = jnp.array([[7]])
    step, _ = decode(params, nxt, jnp.array([[6]]), jax.tree.map(lambda c: c[:, :1], own))
    after, _ = pooled(params, nxt, jnp.array([[6]]), pool_after, jnp.array([3]), None)
    assert np.abs(np.asarray(after - step)).max() < 1e-5
    # Attending over the first 8 slots only (every position is below 8) changes nothing.
    windowed = jax.jit(lambda p, *a: pooled_decode(nnx.merge(graphdef, p), *a, window=8))
    narrow, _ = windowed(params, nxt, jnp.array([[6]]), pool_after, jnp.array([3]), None)
    assert np.abs(np.asarray(narrow - step)).max() < 1e-5
    # The pool's first rows (None, a decode step's form, read as a slice) decode as those rows named.
    first = (jnp.array([[7], [9]]), jnp.array([[6], [4]]), pool_after)
    by_slice, pool_slice = windowed(params, *first, None, None)
    by_name, pool_name = windowed(params, *first, jnp.array([0, 1]), None)
    assert np.abs(np.asarray(by_slice - by_name)).max() < 1e-6
    for a, b in zip(pool_slice, pool_name, strict=True):
        np.testing.assert_array_equal(a, b)
