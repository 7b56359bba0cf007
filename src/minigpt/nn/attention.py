"""Causal self-attention: which implementation runs it (`attend`), and minigpt's own in mixed precision, with
every product on the fast path (`matmul`): bfloat16 operands, float32 accumulation, softmax and its gradient
in float32.

`jax.nn.dot_product_attention`'s XLA implementation works on (B, T, N, H) arrays, so each of its products
and their gradients contracts an axis that is not the last: XLA:CPU upcasts those dots to float32. Here the
heads move in front of time once (keys with their head dim before time), so the forward products are
(T, H) @ (H, S) and (T, S) @ (S, H) per head, and a custom VJP writes the four backward products the same
way, each with the one operand it must transpose made row-major first. The softmax runs in float32; the
probabilities are kept for the backward pass in the compute dtype its products read them in.

Shapes: B batch, T queries, S keys (= T), N query heads, K key/value heads, G = N / K query heads per
key/value head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minigpt.config import ModelConfig
from minigpt.nn import splash
from minigpt.nn.matmul import dot, transposed

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def _visible(T: int, visible_B1TT: jax.Array | None) -> jax.Array:
    """(B or 1, 1, 1, T, S) booleans: causal, and within `visible_B1TT` where given."""
    causal_TS = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    if visible_B1TT is None:
        return causal_TS[None, None, None]
    return (visible_B1TT & causal_TS)[:, :, None]


def _forward(q_BTNH, k_BTKH, v_BTKH, visible_B1TT):
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q_BKGTH = transposed(q_BTNH.reshape(B, T, K, N // K, H), (0, 2, 3, 1, 4))
    k_BKHS = transposed(k_BTKH, (0, 2, 3, 1))
    v_BKSH = transposed(v_BTKH, (0, 2, 1, 3))
    scores_BKGTS = dot(q_BKGTH, k_BKHS, (4, 2), batch=2) * jnp.float32(H**-0.5)
    scores_BKGTS = jnp.where(_visible(T, visible_B1TT), scores_BKGTS, _MASKED)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BTKH.dtype)
    y_BKGTH = dot(probs_BKGTS, v_BKSH, (4, 2), batch=2)
    y_BTNH = transposed(y_BKGTH.astype(v_BTKH.dtype), (0, 3, 1, 2, 4)).reshape(B, T, N, H)
    return y_BTNH, (q_BTNH, k_BKHS, v_BKSH, probs_BKGTS, y_BKGTH)


@jax.custom_vjp
def attention(
    q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, visible_B1TT: jax.Array | None
) -> jax.Array:
    """softmax(q k^T / sqrt(H), causal and `visible_B1TT`-masked) v, in the inputs' dtype, as
    `jax.nn.dot_product_attention(..., is_causal=True, mask=visible_B1TT)` computes it."""
    return _forward(q_BTNH, k_BTKH, v_BTKH, visible_B1TT)[0]


def _attention_fwd(q_BTNH, k_BTKH, v_BTKH, visible_B1TT):
    return _forward(q_BTNH, k_BTKH, v_BTKH, visible_B1TT)


def _attention_bwd(res, dy_BTNH):
    q_BTNH, k_BKHS, v_BKSH, probs_BKGTS, y_BKGTH = res
    B, T, N, H = q_BTNH.shape
    K, dtype = k_BKHS.shape[1], q_BTNH.dtype
    G = N // K
    dy_BTKGH = dy_BTNH.astype(dtype).reshape(B, T, K, G, H)
    dy_BKGTH = transposed(dy_BTKGH, (0, 2, 3, 1, 4))
    dprobs_BKGTS = dot(dy_BKGTH, v_BKSH, (4, 3), batch=2)
    # Softmax's gradient, p * (dp - sum(dp * p)), the sum taken as sum(dy * y) over H rather than over S
    # (they are equal); masked positions have probability 0 and get none.
    # The scores' scale 1/sqrt(H) goes on the products' (small) float32 outputs: on the (T, S) gradient
    # XLA:CPU would materialise it as a whole array for the fused kernel to read.
    dot_BKGT1 = jnp.sum(dy_BKGTH.astype(jnp.float32) * y_BKGTH, -1, keepdims=True)
    ds_BKGTS = (probs_BKGTS * (dprobs_BKGTS - dot_BKGT1)).astype(dtype)
    scale = jnp.float32(H**-0.5)
    dq_BKGTH = (dot(ds_BKGTS, k_BKHS, (4, 3), batch=2) * scale).astype(dtype)
    # Keys and values are summed over the G heads sharing them and the T queries: (H, G*T) @ (G*T, S).
    qT_BKHX = transposed(q_BTNH.reshape(B, T, K, G, H), (0, 2, 4, 3, 1)).reshape(B, K, H, G * T)
    dyT_BKHX = transposed(dy_BTKGH, (0, 2, 4, 3, 1)).reshape(B, K, H, G * T)
    dkT_BKHS = (dot(qT_BKHX, ds_BKGTS.reshape(B, K, G * T, T), (3, 2), batch=2) * scale).astype(dtype)
    probs_BKXS = probs_BKGTS.reshape(B, K, G * T, T)
    dvT_BKHS = dot(dyT_BKHX, probs_BKXS, (3, 2), batch=2).astype(dtype)
    dq_BTNH = transposed(dq_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H)
    return dq_BTNH, transposed(dkT_BKHS, (0, 3, 1, 2)), transposed(dvT_BKHS, (0, 3, 1, 2)), None


attention.defvjp(_attention_fwd, _attention_bwd)


def implementation(cfg: ModelConfig, q_BTNH: jax.Array, causal_only: bool) -> str:
    """auto: on a TPU the splash kernel (`splash.py`) for long sequences, whose (T, T) scores are what memory
    runs out on, and XLA's for short ones, which it runs faster; in 16-bit, cuDNN's fused (flash) attention
    on GPUs and minigpt's mixed-precision products on CPUs (`attention.py`); XLA's `dot_product_attention` in
    float32. Splash takes no mask, and needs tiles that divide T: elsewhere XLA's runs."""
    T = q_BTNH.shape[1]
    splash_fits = causal_only and splash.supported(T)
    if cfg.attention == "splash":
        return "splash" if splash_fits else "xla"
    if cfg.attention != "auto":
        return cfg.attention
    if jax.default_backend() == "tpu":
        return "splash" if splash_fits and T >= splash.LONG else "xla"
    if q_BTNH.dtype == jnp.float32:
        return "xla"
    return "cudnn" if jax.default_backend() == "gpu" else "mixed"


def attend(
    cfg: ModelConfig, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, visible_B1TT: jax.Array | None
) -> jax.Array:
    """Causal attention, and with `visible_B1TT` only where it is true as well, by the implementation
    `implementation` picks, under the named scope a profile's breakdown files it by (tools/breakdown.py)."""
    with jax.named_scope("attention"):
        impl = implementation(cfg, q_BTNH, visible_B1TT is None)
        if impl == "mixed":
            return attention(q_BTNH, k_BTKH, v_BTKH, visible_B1TT)
        if impl == "splash":
            return splash.attention(q_BTNH, k_BTKH, v_BTKH)
        return jax.nn.dot_product_attention(
            q_BTNH, k_BTKH, v_BTKH, mask=visible_B1TT, is_causal=True, implementation=impl
        )


def cached_attention(
    q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, positions_BT: jax.Array
) -> jax.Array:
    """Decoding's attention over a key/value cache (B, K, S, H): each query sees the slots at positions <= its
    own (per row), so slots past a row's position may hold anything. The arithmetic is
    `jax.nn.dot_product_attention`'s (float32 scores and softmax); heads sit before slots so the two products
    read the cache without transposing it every step. Returns (B, T, N, H)."""
    B, T, N, H = q_BTNH.shape
    K, S = k_BKSH.shape[1], k_BKSH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum(
        "BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH.astype(q_BTNH.dtype), preferred_element_type=jnp.float32
    ) * jnp.float32(H**-0.5)
    visible_B11TS = (jnp.arange(S)[None, None, :] <= positions_BT[:, :, None])[:, None, None]
    scores_BKGTS = jnp.where(visible_B11TS, scores_BKGTS, _MASKED)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(q_BTNH.dtype)
    y_BTKGH = jnp.einsum("BKGTS,BKSH->BTKGH", probs_BKGTS, v_BKSH.astype(q_BTNH.dtype))
    return y_BTKGH.reshape(B, T, N, H)
