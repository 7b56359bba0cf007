"""minigpt.optim.muon against optax.contrib.muon, which it replaces: the same state (checkpoints load either way)
and the same updates in float32; in bfloat16 the orthogonalized directions stay close to float32's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

from minigpt.optim import muon

# The cpu preset's hidden matrices in miniature: square ones, both orientations of the MLP's, and a
# scan-stacked kernel (layers, in, out) whose layers are orthogonalized one by one.
SHAPES = {"q": (16, 16), "k": (16, 16), "up": (16, 64), "down": (64, 16), "stacked": (3, 16, 64)}


def _tree(seed: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {name: jax.random.normal(k, shape) for k, (name, shape) in zip(keys, SHAPES.items(), strict=True)}


def _optax_muon(lr: float) -> optax.GradientTransformation:
    return optax.contrib.muon(
        lr, beta=0.9, nesterov=True, weight_decay=0.1, muon_weight_dimension_numbers=muon.dimension_numbers
    )


def _run(tx: optax.GradientTransformation, steps: int = 3) -> tuple[dict, optax.OptState]:
    params = _tree(0)
    state = tx.init(params)
    for step in range(steps):
        updates, state = tx.update(_tree(step + 1), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_same_state_and_updates_as_optax_in_float32() -> None:
    ours, ours_state = _run(muon.muon(0.02, 0.9, True, 0.1, None, jnp.dtype(jnp.float32)))
    theirs, theirs_state = _run(_optax_muon(0.02))
    assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
    assert jax.tree.map(jnp.shape, ours_state) == jax.tree.map(jnp.shape, theirs_state)
    for name in SHAPES:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_checkpointed_optax_state_continues_here() -> None:
    """optax's state after two steps, taken up by minigpt.optim.muon, gives optax's third step."""
    tx_theirs, tx_ours = _optax_muon(0.02), muon.muon(0.02, 0.9, True, 0.1, None, jnp.dtype(jnp.float32))
    params = _tree(0)
    _, state = _run(tx_theirs, steps=2)
    ours, _ = tx_ours.update(_tree(3), state, params)
    theirs, _ = tx_theirs.update(_tree(3), state, params)
    for name in SHAPES:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (3, 16, 64)])
def test_updates_are_orthogonal(shape: tuple[int, ...]) -> None:
    """Newton-Schulz's quintic leaves every singular value of each matrix in about [0.7, 1.2]."""
    g = jax.random.normal(jax.random.key(0), shape)
    x = g / jnp.linalg.norm(g, axis=(-2, -1), keepdims=True)
    out = muon.orthogonalize({"w": x}, jnp.dtype(jnp.float32))["w"]
    assert out.shape == shape and out.dtype == x.dtype
    singular = np.linalg.svd(np.asarray(out).reshape(-1, *shape[-2:]), compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.25


def test_bfloat16_products_stay_close_to_float32() -> None:
    """bf16 operands with float32 accumulation: each matrix within 5% of float32's (the iteration amplifies rounding: about 3% here)."""
    x = jax.tree.map(lambda g: g / jnp.linalg.norm(g, axis=(-2, -1), keepdims=True), _tree(0))
    f32 = muon.orthogonalize(x, jnp.dtype(jnp.float32))
    bf16 = muon.orthogonalize(x, jnp.dtype(jnp.bfloat16))
    for name in SHAPES:
        assert bf16[name].dtype == jnp.float32
        rel = jnp.linalg.norm(bf16[name] - f32[name]) / jnp.linalg.norm(f32[name])
        assert 0 < float(rel) < 0.05, (name, float(rel))


def test_one_batched_product_per_shape() -> None:
    """The cpu preset's 36 matrices (24 square, 6 wide, 6 tall) take two groups of products, not 36."""
    tree = {f"m{i}": jnp.zeros(s) for i, s in enumerate([(96, 96)] * 24 + [(96, 384)] * 6 + [(384, 96)] * 6)}
    hlo = jax.jit(lambda t: muon.orthogonalize(t, jnp.dtype(jnp.float32))).lower(tree).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 2 * 3 * muon.NS_STEPS, len(dots)
