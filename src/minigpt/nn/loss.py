"""The output layer's loss without its logits: projection, log-softmax and negative log-likelihood computed
over chunks of sequence positions, so the B x T x V float32 logits (and their gradient) never exist at once.

With GPT-2's vocabulary the logits are the largest activation by far (144 x 256 x 50304 float32 is 7.4 GB,
and autodiff keeps a copy for the backward pass), so they cap the batch of every small model. Here a
`lax.scan` over chunks of C positions holds one B x C x V block at a time:

- `token_nll`: per-position NLL (evaluation, bits per byte): one matmul per chunk, nothing kept.
- `token_scores`: per-position log-probability and whether the target is the argmax (task evaluation).
- `nll_sum`: the weighted sum of NLLs as a scalar with a custom VJP that computes the gradients in the forward
  pass, chunk by chunk (softmax - one-hot is the logits' gradient of a cross-entropy): the three matmuls
  of an unchunked output layer (logits, input gradient, weight gradient) and no recomputation. Because the
  loss is a scalar, the backward pass only scales the saved gradients by the incoming cotangent.

Numerics follow the unchunked model: logits in float32 from compute-dtype operands and the float32 bias,
padded vocabulary entries masked to the dtype's minimum (both inside the product, `_folded`), products on
operands in the compute dtype (what autodiff does at a dtype conversion), weight gradients accumulated in
float32. Two differences, in compute dtypes narrower than float32: the products take the exponentials
and the softmax's scale rounded apart (`_chunk_grads`), and each target's entry of the logits' gradient is
corrected to its float32 value, which brings the weights' gradient closer to float32's than autodiff's.
The output layer's weights are (D, V), as an untied head stores them (a tied embedding is transposed once per
step, outside the loop). Shapes: B batch, T time, C chunk positions, D width, V padded vocabulary, n chunks,
E = D plus the folded rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from minigpt.nn.matmul import dot, rounded

AUTO_CHUNK_LOGITS = {"cpu": 2**24, "accelerator": 2**27}
"""A chunk's B x C x V logits with `chunk` -1 (auto): 64 MiB in float32 on a CPU, whose passes over a chunk
run faster out of cache than out of memory; 512 MiB on an accelerator, where each chunk reads and writes the
(D, V) float32 weight gradient it adds to, so a chunk needs thousands of rows for its products to outweigh
that traffic."""


def chunk_positions(chunk: int, B: int, T: int, V: int, platform: str | None = None) -> int:
    """Positions per chunk (at most T): `chunk`, or with -1 the power of two that brings a chunk's B x C x V
    logits nearest `AUTO_CHUNK_LOGITS` on `platform` (default: JAX's backend)."""
    if chunk != -1:
        return min(chunk, T)
    platform = platform or jax.default_backend()
    target = AUTO_CHUNK_LOGITS["cpu" if platform == "cpu" else "accelerator"]
    return min(T, 2 ** max(0, round(math.log2(target / (B * V)))))


def _chunked(x_BT: jax.Array, chunk: int) -> jax.Array:
    """(B, T, ...) -> (n, B, C, ...): n = ceil(T / chunk) chunks of C <= chunk positions, as even as they can
    be (T zero-padded by less than n)."""
    B, T = x_BT.shape[:2]
    n = -(-T // chunk)
    chunk = -(-T // n)
    pad = [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x_BT.ndim - 2)
    x = jnp.pad(x_BT, pad).reshape(B, n, chunk, *x_BT.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unchunked(x_nBC: jax.Array, T: int) -> jax.Array:
    """Inverse of `_chunked`: (n, B, C, ...) -> (B, T, ...)."""
    n, B, C = x_nBC.shape[:3]
    return jnp.moveaxis(x_nBC, 0, 1).reshape(B, n * C, *x_nBC.shape[3:])[:, :T]


def logits(h_BCD: jax.Array, w_DV: jax.Array, b_V: jax.Array | None, vocab_size: int) -> jax.Array:
    """float32 logits (B, C, V) of normalised hidden states; entries past `vocab_size` (padding) are masked."""
    out_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV.astype(h_BCD.dtype), preferred_element_type=jnp.float32)
    if b_V is not None:
        out_BCV = out_BCV + b_V.astype(jnp.float32)
    if w_DV.shape[1] != vocab_size:
        valid = jnp.arange(w_DV.shape[1]) < vocab_size
        out_BCV = jnp.where(valid, out_BCV, jnp.finfo(jnp.float32).min)
    return out_BCV


def nll(logits_BCV: jax.Array, targets_BC: jax.Array) -> jax.Array:
    """Cross-entropy of float32 logits against integer targets, per position."""
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    return lse_BC - jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]


def _folded(w_DV: jax.Array, b_V: jax.Array | None, vocab_size: int, dtype: jnp.dtype) -> jax.Array:
    """The weights in `dtype` as (D + E, V): E rows that, against E ones appended to h (`_ones`), add the bias
    and mask the padded vocabulary inside the logits' product, so that no pass over the B x C x V logits
    does either (on a CPU such a pass costs as much as a product). The mask is the dtype's minimum in the
    first row. In a 16-bit dtype the float32 bias is split over three rows that sum to it exactly."""
    valid_V = jnp.arange(w_DV.shape[1]) < vocab_size
    if b_V is None and vocab_size == w_DV.shape[1]:
        return w_DV.astype(dtype)
    bias_V = jnp.zeros(valid_V.shape, jnp.float32) if b_V is None else b_V.astype(jnp.float32)
    parts = [jnp.where(valid_V, bias_V, jnp.finfo(dtype).min)]
    for _ in range(0 if b_V is None or dtype == jnp.float32 else 2):
        rounded_V = parts[-1].astype(dtype).astype(jnp.float32)
        parts[-1:] = [rounded_V, jnp.where(valid_V, parts[-1] - rounded_V, 0.0)]
    # Zero rows up to a multiple of 16: the CPU's bfloat16 kernels take the contraction in blocks of 16.
    parts += [jnp.zeros_like(bias_V)] * (-(w_DV.shape[0] + len(parts)) % 16)
    return jnp.concatenate([w_DV.astype(dtype), jnp.stack(parts).astype(dtype)])


def _ones(h_BCD: jax.Array, w_EV: jax.Array) -> jax.Array:
    """h with the ones columns that `_folded`'s extra rows multiply."""
    E = w_EV.shape[0] - h_BCD.shape[-1]
    return h_BCD if E == 0 else jnp.concatenate([h_BCD, jnp.ones((*h_BCD.shape[:-1], E), h_BCD.dtype)], -1)


def _chunk_nll(h1_BCE: jax.Array, w_EV: jax.Array, t_BC: jax.Array) -> jax.Array:
    """A chunk's NLL (B, C) from h with its ones columns (`_ones`). The exponentials are computed in their own
    pass (XLA's CPU backend computes an exponential inside a reduction several times slower)."""
    logits_BCV = jnp.einsum("bce,ev->bcv", h1_BCE, w_EV, preferred_element_type=jnp.float32)
    max_BC1 = jnp.max(logits_BCV, axis=-1, keepdims=True)
    sum_BC1 = jnp.sum(jnp.exp(logits_BCV - max_BC1), axis=-1, keepdims=True)
    lse_BC = (max_BC1 + jnp.log(sum_BC1))[..., 0]
    return lse_BC - _targets(h1_BCE, w_EV, t_BC)[1]


def _targets(h1_BCE: jax.Array, w_EV: jax.Array, t_BC: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The targets' columns of the weights (E, B, C) and the targets' logits (B, C), from those columns: B x C
    x E work, not a pass over the B x C x V logits. A gather, which also works with the vocabulary split over
    devices."""
    w_EBC = jnp.take(w_EV, t_BC, axis=1)
    return w_EBC, jnp.einsum("bce,ebc->bc", h1_BCE, w_EBC, preferred_element_type=jnp.float32)


def token_nll(
    h_BTD: jax.Array,
    w_DV: jax.Array,
    b_V: jax.Array | None,
    targets_BT: jax.Array,
    vocab_size: int,
    chunk: int,
) -> jax.Array:
    """Per-position NLL (B, T) in float32, C = `chunk` positions at a time (-1: `chunk_positions`). Not for
    differentiation (autodiff through the scan would keep every chunk's logits): training uses `nll_sum`."""

    w_EV = _folded(w_DV, b_V, vocab_size, h_BTD.dtype)  # once, not per chunk
    chunk = chunk_positions(chunk, *h_BTD.shape[:2], w_DV.shape[1])

    def body(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        h1_BCE, t_BC = xs
        return None, _chunk_nll(h1_BCE, w_EV, t_BC)

    _, nll_nBC = jax.lax.scan(body, None, (_chunked(_ones(h_BTD, w_EV), chunk), _chunked(targets_BT, chunk)))
    return _unchunked(nll_nBC, h_BTD.shape[1])


def token_scores(
    h_BTD: jax.Array,
    w_DV: jax.Array,
    b_V: jax.Array | None,
    targets_BT: jax.Array,
    vocab_size: int,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-position log-probability of the targets (B, T) in float32 and whether each target is its logits'
    argmax (B, T): what a task's log-likelihood and "is greedy" need (lm-evaluation-harness), C = `chunk`
    positions at a time (0: all at once; -1: `chunk_positions`). The argmax is taken over the same logits the
    log-softmax reads, so a target that is the greedy choice is never missed by a rounding difference."""
    T = h_BTD.shape[1]
    w_EV = _folded(w_DV, b_V, vocab_size, h_BTD.dtype)
    chunk = chunk_positions(chunk or T, *h_BTD.shape[:2], w_DV.shape[1])

    def body(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array]]:
        h1_BCE, t_BC = xs
        logits_BCV = jnp.einsum("bce,ev->bcv", h1_BCE, w_EV, preferred_element_type=jnp.float32)
        return None, (-nll(logits_BCV, t_BC), jnp.argmax(logits_BCV, axis=-1) == t_BC)

    xs = (_chunked(_ones(h_BTD, w_EV), chunk), _chunked(targets_BT, chunk))
    _, (logp_nBC, greedy_nBC) = jax.lax.scan(body, None, xs)
    return _unchunked(logp_nBC, T), _unchunked(greedy_nBC, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def nll_sum(
    h_BTD: jax.Array,
    w_DV: jax.Array,
    b_V: jax.Array | None,
    targets_BT: jax.Array,
    weights_BT: jax.Array,
    vocab_size: int,
    chunk: int,
) -> jax.Array:
    """sum(weights x NLL): the training loss (weights 1/tokens give the mean), differentiable in h, w, b and
    the weights, with the output layer's gradients computed chunk by chunk in the forward pass."""
    return jnp.sum(weights_BT * token_nll(h_BTD, w_DV, b_V, targets_BT, vocab_size, chunk))


def _chunk_grads(
    h1_BCE: jax.Array,
    w_EV: jax.Array,
    w1_FV: jax.Array,
    t_BC: jax.Array,
    wt_BC: jax.Array,
    bias: bool,
    by_max: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array]:
    """A chunk's NLL, the gradient of sum(wt x NLL) for the input (B, C, D), partial sums of the weights' (D, V)
    and the bias's (V,), and corrections (B, C, D, and 1 more with a bias) to their targets' columns
    (`_target_grads`), from h with its ones columns, the folded weights (`_folded`) and W with a ones row
    (D + 1, V).
    The logits are shifted by the targets' logits (by their rows' maxima with `by_max`, which costs a pass).
    The products take e, the exponentials of the shifted logits rounded to the compute dtype, not the
    softmax: e @ W.T with W's ones row gives the input's gradient and the softmax's sums in one product, and
    the softmax's scale goes on h for the weights' (so no pass over the logits sums them or scales them).
    Each target's entry of the logits' gradient, rounded with the rest, is then corrected to its exact
    wt x (p - 1) (B x C terms, not a B x C x V pass comparing every entry with its target)."""
    D, dtype, f32 = w1_FV.shape[0] - 1, h1_BCE.dtype, jnp.float32
    logits_BCV = jnp.einsum("bce,ev->bcv", h1_BCE, w_EV, preferred_element_type=f32)
    w_EBC, target_BC = _targets(h1_BCE, w_EV, t_BC)
    shift_BC = jnp.max(logits_BCV, axis=-1) if by_max else target_BC
    e_BCV = rounded(jnp.exp(logits_BCV - shift_BC[..., None]), dtype)
    # Rows flattened to a matrix: XLA:CPU then keeps W's (D, V) layout (for a 3-D e it copies W to (V, D)).
    B, C, V = e_BCV.shape
    out_BCF = dot(e_BCV.reshape(B * C, V), w1_FV, (1, 1)).reshape(B, C, D + 1)
    sum_BC = out_BCF[..., D]
    scale_BC = wt_BC / sum_BC
    et_BC = jnp.exp(target_BC - shift_BC)  # the target's e: 1 when shifted by its logit
    grad_t_BC = scale_BC * et_BC - wt_BC  # the target's exact entry of the logits' gradient
    et_BC1 = et_BC.astype(dtype).astype(f32)[..., None]  # as the products took it
    w_BCD = jnp.moveaxis(w_EBC[:D], 0, -1).astype(f32)
    dh_BCD = scale_BC[..., None] * (out_BCF[..., :D] - et_BC1 * w_BCD) + grad_t_BC[..., None] * w_BCD
    # The bias gradient, the sum of the gradient's B x C rows, as one more row of the weights': h's first
    # ones column. (A column reduction is slow on CPU, and a vector product is not a matrix unit's.)
    hs_BCE = (h1_BCE[..., : D + bias] * scale_BC[..., None]).astype(dtype)
    dw_EV = jnp.einsum("bce,bcv->ev", hs_BCE, e_BCV, preferred_element_type=f32)
    fix_BCE = grad_t_BC[..., None] * h1_BCE[..., : D + bias].astype(f32) - et_BC1 * hs_BCE.astype(f32)
    nll_BC = jnp.log(sum_BC) + shift_BC - target_BC
    return nll_BC, dh_BCD.astype(dtype), dw_EV[:D], dw_EV[D] if bias else None, fix_BCE


def _target_grads(
    dw_DV: jax.Array, db_V: jax.Array | None, targets_BT: jax.Array, fix_BTE: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """The weights' and the bias's gradients with each target's column corrected (`_chunk_grads`): one
    scatter over the batch."""
    t_M, fix_ME = targets_BT.reshape(-1), fix_BTE.reshape(targets_BT.size, -1)
    dw_DV = dw_DV.at[:, t_M].add(fix_ME[:, : dw_DV.shape[0]].T)
    return dw_DV, None if db_V is None else db_V.at[t_M].add(fix_ME[:, -1])


def _scanned_grads(h_BTD, w_DV, b_V, targets_BT, weights_BT, vocab_size, chunk, by_max):
    """Per-position NLL (B, T) and the gradients of sum(weights x NLL) for h, w and b, chunk by chunk."""
    w_EV = _folded(w_DV, b_V, vocab_size, h_BTD.dtype)  # once, not per chunk
    w1_FV = jnp.concatenate([w_EV[: w_DV.shape[0]], jnp.ones_like(w_EV[:1])])
    chunk = chunk_positions(chunk, *h_BTD.shape[:2], w_DV.shape[1])

    def body(carry, xs):
        h1_BCE, t_BC, wt_BC = xs
        *out, dw_DV, db_V, fix_BCE = _chunk_grads(h1_BCE, w_EV, w1_FV, t_BC, wt_BC, b_V is not None, by_max)
        carry = jax.tree.map(jnp.add, carry, (dw_DV, db_V))
        return carry, (*out, fix_BCE)

    zeros = (jnp.zeros(w_DV.shape, jnp.float32), None if b_V is None else jnp.zeros(b_V.shape, jnp.float32))
    xs = (_chunked(_ones(h_BTD, w_EV), chunk), _chunked(targets_BT, chunk), _chunked(weights_BT, chunk))
    (dw_DV, db_V), (nll_nBC, dh_nBCD, fix_nBCE) = jax.lax.scan(body, zeros, xs)
    T = h_BTD.shape[1]
    dw_DV, db_V = _target_grads(dw_DV, db_V, targets_BT, _unchunked(fix_nBCE, T))
    db_V = None if b_V is None else db_V.astype(b_V.dtype)
    return _unchunked(nll_nBC, T), (_unchunked(dh_nBCD, T), dw_DV.astype(w_DV.dtype), db_V)


def _nll_sum_fwd(h_BTD, w_DV, b_V, targets_BT, weights_BT, vocab_size, chunk):
    args = (h_BTD, w_DV, b_V, targets_BT, weights_BT, vocab_size, chunk)
    nll_BT, grads = _scanned_grads(*args, by_max=False)
    # Shifted by the targets' logits, an exponential overflows where a target's logit is more than about
    # 88 - ln(V) below its row's maximum (a loss that large is rare): then the whole loss is computed again.
    nll_BT, grads = jax.lax.cond(
        jnp.all(jnp.isfinite(nll_BT)), lambda: (nll_BT, grads), lambda: _scanned_grads(*args, by_max=True)
    )
    return jnp.sum(weights_BT * nll_BT), (grads, nll_BT)


def _nll_sum_bwd(vocab_size, chunk, res, g):
    (dh_BTD, dw_DV, db_V), nll_BT = res
    scale = lambda x: None if x is None else (g * x).astype(x.dtype)
    return scale(dh_BTD), scale(dw_DV), scale(db_V), None, g * nll_BT


nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)
