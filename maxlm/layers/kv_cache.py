"""Attention over a key/value cache, for generation (prefill, then one token at a time).

A cache holds, per layer, keys and values `[B, S, KV, Dh]` in slots, and once for all layers the
position each slot holds (`[B, S]`, -1 = empty). The token at position p lives in slot p % S, so a
cache of S = sliding-window slots is a rolling buffer (Mistral) and a cache of S >= every position
never wraps. A chunk of new tokens `[B, T]` (the prompt, or one token) attends over the cache and
over itself: position-based masks make this exact for causal and sliding-window attention alike,
even when the prompt is longer than the window. The chunk's valid tokens must be a prefix of the
chunk with consecutive positions (right padding), which is what generation feeds.

Pure JAX with no parameters: the same for both layer backends (TE's fused attention takes no cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunk_slots(positions: jax.Array, valid: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
  """For every cache slot, the chunk index of the newest valid token landing there, and whether one does.

  positions [B, T] (consecutive within each row), valid [B, T] (a prefix of each row) ->
  (index [B, S] int32 into the chunk, has [B, S] bool).
  """
  t = positions.shape[1]
  n = jnp.sum(valid, axis=1, dtype=jnp.int32)  # [B] valid tokens per row
  first = positions[:, 0]  # [B]
  last = first + n - 1  # [B] newest position written
  s = jnp.arange(slots, dtype=jnp.int32)[None, :]  # [1, S]
  newest = last[:, None] - jnp.mod(last[:, None] - s, slots)  # [B, S] newest position p <= last, p % S == s
  has = (n[:, None] > 0) & (newest >= first[:, None])  # [B, S]
  index = jnp.clip(newest - first[:, None], 0, t - 1)  # [B, S]
  return index, has


def update_positions(cache_pos: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
  """The cache's slot positions [B, S] after writing the chunk's valid tokens."""
  index, has = chunk_slots(positions, valid, cache_pos.shape[1])
  return jnp.where(has, jnp.take_along_axis(positions, index, axis=1), cache_pos)  # [B, S]


def _write(cache: jax.Array, new: jax.Array, index: jax.Array, has: jax.Array) -> jax.Array:
  """cache [B, S, KV, Dh] with the chunk's `new` [B, T, KV, Dh] written into its slots."""
  picked = jnp.take_along_axis(new, index[:, :, None, None], axis=1)  # [B, S, KV, Dh]
  return jnp.where(has[:, :, None, None], picked.astype(cache.dtype), cache)


def attention_with_cache(q, k, v, cache_k, cache_v, cache_pos, positions, valid, window: int = 0):
  """Causal GQA attention of a chunk over the cache and itself; returns (ctx, new cache_k, new cache_v).

  q [B, T, H, Dh]; k, v [B, T, KV, Dh]; cache_k, cache_v [B, S, KV, Dh]; cache_pos [B, S] (before this
  chunk); positions, valid [B, T]. A key is attended when it holds a position <= the query's, within
  `window` of it (0 = unlimited). ctx is [B, T, H, Dh]; pad queries get finite, unused values.
  """
  b, t = positions.shape
  if t == 1:
    # One token: write it first, then attend over the cache alone. The slot it takes held position
    # p - S, outside the window (S = window) or never used (S > every position), so no key is lost;
    # the scatter touches one slot per row instead of rewriting the cache.
    rows, slot = jnp.arange(b), jnp.mod(positions[:, 0], cache_k.shape[1])  # [B], [B]
    ok = valid[:, 0, None, None]  # [B, 1, 1]
    cache_k = cache_k.at[rows, slot].set(jnp.where(ok, k[:, 0].astype(cache_k.dtype), cache_k[rows, slot]))
    cache_v = cache_v.at[rows, slot].set(jnp.where(ok, v[:, 0].astype(cache_v.dtype), cache_v[rows, slot]))
    keys, values = cache_k.astype(k.dtype), cache_v.astype(v.dtype)  # [B, S, KV, Dh]
    key_pos = update_positions(cache_pos, positions, valid)  # [B, S]
  else:
    keys = jnp.concatenate([cache_k.astype(k.dtype), k], axis=1)  # [B, S+T, KV, Dh]
    values = jnp.concatenate([cache_v.astype(v.dtype), v], axis=1)  # [B, S+T, KV, Dh]
    key_pos = jnp.concatenate([cache_pos, jnp.where(valid, positions, -1)], axis=1)  # [B, S+T]
    index, has = chunk_slots(positions, valid, cache_k.shape[1])
    cache_k, cache_v = _write(cache_k, k, index, has), _write(cache_v, v, index, has)
  qp, kp = positions[:, :, None], key_pos[:, None, :]  # [B, T, 1], [B, 1, K]
  keep = (kp >= 0) & (kp <= qp)  # [B, T, K]
  if window:
    keep &= qp - kp < window
  ctx = jax.nn.dot_product_attention(q, keys, values, mask=keep[:, None])  # [B, T, H, Dh]
  return ctx, cache_k, cache_v
