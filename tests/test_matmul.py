"""Mixed-precision products: `dense` computes x @ W and both gradients as float32 does, to bfloat16's
precision; `transposed` is a transpose; and the compiled bfloat16 train step runs its products on XLA:CPU's
fast path where the machine has one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minigpt.nn.matmul import dense, dot, rounded, transposed
from minigpt.tools.dots import dots

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)

BF16 = jnp.dtype(jnp.bfloat16)


def _relative(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("shape", [(64, 48), (3, 20, 48)], ids=["matrix", "batch-time"])
def test_dense_and_its_gradients_are_float32s_to_bfloat16_precision(shape: tuple[int, ...]) -> None:
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, shape)
    w = 0.1 * jax.random.normal(kw, (48, 80))
    g = jax.random.normal(kg, (*shape[:-1], 80))
    y, vjp = jax.vjp(lambda x, w: dense(x.astype(BF16), w, None, BF16), x, w)
    y_ref, vjp_ref = jax.vjp(lambda x, w: x @ w, x, w)
    assert y.dtype == BF16 and _relative(y, y_ref) < 1e-2
    (dx, dw), (dx_ref, dw_ref) = vjp(g.astype(BF16)), vjp_ref(g)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32  # each its primal's dtype
    assert _relative(dx, dx_ref) < 1e-2 and _relative(dw, dw_ref) < 1e-2


def test_dense_adds_a_float32_bias_before_rounding_and_gives_its_gradient() -> None:
    """The bias's gradient, g's column sums over every leading axis, is summed in float32."""
    kx, kw, kb, kg = jax.random.split(jax.random.PRNGKey(1), 4)
    x, w = jax.random.normal(kx, (3, 20, 48)), 0.1 * jax.random.normal(kw, (48, 80))
    b, g = jax.random.normal(kb, (80,)), jax.random.normal(kg, (3, 20, 80))
    y, vjp = jax.vjp(lambda x, w, b: dense(x.astype(BF16), w, b, BF16), x, w, b)
    y_ref, vjp_ref = jax.vjp(lambda x, w, b: x @ w + b, x, w, b)
    assert y.dtype == BF16 and _relative(y, y_ref) < 1e-2
    (dx, dw, db), (dx_ref, dw_ref, db_ref) = vjp(g.astype(BF16)), vjp_ref(g)
    assert db.dtype == jnp.float32 and _relative(db, db_ref) < 1e-2
    assert _relative(dx, dx_ref) < 1e-2 and _relative(dw, dw_ref) < 1e-2
    exact = x.astype(BF16).astype(jnp.float32) @ w.astype(BF16).astype(jnp.float32) + b
    np.testing.assert_allclose(y.astype(jnp.float32), exact, rtol=2**-8, atol=1e-6)  # rounded once


def test_transposed_is_a_transpose_and_dot_accumulates_in_float32() -> None:
    x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    for perm in [(1, 0, 2, 3), (0, 2, 3, 1), (3, 2, 1, 0)]:
        np.testing.assert_array_equal(transposed(x, perm), jnp.transpose(x, perm))
    a = jnp.full((4, 300), 1 / 256, BF16)  # 300 x 2^-16 sums to 0.00458 in float32, not in bfloat16
    assert dot(a, a.T, (1, 0)).dtype == jnp.float32
    assert float(dot(a, a.T, (1, 0))[0, 0]) == pytest.approx(300 / 256**2)


def test_rounded_is_bfloat16s_round_to_nearest_even() -> None:
    """The integer rounding that spares XLA:CPU's slow conversion gives the conversion's bits, ties, the
    largest finite values (which round to infinity) and infinities included."""
    x = jax.random.normal(jax.random.PRNGKey(0), (4096,)) * jnp.logspace(-30, 30, 4096)
    ties = jax.lax.bitcast_convert_type(jnp.arange(0x3F808000, 0x3F900000, 0x10000, jnp.uint32), jnp.float32)
    edges = jnp.array([jnp.finfo(jnp.float32).max, -jnp.finfo(jnp.float32).max, jnp.inf, -jnp.inf, 0.0])
    x = jnp.concatenate([x, ties, edges])
    np.testing.assert_array_equal(
        jax.lax.bitcast_convert_type(rounded(x, BF16), jnp.uint16),
        jax.lax.bitcast_convert_type(x.astype(BF16), jnp.uint16),
    )
    assert rounded(x, jnp.dtype(jnp.float32)) is x


@pytest.fixture(scope="module")
def step_dots(bf16_fast_path: bool) -> list:
    """The dots of a bfloat16 train step of a small model of every kind of layer (GQA attention, SwiGLU,
    biases, a tied embedding as the output layer) on one CPU device."""
    from minigpt.config import DataConfig, ModelConfig, TrainConfig
    from minigpt.tools.bench import compile_step

    if not bf16_fast_path:
        pytest.skip("this CPU has no fast bfloat16 matmul path in XLA (no AMX or AVX-512 BF16)")
    model = ModelConfig(vocab_size=512, max_seq_len=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=256, activation="swiglu", tie_embeddings=True, dtype="bfloat16")  # fmt: skip
    cfg = TrainConfig(model=model, data=DataConfig(seq_len=64), batch_size=8)
    return dots(compile_step(cfg, jax.devices()[:1]).xla.as_text())


def test_every_product_of_the_bfloat16_step_runs_on_the_fast_path(step_dots: list) -> None:
    """Forward and backward, every product of the model that is more than a rounding error of the step's
    work gets bfloat16 operands in XLA:CPU's fast library (upcast to float32, it would run several times
    slower): projections, attention and the output layer."""
    model = [d for d in step_dots if d.kind != "other"]  # the optimizer's products work on float32 masters
    total = sum(d.flops for d in model)
    big = [d for d in model if d.flops > 0.002 * total]
    assert {d.kind for d in big} == {"forward", "backward"}
    slow = [f"{d.kind} {d.shapes} ({d.op_name})" for d in big if not d.fast]
    assert not slow, slow
