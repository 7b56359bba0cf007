"""Rotary position embeddings (RoPE): each head's dimension pairs rotated by angles that grow with the
position, so a query-key product depends on the positions' difference only. Shapes as in `model.py`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from minigpt.config import ModelConfig

TABLE_ENTRIES = 2**19
"""The largest cos/sin table (max_seq_len x head_size / 2) kept as a constant of the program: 2 MiB each."""

Rotation = tuple[jax.Array, jax.Array]
"""cos and sin of RoPE's angles (B, T, 1, H / 2), float32: what `rope` rotates by."""


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE's angle per position for each pair of a head's dimensions (float32): theta^(-i/half), and with
    llama3 scaling (Llama 3.1) the long wavelengths stretched by rope_factor, the short ones kept and those
    between interpolated, as transformers computes them."""
    half = cfg.head_size // 2
    freqs_H = np.float32(cfg.rope_theta) ** (-np.arange(half, dtype=np.float32) / np.float32(half))
    if cfg.rope_scaling == "none":
        return freqs_H
    wavelen_H = 2 * math.pi / freqs_H
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    scaled_H = np.where(wavelen_H > cfg.rope_original_max_len / low, freqs_H / cfg.rope_factor, freqs_H)
    smooth_H = (cfg.rope_original_max_len / wavelen_H - low) / (high - low)
    smoothed_H = (1 - smooth_H) * scaled_H / cfg.rope_factor + smooth_H * scaled_H
    medium_H = (wavelen_H >= cfg.rope_original_max_len / high) & (
        wavelen_H <= cfg.rope_original_max_len / low
    )
    return np.where(medium_H, smoothed_H, scaled_H).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _table(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    angles_SH = np.arange(cfg.max_seq_len, dtype=np.float32)[:, None] * rope_frequencies(cfg)
    return np.cos(angles_SH), np.sin(angles_SH)


def rotation(positions_BT: jax.Array, cfg: ModelConfig) -> Rotation:
    """cos and sin of the angles at `positions_BT` (< max_seq_len), read off a table that is a constant of
    the program: XLA:CPU fuses the transcendentals into every elementwise pass that reads them, forward and
    backward, and evaluates them again for each head. A table past `TABLE_ENTRIES` is computed instead."""
    if cfg.max_seq_len * (cfg.head_size // 2) <= TABLE_ENTRIES:
        cos_SH, sin_SH = _table(cfg)
        return jnp.asarray(cos_SH)[positions_BT][:, :, None], jnp.asarray(sin_SH)[positions_BT][:, :, None]
    angles_BT1H = (positions_BT.astype(jnp.float32)[:, :, None] * rope_frequencies(cfg))[:, :, None, :]
    return jnp.cos(angles_BT1H), jnp.sin(angles_BT1H)


def rope(x_BTNH: jax.Array, rot: Rotation) -> jax.Array:
    """Rotary position embedding (the "rotate half" layout of GPT-NeoX and Llama): the two halves of each head
    are rotated by position-dependent angles (`rotation`), so q·k depends on the positions' difference only."""
    half = x_BTNH.shape[-1] // 2
    cos, sin = rot
    x1, x2 = x_BTNH[..., :half].astype(jnp.float32), x_BTNH[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)
