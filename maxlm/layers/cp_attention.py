"""Attention over a sequence split on the context axis: the tiles each device computes, the two strategies
(all-gather, ring) over the exchanges of maxlm/parallel/context.py.

The attention here builds its mask from segment ids and positions (same document, key position <= query
position, within the window): it equals the unsplit index-based mask because positions count up by one within
each document (maxlm/data/packing.py; TE's THD masks rely on the same). Which work it skips follows from the
layout: each device's share is cut into tiles (`tile_count`), and only the (query tile, key tile) pairs whose
original row indices the causal mask (and window) may leave visible are computed (`gather_schedule`,
`ring_schedule`), in float32 with one softmax stabilizer per query row; so the tokens must be in the layout's
order. A dual-chunk device's diagonal chunks cost about half, the rest of a causal row's masked half nothing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.parallel.context import Layout, gather_exchange, layout, order, ring_exchange, sharded

NEG = -1e30  # a masked score: exp(NEG - any kept score) is 0, with no inf arithmetic
TILES = 32  # tiles per device's share of a row, where it divides: masked work is skipped tile by tile
MIN_TILE = 16  # the fewest tokens per tile wanted, where the share allows


def keep_mask(seg_q, pos_q, seg_k, pos_k, window: int):
  """Boolean keep-mask [B, 1, Tq, Tk]: same document (segment > 0), key not after the query, within the
  window; from segment ids and positions [B, T], so it holds in any token order."""
  keep = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] > 0)  # [B, Tq, Tk]
  keep &= pos_k[:, None, :] <= pos_q[:, :, None]
  if window:
    keep &= pos_q[:, :, None] - pos_k[:, None, :] < window
  return keep[:, None]  # [B, 1, Tq, Tk]


def tile_count(lay: Layout, seq_len: int) -> int:
  """Tiles per device's T / cp positions, the granularity at which masked work is skipped: up to TILES, of at
  least MIN_TILE tokens where the share allows (a tile costs a few elementwise ops per query beyond its
  matmuls), and never across the two chunks of the dual-chunk order (so each tile's positions count up)."""
  loc = seq_len // lay.cp
  n = math.gcd(loc, TILES)
  while n > 2 and loc // n < MIN_TILE:
    n //= 2
  return n


def _bounds(lay: Layout, seq_len: int, n: int):
  """[cp, n] first and last original position of each device's tiles (positions count up within a tile)."""
  orig = order(seq_len, lay).reshape(lay.cp, n, -1)  # [cp, n, tile]
  return orig[..., 0], orig[..., -1]


def _visible(lo, hi, r: int, j: int, window: int) -> np.ndarray:
  """[n, n] whether device r's query tile a may see some key of device j's tile b: the first key not after the
  last query and, with a window, the last key within the window of the first query (a superset of the mask)."""
  vis = lo[j][None, :] <= hi[r][:, None]
  if window:
    vis &= hi[j][None, :] > lo[r][:, None] - window
  return vis


def _table(pairs: list[list[tuple[int, int]]]):
  """Per device r its (query tile, key tile) pairs, padded to the longest list with masked (0, 0) pairs ->
  int32 [cp, P, 2] and bool [cp, P]."""
  width = max(len(p) for p in pairs)
  idx = np.zeros((len(pairs), width, 2), np.int32)
  valid = np.zeros((len(pairs), width), bool)
  for r, p in enumerate(pairs):
    idx[r, :len(p)] = p
    valid[r, :len(p)] = True
  return idx, valid


def gather_schedule(lay: Layout, seq_len: int, window: int):
  """The all-gather's pairs: device r's query tile a against tile j * n + b of the gathered K/V, for every
  (j, b) the causal (and window) mask may leave visible."""
  n = tile_count(lay, seq_len)
  lo, hi = _bounds(lay, seq_len, n)
  return _table([[(a, j * n + b) for j in range(lay.cp) for a, b in zip(*np.nonzero(_visible(lo, hi, r, j, window)))]
                 for r in range(lay.cp)])


def ring_schedule(lay: Layout, seq_len: int, window: int):
  """The ring's pairs, one table per step s (device r then holds device (r - s) mod cp's K/V block)."""
  n = tile_count(lay, seq_len)
  lo, hi = _bounds(lay, seq_len, n)
  return [_table([list(zip(*np.nonzero(_visible(lo, hi, r, (r - s) % lay.cp, window)))) for r in range(lay.cp)])
          for s in range(lay.cp)]


def _tiles(x, n: int):
  """[B, n * tile, ...] -> [n, B, tile, ...]."""
  return jnp.moveaxis(x.reshape(x.shape[0], n, -1, *x.shape[2:]), 1, 0)


def _tile_pairs(qt, kt, vt, sq, pq, sk, pk, idx, valid, window: int):
  """Softmax partials of the given (query tile, key tile) pairs, merged per query tile.

  qt [n, B, tq, KV, G, Dh] (scaled), kt/vt [nk, B, tk, KV, Dh], float32; sq/pq [n, B, tq], sk/pk [nk, B, tk]
  segment ids and positions; idx [P, 2] (dynamic) and valid [P]. Returns, per query tile, the unnormalized
  output [n, B, KV, G, tq, Dh], the stabilizing max and the denominator [n, B, KV, G, tq]."""
  a, b = idx[:, 0], idx[:, 1]  # [P]
  n, tq, tk = qt.shape[0], qt.shape[2], kt.shape[2]
  keep = keep_mask(sq[a].reshape(-1, tq), pq[a].reshape(-1, tq), sk[b].reshape(-1, tk), pk[b].reshape(-1, tk),
                   window).reshape(-1, qt.shape[1], 1, 1, tq, tk) & valid[:, None, None, None, None, None]
  s = jnp.where(keep, jnp.einsum("pbqkgd,pbskd->pbkgqs", qt[a], kt[b]), NEG)  # [P, B, KV, G, tq, tk]
  # one stabilizer per query row over all its pairs, so the pairs' sums add with no rescaling
  top = jax.lax.stop_gradient(jnp.maximum(jax.ops.segment_max(jnp.max(s, axis=-1), a, n), NEG))  # [n, B, KV, G, tq]
  p = jnp.where(keep, jnp.exp(s - top[a][..., None]), 0.0)  # [P, B, KV, G, tq, tk]
  o = jnp.einsum("pbkgqs,pbskd->pbkgqd", p, vt[b])  # [P, B, KV, G, tq, Dh]
  return jax.ops.segment_sum(o, a, n), top, jax.ops.segment_sum(jnp.sum(p, axis=-1), a, n)


def _merge(x, y):
  """Two softmax partials (output, max, denominator) of the same queries over disjoint keys, as one."""
  m = jnp.maximum(x[1], y[1])
  wx, wy = jnp.exp(x[1] - m), jnp.exp(y[1] - m)
  return x[0] * wx[..., None] + y[0] * wy[..., None], m, x[2] * wx + y[2] * wy


def _finish(acc, shape, dtype):
  """Normalized output [B, T, H, Dh] from merged partials [n, B, KV, G, tq, Dh]."""
  out = acc[0] / jnp.where(acc[2] > 0, acc[2], 1.0)[..., None]  # rows that kept no key (padding) stay 0
  return jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(shape).astype(dtype)  # [B, n, tq, KV, G, Dh] -> [B, T, H, Dh]


def _gathered(q, k, v, seg, pos, *, name: str, lay: Layout, seq_len: int, window: int):
  """One device's query tiles against the visible tiles of the gathered K/V (with segment ids and positions)."""
  b, t, h, dh = q.shape
  kv, n = k.shape[2], tile_count(lay, seq_len)
  qt = _tiles(q.reshape(b, t, kv, h // kv, dh).astype(jnp.float32) / math.sqrt(dh), n)
  kg, vg, sg, pg = gather_exchange(k, v, seg, pos, name)  # [B, T_all, KV, Dh] float32, [B, T_all]
  idx, valid = gather_schedule(lay, seq_len, window)
  r = jax.lax.axis_index(name)
  acc = _tile_pairs(qt, *(_tiles(a, n * lay.cp) for a in (kg, vg)), _tiles(seg, n), _tiles(pos, n),
                    *(_tiles(a, n * lay.cp) for a in (sg, pg)), jnp.asarray(idx)[r], jnp.asarray(valid)[r], window)
  return _finish(acc, q.shape, q.dtype)


def _ring(q, k, v, seg, pos, *, name: str, lay: Layout, seq_len: int, window: int):
  """One device's query tiles against the visible tiles of each K/V block in turn, each block passed on to the
  next device after use (cp - 1 passes), the softmax merged online in float32 (the running max a stabilizer
  only, so no gradient flows through it)."""
  b, t, h, dh = q.shape
  kv, n, cp = k.shape[2], tile_count(lay, seq_len), lay.cp
  qt = _tiles(q.reshape(b, t, kv, h // kv, dh).astype(jnp.float32) / math.sqrt(dh), n)
  sq, pq = _tiles(seg, n), _tiles(pos, n)
  tq = t // n
  acc = (jnp.zeros((n, b, kv, h // kv, tq, dh), jnp.float32), jnp.full((n, b, kv, h // kv, tq), NEG, jnp.float32),
         jnp.zeros((n, b, kv, h // kv, tq), jnp.float32))
  r = jax.lax.axis_index(name)
  schedule = ring_schedule(lay, seq_len, window)

  def step(acc, s, k, v, seg_k, pos_k):
    idx, valid = schedule[s]
    kt, vt = (_tiles(a.astype(jnp.float32), n) for a in (k, v))  # passed on in their own dtype
    part = _tile_pairs(qt, kt, vt, sq, pq, _tiles(seg_k, n), _tiles(pos_k, n), jnp.asarray(idx)[r],
                       jnp.asarray(valid)[r], window)
    return _merge(acc, part)

  acc = ring_exchange(step, acc, (k, v, seg, pos), name, cp)
  return _finish(acc, q.shape, q.dtype)


def attention(q, k, v, segment_ids, positions, *, window: int, strategy: str, name: str, cp: int):
  """Causal GQA attention with the length of q [B, T, H, Dh], k/v [B, T, KV, Dh], segment ids and positions
  [B, T] split over mesh axis `name` (cp devices), the tokens in `layout`'s order for the strategy (as
  `apply_balanced` gives them) -> [B, T, H, Dh], split the same way. Only the tiles of (query, key) pairs that
  the causal mask (and window) may leave visible are computed: which those are follows from the layout;
  within them the mask comes from segment ids and positions. Only `name` is manual in the shard_map: batch
  and heads stay sharded as the rules put them."""
  b, t = q.shape[:2]
  lay = layout(strategy, cp, t, segment_ids is not None or bool(window))
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)  # [B, T]
  if positions is None:
    raise ValueError("context-parallel attention needs the positions of the (reordered) tokens")
  fn = functools.partial(_ring if strategy == "ring" else _gathered, name=name, lay=lay, seq_len=t, window=window)
  return sharded(fn, name, q, k, v, segment_ids, positions)
