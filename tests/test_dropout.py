"""Dropout on 16-bit draws: the rate asked for, an unbiased rescale, independent elements, any shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minigpt.nn.dropout import dropout

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.97])
@pytest.mark.parametrize("shape", [(64, 512, 32), (512, 1001)], ids=["even", "odd"])
def test_dropout_drops_the_rate_and_keeps_the_mean(rate: float, shape: tuple[int, ...]) -> None:
    x = jnp.ones(shape, jnp.float32)
    y = dropout(x, rate, jax.random.PRNGKey(0))
    dropped = np.asarray(y == 0)
    assert y.shape == x.shape and abs(dropped.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / x.size)
    assert float(jnp.mean(y)) == pytest.approx(1.0, abs=4 * np.sqrt(rate / (1 - rate) / x.size))
    # The two halves of one 32-bit word drive neighbouring elements: they must drop independently.
    pairs = dropped[..., : shape[-1] // 2 * 2].reshape(-1, 2)
    both = np.mean(pairs[:, 0] & pairs[:, 1])
    assert abs(both - rate**2) < 4 * np.sqrt(rate**2 * (1 - rate**2) / len(pairs)), (both, rate**2)


def test_dropout_is_the_identity_without_a_key_or_a_rate_and_keeps_the_dtype() -> None:
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16)).astype(jnp.bfloat16)
    assert dropout(x, 0.1, None) is x and dropout(x, 0.0, jax.random.PRNGKey(2)) is x
    y = dropout(x, 0.25, jax.random.PRNGKey(2))
    assert y.dtype == jnp.bfloat16
    kept = y != 0
    np.testing.assert_allclose(y[kept].astype(jnp.float32), x[kept].astype(jnp.float32) / 0.75, rtol=1e-2)


def test_bfloat16_dropout_scales_by_the_exact_inverse_keep_rate() -> None:
    """The rescale happens in float32 and only the result rounds: rounded first, 1/0.9 would be 1.109375
    in bfloat16, every kept element 0.16% short."""
    x = jax.random.normal(jax.random.PRNGKey(3), (256, 4096)).astype(jnp.bfloat16)
    y = dropout(x, 0.1, jax.random.PRNGKey(4))
    kept = np.asarray(y != 0)
    xf, yf = (np.asarray(a, np.float64)[kept] for a in (x, y))
    cut = round(0.1 * 2**16)
    assert (xf @ yf) / (xf @ xf) == pytest.approx(2**16 / (2**16 - cut), rel=2e-4)
