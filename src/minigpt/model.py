"""A decoder-only transformer in Flax NNX. Every parameter carries logical axis names (`axes=`), which
`sharding.py` maps onto the mesh, so the same module runs data parallel, FSDP or tensor parallel.

Shapes are named in variables: B batch, T time, D model width, N heads, H head dim, F feed-forward, V vocab.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.sharding import activation_sharding_constraint

Axes = tuple[str | None, ...]


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def _zeros(shape: tuple[int, ...], axes: Axes) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout driven by an explicit key; `key=None` (eval, generation) is the identity."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, d: int, bias: bool) -> None:
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), axes=("embed",))
        self.bias = _zeros((d,), ("embed",)) if bias else None

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x_BTD.dtype)


class Linear(nnx.Module):
    """y = x @ W (+ b) with W (in, out) named by `axes`; computes in the input's dtype."""

    def __init__(self, d_in: int, d_out: int, axes: Axes, bias: bool, std: float, rngs: nnx.Rngs) -> None:
        self.kernel = _param(rngs, (d_in, d_out), axes, std)
        self.bias = _zeros((d_out,), (axes[1],)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...].astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads are split over the tensor axis (Megatron column/row split)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d, std = cfg.d_model, 0.02
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q = Linear(d, d, ("embed", "heads"), cfg.bias, std, rngs)
        self.k = Linear(d, d, ("embed", "heads"), cfg.bias, std, rngs)
        self.v = Linear(d, d, ("embed", "heads"), cfg.bias, std, rngs)
        self.o = Linear(d, d, ("heads", "embed"), cfg.bias, std / math.sqrt(2 * cfg.n_layers), rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        B, T, _ = x_BTD.shape
        q_BTNH, k_BTNH, v_BTNH = (
            proj(x_BTD).reshape(B, T, self.n_heads, self.head_dim) for proj in (self.q, self.k, self.v)
        )
        y_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BTNH, v_BTNH, is_causal=True)
        return self.o(y_BTNH.reshape(B, T, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.up = Linear(cfg.d_model, cfg.d_ff, ("embed", "mlp"), cfg.bias, 0.02, rngs)
        self.down = Linear(
            cfg.d_ff, cfg.d_model, ("mlp", "embed"), cfg.bias, 0.02 / math.sqrt(2 * cfg.n_layers), rngs
        )
        self.act = jax.nn.relu if cfg.activation == "relu" else jax.nn.gelu

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return self.down(self.act(self.up(x_BTD)))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.pre_norm = cfg.norm_position == "pre"
        self.rate = cfg.dropout
        self.ln1 = LayerNorm(cfg.d_model, cfg.bias)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, cfg.bias)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BTD: jax.Array, key: jax.Array | None) -> jax.Array:
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        if self.pre_norm:
            x_BTD = x_BTD + dropout(self.attn(self.ln1(x_BTD)), self.rate, k1)
            x_BTD = x_BTD + dropout(self.mlp(self.ln2(x_BTD)), self.rate, k2)
        else:
            x_BTD = self.ln1(x_BTD + dropout(self.attn(x_BTD), self.rate, k1))
            x_BTD = self.ln2(x_BTD + dropout(self.mlp(x_BTD), self.rate, k2))
        return activation_sharding_constraint(x_BTD)


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        if cfg.vocab_size <= 0:
            raise ValueError(
                "ModelConfig.vocab_size must be set (from the tokenizer) before building the model"
            )
        self.cfg = cfg
        V, D = cfg.padded_vocab, cfg.d_model
        self.wte = _param(rngs, (V, D), ("vocab", "embed"), 0.02)
        self.wpe = _param(rngs, (cfg.max_seq_len, D), (None, "embed"), 0.01)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = LayerNorm(D, cfg.bias) if cfg.norm_position == "pre" else None
        self.lm_head = None if cfg.tie_embeddings else Linear(D, V, ("embed", "vocab"), cfg.bias, 0.02, rngs)

    def __call__(self, tokens_BT: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits (B, T, padded vocab) in float32; padded vocabulary entries are -inf-like so they never win."""
        cfg = self.cfg
        dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
        T = tokens_BT.shape[1]
        x_BTD = (self.wte[...][tokens_BT] + self.wpe[...][:T]).astype(dtype)
        keys = (
            list(jax.random.split(dropout_key, cfg.n_layers + 1))
            if dropout_key is not None
            else [None] * (cfg.n_layers + 1)
        )
        x_BTD = activation_sharding_constraint(dropout(x_BTD, cfg.dropout, keys[0]))
        for block, key in zip(self.blocks, keys[1:], strict=True):
            x_BTD = block(x_BTD, key)
        if self.ln_f is not None:
            x_BTD = self.ln_f(x_BTD)
        head = (lambda x: x @ self.wte[...].astype(dtype).T) if self.lm_head is None else self.lm_head
        logits_BTV = head(x_BTD).astype(jnp.float32)
        if cfg.padded_vocab != cfg.vocab_size:
            valid = jnp.arange(cfg.padded_vocab) < cfg.vocab_size
            logits_BTV = jnp.where(valid, logits_BTV, jnp.finfo(jnp.float32).min)
        return logits_BTV


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def param_axes(state: nnx.State) -> nnx.State:
    """The logical axis names of every parameter, as a State of tuples mirroring `state`."""
    return jax.tree.map(lambda v: v.get_metadata().get("axes", ()), state, is_leaf=is_variable)


def abstract_model(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and parameter shapes, without allocating any parameter memory."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(seed))))


def count_params(state: nnx.State) -> int:
    return sum(x.size for x in jax.tree.leaves(state))
