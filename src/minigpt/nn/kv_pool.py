"""Decoding over a pool of key/value-cache rows shared by many sequences: a server's cache, where the rows a
call decodes are named (`rows_B`) rather than being the whole cache.

The pool ((L, P, K, S, H) keys and values, as `GPT.init_cache(P)` makes them) is threaded through the layers
as part of their carry and updated in place: each layer scatters its new keys and values into the named rows
and gathers those rows back for attention. Nothing copies the pool, so a step costs the rows it decodes
whatever the pool's size (`GPT.decode` takes the cache whole, and slicing a pool for it would copy the pool
every step). A row index past the pool (P) is padding: it reads some row and writes nothing. A call over the
pool's first B rows (`rows_B` None) reads them as a slice rather than a gather: a decode step's attention
reads the cache at memory speed (a gather of (B, K, S, H) rows per layer took a third of the step on a CPU).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.nn.attention import cached_attention
from minigpt.nn.model import GPT, Attention, Block, KVCache, Values
from minigpt.parallel.sharding import activation_sharding_constraint


def _attend(
    attn: Attention, x_BTD, positions_BT, pool: KVCache, layer, rows_B, v1: Values, ve_BTKH, window: int
) -> tuple[jax.Array, tuple[KVCache, Values]]:
    B, T, _ = x_BTD.shape
    q_BTNH, k_BTKH, v_BTKH = attn._qkv(x_BTD, positions_BT)
    v_BTKH, v1 = attn._values(v_BTKH, v1, ve_BTKH)
    k_LPKSH, v_LPKSH = pool
    rows_B1 = (jnp.arange(B) if rows_B is None else rows_B)[:, None]
    k_LPKSH = k_LPKSH.at[layer, rows_B1, :, positions_BT].set(k_BTKH.astype(k_LPKSH.dtype), mode="drop")
    v_LPKSH = v_LPKSH.at[layer, rows_B1, :, positions_BT].set(v_BTKH.astype(v_LPKSH.dtype), mode="drop")
    if rows_B is None:
        k_BKSH = jax.lax.dynamic_index_in_dim(k_LPKSH, layer, 0, keepdims=False)[:B, :, :window]
        v_BKSH = jax.lax.dynamic_index_in_dim(v_LPKSH, layer, 0, keepdims=False)[:B, :, :window]
    else:
        k_BKSH = k_LPKSH.at[layer, rows_B, :, :window].get(mode="clip")
        v_BKSH = v_LPKSH.at[layer, rows_B, :, :window].get(mode="clip")
    y_BTNH = cached_attention(q_BTNH, k_BKSH, v_BKSH, positions_BT)
    return attn.o(y_BTNH.reshape(B, T, -1)), ((k_LPKSH, v_LPKSH), v1)


def _layer(block: Block, carry: tuple, positions_BT, rows_B, layer, ve_BTKH, window: int) -> tuple:
    x_BTD, v1, pool = carry
    attend = lambda h: _attend(block.attn, h, positions_BT, pool, layer, rows_B, v1, ve_BTKH, window)
    x_BTD, (pool, v1) = block._apply(x_BTD, attend, None)
    return x_BTD, v1, pool


def pooled_decode(
    model: GPT,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    pool: KVCache,
    rows_B: jax.Array | None,
    out_index_B: jax.Array | None = None,
    window: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """`GPT.decode` for the pool's rows `rows_B` (B,), or its first B rows (None): token t of row b at
    `positions_BT[b, t]`, attending to that row's slots up to its position. Attention reads only the first
    `window` slots of each row (every position must be below it; default: all), so a step reads the cache the
    rows have filled, not all of it. Returns the logits (B, T or 1, padded vocab) and the pool."""
    cfg = model.cfg
    window = window or cfg.max_seq_len
    x_BTD = activation_sharding_constraint(model._embed(tokens_BT, positions_BT))
    carry: Any = (x_BTD, model._values_carry(x_BTD), pool)
    ve_LBTKH = model._value_embeds(tokens_BT)
    if cfg.scan_layers:
        graphdef, stacked = nnx.split(model.blocks)

        def body(carry, inp):
            state, layer, ve_BTKH = inp
            return _layer(
                nnx.merge(graphdef, state), carry, positions_BT, rows_B, layer, ve_BTKH, window
            ), None

        carry, _ = jax.lax.scan(body, carry, (stacked, jnp.arange(cfg.n_layers), ve_LBTKH))
    else:
        for i, block in enumerate(model.blocks):
            ve_BTKH = None if ve_LBTKH is None else ve_LBTKH[i]
            carry = _layer(block, carry, positions_BT, rows_B, i, ve_BTKH, window)
    x_BTD, _, pool = carry
    if out_index_B is not None:
        x_BTD = jnp.take_along_axis(x_BTD, out_index_B[:, None, None], axis=1)
    return model._logits(model._final_norm(x_BTD)), pool
