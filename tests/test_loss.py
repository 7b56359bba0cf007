"""The chunked output layer: the same losses and gradients as full logits, without their memory."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.nn import loss
from minigpt.nn.model import GPT
from minigpt.training.trainer import mean_nll, token_nll

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)

CFG = ModelConfig(vocab_size=300, max_seq_len=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.1)


def _loss_grads_nll(cfg: ModelConfig, chunk: int, tokens: jax.Array):
    graphdef, params = nnx.split(GPT(dataclasses.replace(cfg, loss_chunk=chunk), nnx.Rngs(0)))
    key = jax.random.PRNGKey(3)
    value, grads = jax.jit(jax.value_and_grad(lambda p: mean_nll(graphdef, p, tokens, key)))(params)
    return value, grads, jax.jit(token_nll, static_argnums=0)(graphdef, params, tokens)


@pytest.mark.parametrize(
    ("variant", "chunks"),
    [
        # padded vocabulary (300 -> 384), head = embedding; one position, uneven (padded), more than T
        ({"tie_embeddings": True, "bias": False}, (1, 8, 64)),
        ({"tie_embeddings": False, "bias": True, "norm_position": "post"}, (8,)),  # head bias, no final norm
        ({"tie_embeddings": True, "vocab_multiple": 1}, (21,)),  # no padding, chunk exactly T
    ],
)
def test_chunked_loss_gradients_and_nll_match_full_logits(variant: dict, chunks: tuple[int, ...]) -> None:
    cfg = dataclasses.replace(CFG, **variant)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 22), 0, 300)
    ref_loss, ref_grads, ref_nll = _loss_grads_nll(cfg, 0, tokens)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for chunk in chunks:
        got_loss, got_grads, got_nll = _loss_grads_nll(cfg, chunk, tokens)
        np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
        np.testing.assert_allclose(got_nll, ref_nll, rtol=1e-5, atol=1e-6)
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(ref_grads), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))


def test_bfloat16_chunked_gradients_match_full_logits_to_bfloat16_precision() -> None:
    cfg = dataclasses.replace(CFG, dtype="bfloat16", dropout=0.0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 32), 0, 300)
    ref_loss, ref_grads, _ = _loss_grads_nll(cfg, 0, tokens)
    got_loss, got_grads, _ = _loss_grads_nll(cfg, 8, tokens)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-3)
    ref, got = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(x)]) for x in (ref_grads, got_grads))
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_bias_and_the_padding_mask_inside_the_product_are_exact(dtype: jnp.dtype) -> None:
    """The chunked loss adds the float32 bias and masks the padded vocabulary inside the logits' product
    (extra rows of the weights against ones): in bfloat16 too, the bias is not rounded to the dtype."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    D, V, vocab = 24, 320, 300
    h_BTD = jax.random.normal(k1, (2, 10, D)).astype(dtype)
    w_DV = jax.random.normal(k2, (D, V)) * 0.2
    b_V = 3.0 + jax.random.normal(k3, (V,))  # large, with detail below bfloat16's precision
    targets_BT = jax.random.randint(k4, (2, 10), 0, vocab)
    products = jnp.einsum("btd,dv->btv", h_BTD, w_DV.astype(dtype), preferred_element_type=jnp.float32)
    ref = loss.nll(products[..., :vocab] + b_V[:vocab], targets_BT)
    got = loss.token_nll(h_BTD, w_DV, b_V, targets_BT, vocab, chunk=4)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
    rounded = loss.nll(products[..., :vocab] + b_V[:vocab].astype(dtype).astype(jnp.float32), targets_BT)
    assert dtype == jnp.float32 or float(jnp.abs(rounded - ref).max()) > 1e-3  # what rounding would cost


def test_the_auto_chunk_keeps_a_chunks_logits_near_2_to_the_24_on_a_cpu_and_2_to_the_27_elsewhere() -> None:
    assert loss.chunk_positions(-1, 48, 256, 50304, "cpu") == 8  # 19.3M logits a chunk; 4 would be 9.7M
    assert loss.chunk_positions(-1, 16, 256, 50304, "cpu") == 16
    assert loss.chunk_positions(-1, 1, 256, 50304, "cpu") == 256  # never more than the sequence
    assert loss.chunk_positions(-1, 4096, 256, 50304, "cpu") == 1
    assert loss.chunk_positions(32, 48, 16, 50304, "cpu") == 16  # an explicit chunk, capped at the sequence
    assert loss.chunk_positions(-1, 48, 256, 50304, "tpu") == 64  # 155M logits: thousands of rows a chunk
    assert loss.chunk_positions(-1, 16, 1024, 50304, "gpu") == 128
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 22), 0, 300)
    _, auto_grads, auto_nll = _loss_grads_nll(CFG, -1, tokens)
    _, grads, nll = _loss_grads_nll(CFG, 22, tokens)  # what auto picks here: all 22 positions at once
    np.testing.assert_allclose(auto_nll, nll, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(auto_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_weights_and_their_gradient_are_those_of_a_weighted_sum() -> None:
    """nll_sum's custom VJP: d/dweights is the per-position NLL, and a zero weight drops a position."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    h, w = jax.random.normal(k1, (2, 9, 16)), jax.random.normal(k2, (16, 40))
    targets = jax.random.randint(k3, (2, 9), 0, 37)
    weights = jax.random.uniform(k4, (2, 9)).at[:, 4].set(0.0)

    def reference(h, w, weights):
        return jnp.sum(weights * loss.nll(loss.logits(h, w, None, 37), targets))

    got = jax.grad(lambda h, w, wt: loss.nll_sum(h, w, None, targets, wt, 37, 4), argnums=(0, 1, 2))
    want = jax.grad(reference, argnums=(0, 1, 2))
    for a, b in zip(got(h, w, weights), want(h, w, weights), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        loss.nll_sum(h, w, None, targets, weights, 37, 4), reference(h, w, weights), rtol=1e-6
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_targets_far_below_their_rows_maximum_are_computed_exactly(dtype: jnp.dtype) -> None:
    """The logits are shifted by the targets' logits; where a target's logit is so far below its row's
    maximum (here 120 below) that its exponentials overflow, the loss is computed again shifted by the
    maximum: the loss and gradients stay those of full logits, finite."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(5), 3)
    w = jax.random.normal(k1, (16, 40))
    h = jax.random.normal(k2, (2, 9, 16)).at[1, 3].set(w[:, 7] * 120 / jnp.sum(w[:, 7] ** 2))
    targets = jax.random.randint(k3, (2, 9), 0, 37).at[1, 3].set(8)
    weights = jnp.full((2, 9), 1 / 18)
    h = h.astype(dtype).astype(jnp.float32)  # values the bfloat16 step sees, so both sides start equal

    def reference(h, w):
        logits = loss.logits(h.astype(dtype), w.astype(dtype), None, 37)
        return jnp.sum(weights * loss.nll(logits, targets))

    got = jax.value_and_grad(
        lambda h, w: loss.nll_sum(h.astype(dtype), w, None, targets, weights, 37, 4), (0, 1)
    )
    (value, grads), (ref_value, ref_grads) = jax.jit(got)(h, w), jax.value_and_grad(reference, (0, 1))(h, w)
    assert float(ref_value) > 120 / 18
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(value, ref_value, rtol=tol)
    for a, b in zip(grads, ref_grads, strict=True):
        assert bool(jnp.all(jnp.isfinite(a)))
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < tol


def _step_temp_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
    """XLA's scratch memory for a compiled loss-and-gradient step (what the activations and logits need)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    step = jax.jit(jax.grad(lambda p, t: mean_nll(graphdef, p, t, None)))
    return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_chunking_removes_the_logits_from_the_step_memory() -> None:
    """GPT-2's vocabulary at 8 x 128 tokens: the float32 logits are 206 MB a copy. Chunked by 16 positions,
    XLA's own memory plan for the step needs less than a quarter of the unchunked one."""
    cfg = ModelConfig(vocab_size=50257, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, d_ff=256)
    logits_bytes = 8 * 128 * cfg.padded_vocab * 4
    full = _step_temp_bytes(dataclasses.replace(cfg, loss_chunk=0), 8, 128)
    chunked = _step_temp_bytes(dataclasses.replace(cfg, loss_chunk=16), 8, 128)
    assert full > logits_bytes
    assert chunked < full / 4
    assert chunked < logits_bytes


def _relative_errors(grads: tuple, exact: tuple) -> list[float]:
    return [
        float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        for a, b in zip(grads, exact, strict=True)
    ]


@pytest.mark.parametrize("confidence", [0.0, 2.0], ids=["unsure", "confident"])
def test_bfloat16_weight_gradients_are_closer_to_float32_than_autodiffs_through_bfloat16_logits(
    confidence: float,
) -> None:
    """Each target's entry of the logits' gradient, wt x (p - 1), is corrected to its float32 value rather
    than rounded with the rest: the weights' gradient comes nearer float32's than autodiff's through full
    bfloat16 logits, for a model unsure of its targets (p near 0) and for a confident one (p near 1), where
    without the correction p - 1 loses its digits, and the input's is as near (its error is mostly the weights'
    rounding to bfloat16, which both share)."""
    B, T, D, V = 4, 64, 96, 1024
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    w_DV = jax.random.normal(k[1], (D, V)) * 0.3
    t_BT = jax.random.randint(k[2], (B, T), 0, V)
    wt_BT = jnp.full((B, T), 1 / (B * T))
    h_BTD = jax.random.normal(k[0], (B, T, D)) + confidence * jnp.moveaxis(
        jnp.take(w_DV, t_BT, axis=1), 0, -1
    )
    h_BTD = h_BTD.astype(jnp.bfloat16)

    def chunked(h: jax.Array, w: jax.Array) -> jax.Array:
        return loss.nll_sum(h, w, None, t_BT, wt_BT, V, 16)

    def autodiff(h: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(wt_BT * loss.nll(loss.logits(h, w.astype(h.dtype), None, V), t_BT))

    def grads(f, h: jax.Array) -> tuple:
        return jax.jit(jax.grad(f, argnums=(0, 1)))(h, w_DV)

    h32_BTD = h_BTD.astype(jnp.float32)
    p = float(jnp.mean(jnp.exp(-loss.token_nll(h32_BTD, w_DV, None, t_BT, V, 16))))
    assert p < 0.01 if confidence == 0 else p > 0.7
    exact = grads(chunked, h32_BTD)
    (dh, dw), (dh_autodiff, dw_autodiff) = (
        _relative_errors(grads(f, h_BTD), exact) for f in (chunked, autodiff)
    )
    assert dw < dw_autodiff and dh < 1.05 * dh_autodiff, (dh, dw, dh_autodiff, dw_autodiff)
