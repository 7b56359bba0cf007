"""Splash attention (JAX's Pallas TPU kernel, run here in Pallas's interpreter): the same values and gradients
as `jax.nn.dot_product_attention`, grouped heads included, and the model's choice of it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from minigpt.config import ModelConfig
from minigpt.nn import splash
from minigpt.nn.attention import implementation

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)

B, T, N, K, H = 1, 128, 4, 2, 16


def _inputs(dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    return tuple(
        jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes, strict=True)
    )


def _value_and_grads(fn, q, k, v, dy):
    y, vjp = jax.vjp(fn, q, k, v)
    return (y, *vjp(dy))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_splash_attention_and_its_gradients_are_dot_product_attentions(dtype: jnp.dtype) -> None:
    q, k, v, dy = _inputs(dtype)
    reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    with jax.default_matmul_precision("highest"):
        got = _value_and_grads(splash.attention, q, k, v, dy)
        want = _value_and_grads(reference, *(x.astype(jnp.float32) for x in (q, k, v, dy)))
    for name, a, b in zip(("y", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype, name
        error = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert error < (1e-5 if dtype == jnp.float32 else 2e-2), (name, error)


def test_splash_runs_only_where_its_tiles_divide_the_sequence_and_nothing_is_masked() -> None:
    """auto takes splash on a TPU for long causal sequences (their T x T scores are what memory runs out
    on); short ones, masked ones (documents, packed examples) and lengths no tile divides run on XLA's."""
    assert [splash.block(t) for t in (128, 384, 1024, 200)] == [128, 128, 512, None]
    cfg = ModelConfig(attention="splash")
    q = jnp.zeros((1, 256, 2, 8), jnp.bfloat16)
    assert implementation(cfg, q, causal_only=True) == "splash"
    assert implementation(cfg, q, causal_only=False) == "xla"
    assert implementation(cfg, jnp.zeros((1, 200, 2, 8), jnp.bfloat16), causal_only=True) == "xla"
    off_tpu = dataclasses.replace(cfg, attention="auto")
    assert implementation(off_tpu, q, causal_only=True) == (
        "mixed" if jax.default_backend() == "cpu" else "splash"
    )


def test_a_train_step_with_splash_exports_for_a_tpu_with_the_kernel_in_it() -> None:
    """No TPU here, but `jax.export` lowers for one: a small model's train step with splash attention carries
    the Pallas kernel (Mosaic's custom call) in the TPU program, and none in this CPU's."""
    from jax import export

    from minigpt.config import get_preset
    from minigpt.parallel import sharding
    from minigpt.tools.bench import bench_config
    from minigpt.training.trainer import build, make_train_step

    cfg = get_preset("cpu")
    model = dataclasses.replace(cfg.model, attention="splash", dtype="bfloat16", n_layers=2, scan_layers=True)
    cfg = bench_config(dataclasses.replace(cfg, model=model, batch_size=2), 512)
    setup = build(cfg)
    batch = jax.ShapeDtypeStruct((1, 2, cfg.data.seq_len + 1), jnp.int32)
    with sharding.set_mesh(setup.mesh):
        step = make_train_step(setup)
        tpu = export.export(step, platforms=("tpu",))(setup.abstract_state, batch, cfg.steps)
        cpu = export.export(step, platforms=("cpu",))(setup.abstract_state, batch, cfg.steps)
    assert "tpu_custom_call" in tpu.mlir_module() and "splash" in tpu.mlir_module()
    assert "tpu_custom_call" not in cpu.mlir_module()
