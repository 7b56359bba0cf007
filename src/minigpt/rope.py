"""Rotary position embeddings (RoPE): each head's dimension pairs rotated by angles that grow with the
position, so a query-key product depends on the positions' difference only. Shapes as in `model.py`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minigpt.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """RoPE's angle per position for each pair of a head's dimensions: theta^(-i/half), and with llama3
    scaling (Llama 3.1) the long wavelengths stretched by rope_factor, the short ones kept and those between
    interpolated, as transformers computes them."""
    half = cfg.head_size // 2
    freqs_H = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if cfg.rope_scaling == "none":
        return freqs_H
    wavelen_H = 2 * math.pi / freqs_H
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    scaled_H = jnp.where(wavelen_H > cfg.rope_original_max_len / low, freqs_H / cfg.rope_factor, freqs_H)
    smooth_H = (cfg.rope_original_max_len / wavelen_H - low) / (high - low)
    smoothed_H = (1 - smooth_H) * scaled_H / cfg.rope_factor + smooth_H * scaled_H
    medium_H = (wavelen_H >= cfg.rope_original_max_len / high) & (
        wavelen_H <= cfg.rope_original_max_len / low
    )
    return jnp.where(medium_H, smoothed_H, scaled_H)


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, freqs_H: jax.Array) -> jax.Array:
    """Rotary position embedding (the "rotate half" layout of GPT-NeoX and Llama): the two halves of each head
    are rotated by position-dependent angles, so q·k depends on the positions' difference only."""
    half = x_BTNH.shape[-1] // 2
    angles_BT1H = (positions_BT.astype(jnp.float32)[:, :, None] * freqs_H)[:, :, None, :]
    cos, sin = jnp.cos(angles_BT1H), jnp.sin(angles_BT1H)
    x1, x2 = x_BTNH[..., :half].astype(jnp.float32), x_BTNH[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)
