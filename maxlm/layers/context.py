"""Context parallelism: the layout of a sequence split over the context axis, and pure-JAX attention over it.

The logical rules (maxlm/sharding.py) may map `activation_length` to a mesh axis; when that axis has cp > 1
devices, each device holds T / cp positions of every activation, and attention, the one layer that mixes
positions, exchanges keys and values over that axis (`attention`, inside `shard_map`). The model knows none
of it: the layers find the axis from the current mesh and rules (`axis`).

Causal load balancing. Split in cp contiguous blocks, the last device would attend to the whole sequence and
the first to one block. So every [B, T] input of a train or eval step is reordered first (maxlm/step.py,
`reorder`), and each device holds work from both ends of the sequence:
* `dual_chunk` (unpacked rows, full causal attention): T in 2 x cp chunks, device r holds chunks r and
  2cp-1-r (Megatron's and MaxText's order; TE's `DualChunkSwap`);
* `striped` (packed rows or a sliding window, TE's THD layout): stripes of s tokens dealt round robin,
  device r holds stripes r, r + cp, r + 2cp, ... (TE's `Striped`; s = 1 for the ring, up to 128 for the
  all-gather, where TE's per-device segment count grows with T / s).
Segment ids and positions travel with their tokens, so RoPE and the document masks see what they saw
unsplit. The step's losses and token counts are sums over tokens, so they need no restoring; `restore`
inverts the order for per-token outputs.

The attention here builds its mask from segment ids and positions (same document, key position <= query
position, within the window): it equals the unsplit index-based mask because positions count up by one within
each document (maxlm/data/packing.py; TE's THD masks rely on the same). Which work it skips follows from the
layout: each device's share is cut into tiles (`tile_count`), and only the (query tile, key tile) pairs whose
original row indices the causal mask (and window) may leave visible are computed (`gather_schedule`,
`ring_schedule`), in float32 with one softmax stabilizer per query row; so the tokens must be in the layout's
order. A dual-chunk device's diagonal chunks cost about half, the rest of a causal row's masked half nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

RING_FROM = 32768  # tokens per device from which `auto` passes K/V around a ring instead of gathering them
NEG = -1e30  # a masked score: exp(NEG - any kept score) is 0, with no inf arithmetic
MAX_STRIPE = 128  # TE's recommended stripe for the all-gather over striped (THD) rows
TILES = 32  # tiles per device's share of a row, where it divides: masked work is skipped tile by tile
MIN_TILE = 16  # the fewest tokens per tile wanted, where the share allows


@dataclasses.dataclass(frozen=True)
class Layout:
  """The order of a sequence split over cp devices: `dual_chunk`, or `striped` in stripes of `stripe`."""
  kind: str
  cp: int
  stripe: int = 1


def axis() -> tuple[str, int] | None:
  """(mesh axis, size) that splits the activations' length under the current mesh and logical rules, when
  it has more than one device; else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  try:
    spec = nn.logical_to_mesh_axes(("activation_length",))
  except ValueError:  # no rules installed
    return None
  name = spec[0] if len(spec) else None
  if isinstance(name, tuple):
    if len(name) != 1:
      return None
    name = name[0]
  if name is None or name not in mesh.axis_names or mesh.shape[name] == 1:
    return None
  return name, mesh.shape[name]


def resolve_strategy(strategy: str, cp: int, seq_len: int, packed: bool) -> str:
  """`mesh.context_strategy` made concrete. auto: the ring for packed rows or a sliding window (`packed`: TE
  runs those in its THD layout, where the ring keeps its segment bookkeeping per block) and from RING_FROM
  tokens per device (the gathered K/V grows with the whole sequence, a ring holds two blocks, and blocks
  that long hide the pass of the next); the all-gather otherwise."""
  if strategy != "auto":
    return strategy
  return "ring" if packed or seq_len // max(cp, 1) >= RING_FROM else "all_gather"


def layout(strategy: str, cp: int, seq_len: int, packed: bool) -> Layout:
  """The load-balanced order for a resolved strategy (see the module's docstring)."""
  if not packed:
    return Layout("dual_chunk", cp)
  # the all-gather's stripe: at most MAX_STRIPE, and at least two stripes per device (else no balance)
  return Layout("striped", cp, 1 if strategy == "ring" else math.gcd(MAX_STRIPE, seq_len // (2 * cp)))


def current_layout(strategy: str, seq_len: int, packed: bool) -> Layout | None:
  """The layout under the current mesh and rules for `mesh.context_strategy`, rows of seq_len tokens,
  `packed` rows (segment ids given, or a sliding window: as the attention layers see them); None where no
  axis splits the length."""
  cp = axis()
  if cp is None:
    return None
  if seq_len % (2 * cp[1]):
    raise ValueError(f"sequences of {seq_len} tokens do not split into 2 x {cp[1]} chunks over the context "
                     f"axis {cp[0]!r}")
  return layout(resolve_strategy(strategy, cp[1], seq_len, packed), cp[1], seq_len, packed)


def apply_balanced(fn, tokens, positions, segment_ids, *, strategy: str, window: int):
  """fn(tokens, positions, segment_ids) -> per-token outputs [B, T, ...], run on the load-balanced order
  where the current mesh splits the length (its outputs restored to the given order), else as it is."""
  b, t = tokens.shape
  lay = current_layout(strategy, t, segment_ids is not None or bool(window))
  if lay is None:
    return fn(tokens, positions, segment_ids)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
  args = [None if a is None else reorder(a, lay) for a in (tokens, positions, segment_ids)]
  return restore(fn(*args), lay)


def order(length: int, lay: Layout) -> np.ndarray:
  """[T] the original position of each position of the reordered sequence."""
  idx = np.arange(length)
  if lay.kind == "dual_chunk":
    chunks = idx.reshape(2 * lay.cp, -1)  # [2cp, T / 2cp]
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * lay.cp - 1 - r]]) for r in range(lay.cp)])
  stripes = idx.reshape(-1, lay.cp, lay.stripe)  # [T / (cp s), cp, s]: stripe j * cp + r is device r's
  return stripes.transpose(1, 0, 2).reshape(-1)


def reorder(x: jax.Array, lay: Layout, dim: int = 1) -> jax.Array:
  """x with its sequence dimension `dim` in the load-balanced order."""
  return jnp.take(x, jnp.asarray(order(x.shape[dim], lay)), axis=dim)


def restore(x: jax.Array, lay: Layout, dim: int = 1) -> jax.Array:
  """The inverse of `reorder`."""
  return jnp.take(x, jnp.asarray(np.argsort(order(x.shape[dim], lay))), axis=dim)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_kv(x, name: str, dtype=jnp.float32):
  """all_gather of x [B, T / cp, ...] over `name` along the length (in x's dtype), returned as `dtype`. Its
  transpose reduce-scatters the cotangent in float32 and rounds the sum once: XLA:CPU aborts on a bfloat16
  reduce-scatter or all-reduce (`Invalid binary instruction opcode copy`, a check failure), and summed in
  float32 the cp devices' partial gradients of a key lose nothing to intermediate roundings. The exchange of
  the all-gather strategy, shared with the planner's stand-in (maxlm/plan/standins.py)."""
  return jax.lax.all_gather(x, name, axis=1, tiled=True).astype(dtype)


def _gather_kv_fwd(x, name, dtype):
  return gather_kv(x, name, dtype), jnp.zeros((), x.dtype)


def _gather_kv_bwd(name, dtype, like, ct):
  del dtype
  ct = ct.astype(jnp.float32)
  return (jax.lax.psum_scatter(ct, name, scatter_dimension=1, tiled=True).astype(like.dtype),)


gather_kv.defvjp(_gather_kv_fwd, _gather_kv_bwd)


def gather_exchange(k, v, seg, pos, name: str, dtype=jnp.float32):
  """The all-gather strategy's exchange: K and V [B, T / cp, KV, Dh] gathered along the length over `name`
  (as `dtype`; `gather_kv`), and the segment ids and positions [B, T / cp] with them -> the four, [B, T, ...]."""
  kg, vg = (gather_kv(a, name, dtype) for a in (k, v))  # [B, T, KV, Dh]
  sg, pg = (jax.lax.all_gather(a, name, axis=1, tiled=True) for a in (seg, pos))  # [B, T]
  return kg, vg, sg, pg


def ring_exchange(step, acc, blocks, name: str, cp: int):
  """The ring strategy's exchange: acc = step(acc, s, *blocks) for s = 0 .. cp - 1, the blocks (K, V, segment
  ids, positions) passed on to the next device over `name` after every step but the last (cp - 1 passes, in
  their own dtypes; the backward passes the cotangents of K and V back)."""
  ring = [(i, (i + 1) % cp) for i in range(cp)]
  for s in range(cp):
    acc = step(acc, s, *blocks)
    if s + 1 < cp:
      blocks = tuple(jax.lax.ppermute(a, name, ring) for a in blocks)
  return acc


def sharded(fn, name: str, q, k, v, segment_ids, positions):
  """fn(q, k, v, segment ids, positions) on each device's share of the length (split over mesh axis `name`,
  the only manual axis: batch and heads stay sharded as the rules put them) -> [B, T, H, Dh], split the same
  way."""
  seq4, seq2 = jax.sharding.PartitionSpec(None, name, None, None), jax.sharding.PartitionSpec(None, name)
  return jax.shard_map(fn, in_specs=(seq4, seq4, seq4, seq2, seq2), out_specs=seq4, axis_names={name},
                       check_vma=False)(q, k, v, segment_ids, positions)


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
