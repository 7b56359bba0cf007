"""The transformer: causality, padded vocabulary, dropout only in training, presets' shapes, sharding names."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt.config import PRESETS, ModelConfig
from minigpt.model import GPT, abstract_model, count_params, param_axes

CFG = ModelConfig(vocab_size=300, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    model = GPT(CFG, nnx.Rngs(0))
    a = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, 300)
    b = a.at[:, 10:].set((a[:, 10:] + 7) % 300)
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[:, :10], lb[:, :10], atol=1e-5)
    assert not np.allclose(la[:, 10:], lb[:, 10:])


def test_padded_vocab_entries_never_get_probability() -> None:
    model = GPT(CFG, nnx.Rngs(0))
    assert CFG.padded_vocab == 384
    logits = model(jnp.zeros((1, 4), jnp.int32))
    assert logits.shape == (1, 4, 384)
    probs = jax.nn.softmax(logits, -1)
    assert float(probs[..., 300:].max()) == 0.0
    assert np.allclose(probs[..., :300].sum(-1), 1.0, atol=1e-5)


def test_dropout_only_with_a_key() -> None:
    model = GPT(dataclasses.replace(CFG, dropout=0.5), nnx.Rngs(0))
    x = jnp.ones((1, 8), jnp.int32)
    np.testing.assert_array_equal(model(x), model(x))
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    assert not np.allclose(model(x, dropout_key=k1), model(x))
    np.testing.assert_array_equal(model(x, dropout_key=k1), model(x, dropout_key=k1))
    assert not np.allclose(model(x, dropout_key=k1), model(x, dropout_key=k2))


def test_gpt2_preset_has_gpt2_small_parameter_count() -> None:
    cfg = dataclasses.replace(PRESETS["gpt2-124m"].model, vocab_size=50257)
    _, abstract = abstract_model(cfg)
    # GPT-2 small has 124.44M parameters; padding the vocab to 50304 adds 47 rows of 768.
    assert count_params(abstract) == 124_439_808 + 47 * 768


def test_tutorial_preset_parameter_count_matches_the_seed_layers() -> None:
    cfg = dataclasses.replace(PRESETS["tutorial"].model, vocab_size=50257)
    _, abstract = abstract_model(cfg)
    V, D, F, T, L = 50304, 256, 256, 256, 4
    block = 4 * (D * D + D) + (D * F + F) + (F * D + D) + 2 * 2 * D  # attention, MLP, two LayerNorms
    assert count_params(abstract) == V * D + T * D + L * block + (
        D * V + V
    )  # token + position + blocks + head


def test_tutorial_preset_is_the_seed_architecture() -> None:
    cfg = PRESETS["tutorial"].model
    assert (cfg.max_seq_len, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layers) == (256, 256, 8, 256, 4)
    assert cfg.norm_position == "post" and cfg.activation == "relu" and not cfg.tie_embeddings


def test_every_parameter_has_logical_axes_of_its_rank() -> None:
    _, abstract = abstract_model(CFG)
    axes = jax.tree.leaves(param_axes(abstract), is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(abstract)
    assert len(axes) == len(shapes)
    assert all(len(a) == len(s.shape) for a, s in zip(axes, shapes, strict=True))


def test_tied_embeddings_share_one_table() -> None:
    model = GPT(dataclasses.replace(CFG, tie_embeddings=True), nnx.Rngs(0))
    assert model.lm_head is None
    untied = GPT(CFG, nnx.Rngs(0))
    assert count_params(nnx.state(untied)) - count_params(nnx.state(model)) == 32 * 384 + 384


def test_bfloat16_compute_keeps_float32_params_and_logits() -> None:
    model = GPT(dataclasses.replace(CFG, dtype="bfloat16"), nnx.Rngs(0))
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    ref = GPT(CFG, nnx.Rngs(0))(jnp.zeros((1, 8), jnp.int32))
    np.testing.assert_allclose(logits[..., :300], ref[..., :300], atol=0.05)
