"""Matrix products on the fast path of mixed precision: bfloat16 operands, float32 accumulation, in the
forward and the backward pass.

CPUs with AMX or AVX-512 BF16 multiply bfloat16 matrices with float32 accumulation several times faster than
float32 ones, and XLA:CPU sends a dot there only when both operands are row-major with the contraction on the
left operand's last axis and on the right operand's first or last (`x @ W` or `g @ W.T` written as one
dot_general). A dot whose operand is a transpose, as every weight gradient autodiff writes (`x.T @ g`) is, has
its operands upcast to float32 before XLA folds the transpose away, and runs at float32 speed. So:

- `dense` is `x @ W` with a custom VJP whose two backward products are written in those forms, the transposed
  activation made a real row-major array first (`transposed`);
- `transposed` permutes axes through a unit axis, which XLA lays out row-major instead of treating the
  transpose as a free change of layout (the view the upcasting decision sees);
- products return float32 (`preferred_element_type`): the caller rounds, so bf16-result dots, which XLA:CPU
  runs as float32 dots plus a rounding pass, never occur.

On GPUs and TPUs the same program is as fast as plain autodiff's: their compilers fold the transposes into the
matmuls. Shapes: M rows (batch x time), K contracted, N out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def transposed(x: jax.Array, perm: tuple[int, ...]) -> jax.Array:
    """`jnp.transpose(x, perm)` as a real row-major array (XLA:CPU otherwise keeps a transpose as a layout
    that its fast matmul path refuses): the permutation goes through a trailing unit axis, which the reshape
    that drops it forces into a copy."""
    return jnp.transpose(x[..., None], (*perm, x.ndim)).reshape([x.shape[p] for p in perm])


def rounded(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """float32 `x` rounded to `dtype` (to nearest even), in integer operations for bfloat16: XLA:CPU's own
    conversion, fused after an exponential, runs 2.5x slower than the exponential alone."""
    if dtype != jnp.bfloat16:
        return x.astype(dtype)
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return jax.lax.bitcast_convert_type(u.astype(jnp.uint16), jnp.bfloat16)


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], batch: int = 0) -> jax.Array:
    """float32 product of `a` and `b` over `contract` = (a's axis, b's axis), with their first `batch` axes
    as batch axes: one dot_general, accumulated in float32."""
    batch_dims = tuple(range(batch))
    dims = (((contract[0],), (contract[1],)), (batch_dims, batch_dims))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dense(x_MK: jax.Array, w_KN: jax.Array, b_N: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """x @ W (+ b) in `dtype` operands with float32 accumulation, the float32 bias added before rounding to
    `dtype`; x may have any number of leading axes. The gradients are float32 products too: x's in x's dtype,
    W's and b's in theirs (float32 masters)."""
    y_MN = dot(x_MK.astype(dtype), w_KN.astype(dtype), (x_MK.ndim - 1, 0))
    return (y_MN if b_N is None else y_MN + b_N.astype(F32)).astype(dtype)


def _dense_fwd(x_MK, w_KN, b_N, dtype):
    return dense(x_MK, w_KN, b_N, dtype), (x_MK, w_KN, b_N)


def _dense_bwd(dtype, res, g_MN):
    x_MK, w_KN, b_N = res
    K, N = w_KN.shape
    x_c, w_c, g_MN = x_MK.astype(dtype), w_KN.astype(dtype), g_MN.astype(dtype)
    dx_MK = dot(g_MN, w_c, (g_MN.ndim - 1, 1))  # g @ W.T: both contracted on their last axis
    # x.T @ g with x.T row-major: (K, M) @ (M, N), the rows of every leading axis flattened into M.
    dw_KN = dot(transposed(x_c.reshape(-1, K), (1, 0)), g_MN.reshape(-1, N), (1, 0))
    # The bias's gradient sums g's rows flattened to (M, N): XLA:CPU reduces a (B, T, N) array over its two
    # leading axes through a reduce-window several times slower.
    db_N = None if b_N is None else jnp.sum(g_MN.reshape(-1, N).astype(F32), 0).astype(b_N.dtype)
    return dx_MK.astype(x_MK.dtype), dw_KN.astype(w_KN.dtype), db_N


dense.defvjp(_dense_fwd, _dense_bwd)
