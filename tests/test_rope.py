"""RoPE's rotation: read off a table of the program's constants, equal to computing it, and no
transcendental left in a compiled training step."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.nn import rope as rope_module
from minigpt.nn.model import GPT
from minigpt.nn.rope import rope, rope_frequencies, rotation
from minigpt.training.trainer import mean_nll

CFG = ModelConfig(
    vocab_size=300,
    max_seq_len=64,
    d_model=32,
    n_layers=2,
    n_heads=2,
    d_ff=64,
    position="rope",
    norm="rmsnorm",
)


@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_the_table_equals_the_angles_computed(scaling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dataclasses.replace(CFG, rope_scaling=scaling, rope_original_max_len=16, rope_factor=8.0)
    positions_BT = jnp.array([[0, 1, 2, 63], [5, 0, 1, 2]])
    cos, sin = rotation(positions_BT, cfg)
    assert cos.shape == sin.shape == (2, 4, 1, 8)
    angles = np.asarray(positions_BT, np.float64)[:, :, None, None] * rope_frequencies(cfg).astype(np.float64)
    np.testing.assert_allclose(cos, np.cos(angles), atol=2e-6)
    np.testing.assert_allclose(sin, np.sin(angles), atol=2e-6)
    monkeypatch.setattr(rope_module, "TABLE_ENTRIES", 0)  # past the table's size: computed in the program
    computed = rotation(positions_BT, cfg)
    np.testing.assert_allclose(cos, computed[0], atol=2e-6)
    np.testing.assert_allclose(sin, computed[1], atol=2e-6)


def test_rope_rotates_each_pair_by_its_angle() -> None:
    x_BTNH = jax.random.normal(jax.random.key(0), (1, 3, 2, 16))
    rot = rotation(jnp.array([[0, 1, 2]]), CFG)
    y = rope(x_BTNH, rot)
    np.testing.assert_array_equal(y[:, 0], x_BTNH[:, 0])  # position 0: no rotation
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x_BTNH, axis=-1), rtol=1e-5)


def test_a_compiled_training_step_evaluates_no_cos_or_sin() -> None:
    """XLA:CPU fuses cos and sin into every pass that reads them, once per head and per use, forward and
    backward: with the table they are not evaluated at all."""
    model = GPT(CFG, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 300)
    hlo = jax.jit(jax.grad(lambda p: mean_nll(graphdef, p, tokens, None))).lower(params).compile().as_text()
    assert not re.search(r"\b(cosine|sine)\(", hlo)
