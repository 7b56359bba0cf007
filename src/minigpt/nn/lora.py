"""Low-rank adapters (LoRA) beside the model's projections: Flax NNX's `nnx.LoRA`, scaled and with dropout as
PEFT computes them, and what training, checkpoints and export need to know of them.

A projection x @ W with an adapter computes x @ W + alpha / rank * dropout(x) @ A @ B, with A (in, rank) and
B (rank, out) `nnx.LoRAParam`s: B starts at zero, so step 0 computes the base model exactly, and A as PEFT
initialises it (Kaiming-uniform, a = sqrt(5)). Only the adapters train (`split`); export folds them into W
(`merge`).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt.config import LoRAConfig
from minigpt.nn.dropout import dropout

A_INIT = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
"""torch's kaiming_uniform_(a=sqrt(5)), what PEFT gives A: uniform in +-1/sqrt(in)."""
A, B = "lora_a", "lora_b"


class Adapter(nnx.Module):
    """The adapter of one projection (in -> out): its change to the projection's output."""

    def __init__(self, cfg: LoRAConfig, d_in: int, d_out: int, axes: tuple, rngs: nnx.Rngs) -> None:
        self.scale, self.rate = cfg.alpha / cfg.rank, cfg.dropout
        self.lora = nnx.LoRA(
            d_in, cfg.rank, d_out, a_initializer=A_INIT, rngs=rngs,
            a_metadata={"axes": (axes[0], None)}, b_metadata={"axes": (None, axes[1])},
        )  # fmt: skip

    def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        return (self.lora(dropout(x, self.rate, key)) * self.scale).astype(x.dtype)


def key_for(key: jax.Array | None, cfg: LoRAConfig, i: int) -> jax.Array | None:
    """The dropout key of a layer's i-th adapter (None when adapters drop nothing), apart from the keys the
    layer's own dropout uses."""
    if key is None or not (cfg.rank and cfg.dropout):
        return None
    return jax.random.fold_in(key, 1000 + i)


def keys(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if key is None else list(jax.random.split(key, n))


def is_adapter(name: str) -> bool:
    """Whether a parameter's dotted name (`minigpt.hf` names) is an adapter's."""
    return name.endswith((f".adapter.lora.{A}", f".adapter.lora.{B}"))


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, everything else) of a model's parameters: what trains and what stays frozen."""
    return nnx.split_state(params, nnx.LoRAParam, ...)


def merge(adapters: nnx.State, rest: nnx.State) -> nnx.State:
    return nnx.merge_state(adapters, rest)


def initial(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A fresh adapter matrix: A as PEFT initialises it (per name, from the run's seed), B zero."""
    if name.endswith(B):
        return np.zeros(shape, np.float32)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), zlib.crc32(name.encode()))
    if len(shape) == 3:  # scanned layers: one A per layer
        return np.stack([np.asarray(A_INIT(k, shape[1:])) for k in jax.random.split(key, shape[0])])
    return np.asarray(A_INIT(key, shape))


def merged(named: dict[str, np.ndarray], cfg: LoRAConfig) -> dict[str, np.ndarray]:
    """Parameters by dotted name with each adapter folded into its projection, W + alpha / rank * A @ B, and
    the adapters gone: a plain model computing what the adapted one does."""
    out = {k: v for k, v in named.items() if not is_adapter(k)}
    for name in named:
        if name.endswith(f".adapter.lora.{A}"):
            owner = name.removesuffix(f"adapter.lora.{A}")
            delta = named[name].astype(np.float64) @ named[owner + f"adapter.lora.{B}"].astype(np.float64)
            kernel = out[owner + "kernel"]
            out[owner + "kernel"] = (kernel + cfg.alpha / cfg.rank * delta).astype(kernel.dtype)
    return out


def size(params: Any) -> tuple[int, int]:
    """(adapter parameters, all parameters) of a model's parameters."""
    adapters, rest = split(params)
    count = lambda s: sum(math.prod(x.shape) for x in jax.tree.leaves(s))
    return count(adapters), count(adapters) + count(rest)
