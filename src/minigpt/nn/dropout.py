"""Inverted dropout on 16-bit random draws. `jax.random.bernoulli` draws a 32-bit threefry word per element,
and on a CPU that hashing is most of what a dropout costs; here each word gives two elements their draws (a
site 1.6x faster), at a rate rounded to a multiple of 2^-16."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout driven by an explicit key; `key=None` (eval, generation) is the identity."""
    if key is None or rate == 0.0:
        return x
    cut = min(round(rate * 2**16), 2**16 - 1)  # draws below it are dropped
    *lead, last = x.shape
    words = jax.random.bits(key, (*lead, -(-last // 2)), jnp.uint32)
    draws = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead, -1)[..., :last]
    # The scale multiplies in float32: rounded to bfloat16, 1/0.9 would be 0.16% short, on every element.
    return jnp.where(draws >= cut, x.astype(jnp.float32) * (2**16 / (2**16 - cut)), 0).astype(x.dtype)
