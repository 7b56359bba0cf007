"""Muon's transformation of the hidden matrices: optax.contrib.muon's chain and state, with its Newton-Schulz
orthogonalization done for all matrices of one shape at once, in the model's compute dtype.

optax orthogonalizes leaf by leaf: five iterations of three small products for every matrix, about 1,200
ops per step for the cpu preset's 36 matrices, most of them too small to keep a core busy. Stacked by shape
(a (384, 96) matrix joins the (96, 384) ones transposed, since f(X^T) = f(X)^T), they are two batched
products per iteration. In bfloat16 the products take the CPU's bf16 path with float32 accumulation, as
Keller Jordan's reference runs them in bf16 on GPUs; the iterate stays float32 between products.

The state is optax's own (its momentum and Nesterov step run unchanged, with no iterations of their own), so
checkpoints written with optax.contrib.muon load here and the other way round.
"""

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.contrib

NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's coefficients: optax's and the reference's default."""
NS_STEPS = 5


def dimension_numbers(params: Any) -> Any:
    """Orthogonalize over the last two axes (in, out); leading axes, e.g. stacked layers, are a batch."""
    return jax.tree.map(
        lambda _: optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1), params
    )


def newton_schulz(x_NRC: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Orthogonalize each of N matrices (rows <= columns, Frobenius norm <= 1): float32 out, products on
    `dtype` operands with float32 accumulation."""
    a, b, c = NS_COEFFS

    def bmm(p: jax.Array, q: jax.Array, contract: tuple[int, int]) -> jax.Array:
        dims = (((contract[0],), (contract[1],)), ((0,), (0,)))
        return jax.lax.dot_general(p.astype(dtype), q.astype(dtype), dims, preferred_element_type=jnp.float32)

    x_NRC = x_NRC.astype(jnp.float32)
    for _ in range(NS_STEPS):
        gram_NRR = bmm(x_NRC, x_NRC, (2, 2))
        poly_NRR = b * gram_NRR + c * bmm(gram_NRR, gram_NRR, (2, 1))
        x_NRC = a * x_NRC + bmm(poly_NRR, x_NRC, (2, 1))
    return x_NRC


def _as_wide_stack(u: jax.Array) -> jax.Array:
    """(..., R, C) as (N, min, max): the smaller Gram matrix, and one shape for both orientations."""
    m = u.reshape(-1, *u.shape[-2:])
    return m if m.shape[1] <= m.shape[2] else jnp.swapaxes(m, 1, 2)


def orthogonalize(updates: Any, dtype: jnp.dtype) -> Any:
    """Newton-Schulz on every matrix of `updates` (each already of unit Frobenius norm), one batch per
    shape; each leaf keeps its shape and dtype."""
    leaves, treedef = jax.tree.flatten(updates)
    stacks = [_as_wide_stack(u) for u in leaves]
    out = list(leaves)
    by_shape = sorted(range(len(leaves)), key=lambda i: stacks[i].shape[1:])
    for _, group in itertools.groupby(by_shape, key=lambda i: stacks[i].shape[1:]):
        group = list(group)
        sizes = [stacks[i].shape[0] for i in group]
        done = newton_schulz(jnp.concatenate([stacks[i] for i in group]), dtype)
        for i, part in zip(group, jnp.split(done, list(itertools.accumulate(sizes))[:-1]), strict=True):
            wide = leaves[i].shape[-2] <= leaves[i].shape[-1]
            part = part if wide else jnp.swapaxes(part, 1, 2)
            out[i] = part.reshape(leaves[i].shape).astype(leaves[i].dtype)
    return treedef.unflatten(out)


def scale_by_muon(beta: float, nesterov: bool, dtype: jnp.dtype) -> optax.GradientTransformation:
    """optax's scale_by_muon with its state, momentum and normalization, and `orthogonalize`'s iterations."""
    inner = optax.contrib.scale_by_muon(
        ns_steps=0, beta=beta, nesterov=nesterov, weight_dimension_numbers=dimension_numbers
    )

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        normalized, state = inner.update(updates, state, params)
        return orthogonalize(normalized, dtype), state

    return optax.GradientTransformation(inner.init, update)


def _width_scale(updates: Any, params: Any = None) -> Any:
    """sqrt(max(1, fan_out / fan_in)) per matrix, as optax's scale_by_shape."""
    del params
    return jax.tree.map(lambda u: u * jnp.sqrt(jnp.maximum(1, u.shape[-1] / u.shape[-2])), updates)


def muon(
    lr: optax.ScalarOrSchedule,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    weight_decay_mask: Any,
    dtype: jnp.dtype,
) -> optax.GradientTransformation:
    """optax.contrib.muon(lr, beta=beta, nesterov=nesterov, weight_decay=..., muon_weight_dimension_numbers=
    dimension_numbers) for a tree of matrices only, with the same state's structure."""
    return optax.partition(
        transforms={
            "muon": optax.chain(
                scale_by_muon(beta, nesterov, dtype),
                optax.stateless(_width_scale),
                optax.add_decayed_weights(weight_decay, weight_decay_mask),
                optax.scale_by_learning_rate(lr),
            ),
            # optax's own partition keeps an AdamW for non-matrix leaves: here it holds nothing, but its
            # (empty) state is part of the structure a checkpoint records.
            "adam": optax.adamw(lr, 0.9, 0.999, eps=1e-8, weight_decay=0.0, nesterov=nesterov),
        },
        param_labels=lambda params: jax.tree.map(lambda _: "muon", params),
    )
