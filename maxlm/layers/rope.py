"""Rotary position embeddings (RoPE) with optional Llama-3.1 frequency scaling.

Shared by both layer backends (TE's own RoPE has no Llama-3.1 scaling and ignores packed
positions). Positions come from the batch, so they restart at 0 for every packed document.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_max_position: int = 8192) -> np.ndarray:
  """Inverse frequencies [head_dim // 2] (float64 numpy, computed once at trace time)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [Dh/2]
  if scaling == "none":
    return inv_freq
  if scaling != "llama3":
    raise ValueError(f"unknown rope scaling {scaling!r}")
  low_wavelen = original_max_position / low_freq_factor
  high_wavelen = original_max_position / high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
  """Rotate x [B, T, N, Dh] by positions [B, T]; halves layout (Llama/HF convention)."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [B, T, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, Dh/2]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # 2 x [B, T, N, Dh/2]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [B, T, N, Dh]
  return out.astype(x.dtype)
