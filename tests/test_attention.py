"""Causal attention with its own backward pass: the values and gradients of
`jax.nn.dot_product_attention`, in float32 exactly and in bfloat16 to its precision, with grouped key/value
heads and a mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from minigpt.nn.attention import attention

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)

B, T, N, H = 2, 24, 4, 32


def _inputs(kv_heads: int, dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(k[0], (B, T, N, H)).astype(dtype)
    key = jax.random.normal(k[1], (B, T, kv_heads, H)).astype(dtype)
    v = jax.random.normal(k[2], (B, T, kv_heads, H)).astype(dtype)
    dy = jax.random.normal(k[3], (B, T, N, H)).astype(dtype)
    return q, key, v, dy


def _value_and_grads(f, q, k, v, dy, mask):
    y, vjp = jax.vjp(lambda q, k, v: f(q, k, v, mask), q, k, v)
    return (y, *vjp(dy))


def _reference(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, mask=mask)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["multi-head", "grouped", "multi-query"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "causal-and-mask"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_and_its_gradients_are_dot_product_attentions(kv_heads: int, masked: bool, dtype) -> None:
    q, k, v, dy = _inputs(kv_heads, dtype)
    # A row of documents: positions 0-9 and 10-23 do not see each other.
    doc = jnp.arange(T) >= 10
    mask = (doc[:, None] == doc[None, :])[None, None].repeat(B, 0) if masked else None
    got = jax.jit(lambda *a: _value_and_grads(attention, *a, mask))(q, k, v, dy)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dy)]
    want = _value_and_grads(_reference, *f32, mask)
    for name, a, b in zip(("y", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype, name
        error = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert error < (1e-5 if dtype == jnp.float32 else 1e-2), (name, error)
