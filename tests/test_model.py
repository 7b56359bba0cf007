"""The transformer: causality, padded vocabulary, dropout only in training, presets' shapes, sharding names."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt.config import PRESETS, ModelConfig
from minigpt.nn.model import GPT, abstract_model, count_params, param_axes
from minigpt.optim.optimizer import muon_labels
from minigpt.training.trainer import mean_nll

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)

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


# ---- architecture options (issue 9): each changes what it should ----

MODERN = dataclasses.replace(
    CFG, norm="rmsnorm", position="rope", activation="swiglu", qk_norm=True, bias=False, tie_embeddings=True
)


def _params(model: GPT) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


def test_rope_attention_depends_only_on_relative_position() -> None:
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 12, 32))
    at = lambda attn, start: attn(x, jnp.broadcast_to(jnp.arange(12) + start, (2, 12)), None)[0]
    rope_attn = GPT(MODERN, nnx.Rngs(0)).blocks[0].attn
    np.testing.assert_allclose(at(rope_attn, 0), at(rope_attn, 17), atol=2e-5)  # all positions shifted: same
    # ...and it does depend on position: reversing the order of the positions changes the output
    reversed_ = rope_attn(x, jnp.broadcast_to(jnp.arange(12)[::-1] * 2, (2, 12)), None)[0]
    assert not np.allclose(reversed_, at(rope_attn, 0), atol=1e-3)
    model = GPT(MODERN, nnx.Rngs(0))
    assert model.wpe is None and not any("wpe" in k for k in _params(model))


def _scale_qk(model: GPT, factor: float) -> GPT:
    graphdef, state = nnx.split(model)
    scaled = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x * factor if any(f"['{n}']['kernel']" in jax.tree_util.keystr(p) for n in ("q", "k")) else x
        ),
        state,
    )
    return nnx.merge(graphdef, scaled)


def test_qk_norm_bounds_attention_logits_whatever_the_projection_scale() -> None:
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 16), 0, 300)
    normed = GPT(MODERN, nnx.Rngs(0))
    # equal up to the norm's epsilon (1e-5 against the unscaled q·q of ~1e-2)
    np.testing.assert_allclose(_scale_qk(normed, 1000.0)(tokens), normed(tokens), atol=5e-4)
    plain = GPT(dataclasses.replace(MODERN, qk_norm=False), nnx.Rngs(0))
    assert not np.allclose(_scale_qk(plain, 1000.0)(tokens), plain(tokens), atol=1e-2)


def test_rmsnorm_has_no_bias_and_normalises_the_root_mean_square() -> None:
    from minigpt.nn.model import Norm

    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 32)) * 7 + 2
    y = Norm(32, "rmsnorm", bias=True, eps=1e-5)(x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(jnp.square(y), -1)), 1.0, atol=1e-3)
    assert not np.allclose(y.mean(-1), 0.0, atol=1e-2)  # unlike LayerNorm, it does not centre
    np.testing.assert_allclose(Norm(32, "layernorm", bias=True, eps=1e-5)(x).mean(-1), 0.0, atol=1e-4)
    assert Norm(32, "rmsnorm", bias=True, eps=1e-5).bias is None


def test_mlp_variants_and_bias_free_layers() -> None:
    swiglu = _params(GPT(MODERN, nnx.Rngs(0)))
    assert any("['mlp']['gate']" in k for k in swiglu) and not any("bias" in k for k in swiglu)
    relu2 = GPT(dataclasses.replace(CFG, activation="relu2"), nnx.Rngs(0))
    gelu = GPT(CFG, nnx.Rngs(0))
    x = jnp.linspace(-3, 3, 32)[None, None, :]
    h = relu2.blocks[0].mlp.up(x)
    expected = (
        jnp.square(jnp.maximum(h, 0)) @ relu2.blocks[0].mlp.down.kernel[...]
        + relu2.blocks[0].mlp.down.bias[...]
    )
    np.testing.assert_allclose(relu2.blocks[0].mlp(x), expected, atol=1e-6)
    assert not np.allclose(relu2.blocks[0].mlp(x), gelu.blocks[0].mlp(x))


def test_grouped_query_attention_equals_multi_head_with_shared_key_value_heads() -> None:
    gqa_cfg = dataclasses.replace(CFG, n_kv_heads=2)  # 4 query heads share 2 key/value heads
    gqa = GPT(gqa_cfg, nnx.Rngs(0))
    assert gqa.blocks[0].attn.k.kernel[...].shape == (32, 2 * 8)
    mha = GPT(CFG, nnx.Rngs(0))
    graphdef, state = nnx.split(mha)
    g_state = nnx.state(gqa)
    for i in range(2):  # copy everything, repeating each kv head for the 2 query heads that use it
        for name in ("k", "v"):
            w = g_state["blocks"][i]["attn"][name]["kernel"][...].reshape(32, 2, 1, 8)
            b = g_state["blocks"][i]["attn"][name]["bias"][...].reshape(2, 1, 8)
            state["blocks"][i]["attn"][name]["kernel"][...] = jnp.broadcast_to(w, (32, 2, 2, 8)).reshape(
                32, 32
            )
            state["blocks"][i]["attn"][name]["bias"][...] = jnp.broadcast_to(b, (2, 2, 8)).reshape(32)
    copied = nnx.merge(graphdef, jax.tree.map(lambda a, b: b if a.shape == b.shape else a, state, g_state))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 10), 0, 300)
    np.testing.assert_allclose(copied(tokens), gqa(tokens), atol=1e-5)
    np.testing.assert_allclose(  # and the cached decoder agrees
        gqa.decode(tokens, jnp.broadcast_to(jnp.arange(10), (2, 10)), gqa.init_cache(2))[0],
        gqa(tokens),
        atol=1e-5,
    )


def test_scaled_init_shrinks_residual_projections() -> None:
    deep = dataclasses.replace(CFG, n_layers=8, d_model=64, d_ff=256)
    scaled, plain = GPT(deep, nnx.Rngs(0)), GPT(dataclasses.replace(deep, scaled_init=False), nnx.Rngs(0))
    assert float(jnp.std(scaled.blocks[0].attn.o.kernel[...])) == pytest.approx(0.02 / 4, rel=0.1)
    assert float(jnp.std(plain.blocks[0].mlp.down.kernel[...])) == pytest.approx(0.02, rel=0.1)
    assert float(jnp.std(scaled.blocks[0].attn.q.kernel[...])) == pytest.approx(0.02, rel=0.1)


def _loss_and_grads(cfg: ModelConfig):
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 17), 0, 300)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1], dropout_key=jax.random.PRNGKey(9))
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


def test_scanned_and_rematerialised_layers_compute_the_same_loss_and_gradients() -> None:
    cfg = dataclasses.replace(MODERN, dropout=0.1)
    loss, grads = _loss_and_grads(cfg)
    variants = [{"scan_layers": True}] + [{"remat": r} for r in ("dots", "projections", "full")]
    for variant in [*variants, {"scan_layers": True, "remat": "projections"}]:
        v_loss, v_grads = _loss_and_grads(dataclasses.replace(cfg, **variant))
        assert float(v_loss) == pytest.approx(float(loss), rel=1e-6), variant
        if variant.get("scan_layers"):  # stacked (L, ...) gradients are the per-layer ones, stacked
            v_grads = v_grads["blocks"]
            for i in range(cfg.n_layers):
                for a, b in zip(
                    jax.tree.leaves(grads["blocks"][i]),
                    jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i], v_grads)),
                    strict=True,
                ):
                    np.testing.assert_allclose(a, b, atol=1e-6)
        else:
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(v_grads), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-6)


def _with_share(model: GPT, share: float) -> GPT:
    for block in model.blocks:
        block.attn.v_mix[...] = jnp.full((1,), share)
    return model


def test_the_value_residual_mixes_the_first_layers_values_into_every_later_layer() -> None:
    cfg = dataclasses.replace(MODERN, n_layers=3, value_residual=True)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 16), 0, 300)
    plain = GPT(dataclasses.replace(cfg, value_residual=False), nnx.Rngs(0))(tokens)
    # A share of 0 is the plain model (same weights); the initial share of a half is not.
    np.testing.assert_allclose(_with_share(GPT(cfg, nnx.Rngs(0)), 0.0)(tokens), plain, atol=1e-6)
    assert not np.allclose(GPT(cfg, nnx.Rngs(0))(tokens), plain, atol=1e-3)
    # At a share of 1 every layer attends over the first layer's values: the later value projections are
    # unused, and the first layer's share changes nothing (it mixes its values with themselves).
    graphdef, params = nnx.split(_with_share(GPT(cfg, nnx.Rngs(0)), 1.0))
    grads = jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).mean())(params)
    for i in range(cfg.n_layers):
        v_kernel, v_mix = (
            grads["blocks"][i]["attn"]["v"]["kernel"][...],
            grads["blocks"][i]["attn"]["v_mix"][...],
        )
        assert (np.abs(v_kernel).max() > 0) == (i == 0), i
        assert (np.abs(v_mix).max() > 0) == (i > 0), i
    # Scanned and rematerialised layers carry the first layer's values the same way.
    loss, _ = _loss_and_grads(cfg)
    for variant in ({"scan_layers": True}, {"scan_layers": True, "remat": "full"}):
        v_loss, _ = _loss_and_grads(dataclasses.replace(cfg, **variant))
        assert float(v_loss) == pytest.approx(float(loss), rel=1e-6), variant


def _with_ve_mix(model: GPT, mixes: list[tuple[float, float]]) -> GPT:
    for block, mix in zip(model.blocks, mixes, strict=True):
        block.attn.ve_mix[...] = jnp.array(mix)
    return model


def test_value_embeddings_add_each_layers_table_to_its_values() -> None:
    cfg = dataclasses.replace(MODERN, n_layers=3, value_embeddings=2)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 16), 0, 150)
    logits = jax.jit(lambda g, p: nnx.merge(g, p)(tokens))
    plain = logits(*nnx.split(GPT(dataclasses.replace(cfg, value_embeddings=0), nnx.Rngs(0))))
    # Weights (1, 0) are the plain model (the tables come last, so the rest initialises the same); the
    # initial halves are not.
    ones = _with_ve_mix(GPT(cfg, nnx.Rngs(0)), [(1.0, 0.0)] * 3)
    np.testing.assert_allclose(logits(*nnx.split(ones)), plain, atol=1e-6)
    assert not np.allclose(logits(*nnx.split(GPT(cfg, nnx.Rngs(0)))), plain, atol=1e-3)
    # Layers 0 and 2 read table 0, layer 1 table 1: with layer 1's embedding weighted 0, table 1 gets no
    # gradient; table 0 gets some, only in the rows of tokens the batch holds.
    graphdef, params = nnx.split(_with_ve_mix(GPT(cfg, nnx.Rngs(0)), [(0.5, 0.5), (1.0, 0.0), (0.5, 0.5)]))
    grads = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).mean()))(params)
    touched_nV = np.abs(np.asarray(grads["wve"][...])).max(-1) > 0
    np.testing.assert_array_equal(touched_nV[0], np.isin(np.arange(cfg.padded_vocab), tokens))
    assert not touched_nV[1].any()
    labels = jax.tree_util.tree_leaves_with_path(muon_labels(params))
    assert {label for path, label in labels if "wve" in jax.tree_util.keystr(path)} == {"adam"}
    # Scanned and rematerialised layers read their tables the same way.
    loss, _ = _loss_and_grads(cfg)
    v_loss, _ = _loss_and_grads(dataclasses.replace(cfg, scan_layers=True, remat="full"))
    assert float(v_loss) == pytest.approx(float(loss), rel=1e-6)


def test_scanned_layers_carry_a_leading_unsharded_layer_axis() -> None:
    _, abstract = abstract_model(dataclasses.replace(CFG, scan_layers=True))
    axes = param_axes(abstract)
    assert abstract["blocks"]["attn"]["q"]["kernel"].shape == (2, 32, 32)
    assert axes["blocks"]["attn"]["q"]["kernel"] == (None, "embed", "heads")


def test_remat_policies_trade_memory_in_order() -> None:
    """XLA's scratch memory for the loss-and-gradient step of scanned layers: keeping less is never more, and
    `full` keeps far less than `none`. (Unrolled layers give XLA's CPU scheduler the freedom to recompute
    early: there the policies save little on CPU.)"""

    def temp_bytes(remat: str) -> int:
        cfg = dataclasses.replace(
            MODERN, n_layers=4, d_model=128, d_ff=512, max_seq_len=128, remat=remat, scan_layers=True
        )
        graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
        tokens = jax.ShapeDtypeStruct((16, 129), jnp.int32)
        step = jax.jit(jax.grad(lambda p, t: mean_nll(graphdef, p, t, None)))
        return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    none, dots, projections, full = (temp_bytes(r) for r in ("none", "dots", "projections", "full"))
    assert none > dots > projections > full
    assert full < none / 3


# ---- per-document attention of packed windows ----


def test_documents_start_at_each_end_of_text_with_position_zero() -> None:
    from minigpt.nn.model import documents

    tokens = jnp.array([[5, 6, 0, 7, 8, 9, 0, 0, 4]])  # end-of-text = 0
    segments, positions = documents(tokens, 0)
    assert segments.tolist() == [[0, 0, 1, 1, 1, 1, 2, 3, 3]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1]]


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_with_document_attention_a_documents_logits_do_not_depend_on_what_precedes_it(position: str) -> None:
    cfg = dataclasses.replace(
        CFG, position=position, norm="rmsnorm", document_attention=True, eot_id=0, max_seq_len=32
    )
    model = GPT(cfg, nnx.Rngs(0))
    logits = nnx.jit(lambda m, t: m(t))  # compiled: op by op, the model's many small ops take longer
    doc = jax.random.randint(jax.random.PRNGKey(1), (1, 9), 1, cfg.vocab_size)
    doc = doc.at[:, 0].set(0)  # the document's end-of-text start
    alone = logits(model, doc)
    for before_len in (3, 11):
        before = jax.random.randint(jax.random.PRNGKey(before_len), (1, before_len), 1, cfg.vocab_size)
        packed = logits(model, jnp.concatenate([before, doc], axis=1))
        # the same logits at another offset of the window, whatever text came before it
        np.testing.assert_allclose(packed[:, before_len:], alone, atol=2e-5)
    # without document attention the text before it changes them
    plain = GPT(dataclasses.replace(cfg, document_attention=False), nnx.Rngs(0))
    shifted = logits(plain, jnp.concatenate([before, doc], axis=1))[:, before_len:]
    assert not np.allclose(shifted, logits(plain, doc), atol=1e-3)
