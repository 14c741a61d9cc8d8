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
position, within the window), which holds in any order: it equals the unsplit index-based mask because
positions count up by one within each document (maxlm/data/packing.py; TE's THD masks rely on the same).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

STRATEGIES = ("all_gather", "ring")
RING_FROM = 32768  # tokens per device from which `auto` passes K/V around a ring instead of gathering them
NEG = -1e30  # a masked score: exp(NEG - any kept score) is 0, with no inf arithmetic
MAX_STRIPE = 128  # TE's recommended stripe for the all-gather over striped (THD) rows


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


def _gathered(q, k, v, seg, pos, *, name: str, window: int):
  """One device's queries against every key: K/V, segment ids and positions gathered over the axis."""
  kg, vg, sg, pg = (jax.lax.all_gather(a, name, axis=1, tiled=True) for a in (k, v, seg, pos))  # [B, T, ...]
  return jax.nn.dot_product_attention(q, kg, vg, mask=keep_mask(seg, pos, sg, pg, window))  # [B, Tq, H, Dh]


def _ring(q, k, v, seg, pos, *, name: str, cp: int, window: int):
  """One device's queries against every key block in turn, each block passed on to the next device after
  use (cp - 1 passes), the softmax accumulated online in fp32: a running max (a stabilizer only, so no
  gradient flows through it), denominator and output."""
  b, t, h, dh = q.shape
  kv, g = k.shape[2], h // k.shape[2]
  qg = q.reshape(b, t, kv, g, dh).astype(jnp.float32) / math.sqrt(dh)  # [B, Tq, KV, G, Dh]
  m = jnp.full((b, kv, g, t), NEG, jnp.float32)  # [B, KV, G, Tq] running max
  den = jnp.zeros_like(m)  # [B, KV, G, Tq] running denominator
  out = jnp.zeros((b, kv, g, t, dh), jnp.float32)  # [B, KV, G, Tq, Dh]
  ring = [(i, (i + 1) % cp) for i in range(cp)]
  seg_k, pos_k = seg, pos
  for step in range(cp):
    keep = keep_mask(seg, pos, seg_k, pos_k, window)[:, :, None]  # [B, 1, 1, Tq, Tk]
    s = jnp.where(keep, jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32)), NEG)  # [B, KV, G, Tq, Tk]
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))  # [B, KV, G, Tq]
    p = jnp.where(keep, jnp.exp(s - m_new[..., None]), 0.0)  # [B, KV, G, Tq, Tk]
    scale = jnp.exp(m - m_new)  # [B, KV, G, Tq]; 0 once a kept key outranks the NEG start
    den = den * scale + jnp.sum(p, axis=-1)
    out = out * scale[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)  # [B, KV, G, Tq, Dh]
    m = m_new
    if step + 1 < cp:
      k, v, seg_k, pos_k = (jax.lax.ppermute(a, name, ring) for a in (k, v, seg_k, pos_k))
  out = out / jnp.where(den > 0, den, 1.0)[..., None]  # rows that kept no key (padding) stay 0
  return jnp.moveaxis(out, 3, 1).reshape(b, t, h, dh).astype(q.dtype)  # [B, Tq, H, Dh]


def attention(q, k, v, segment_ids, positions, *, window: int, strategy: str, name: str, cp: int):
  """Causal GQA attention with the length of q [B, T, H, Dh], k/v [B, T, KV, Dh], segment ids and positions
  [B, T] split over mesh axis `name` (cp devices), in any token order -> [B, T, H, Dh], split the same way.
  Only `name` is manual in the shard_map: batch and heads stay sharded as the rules put them."""
  b, t = q.shape[:2]
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)  # [B, T]
  if positions is None:
    raise ValueError("context-parallel attention needs the positions of the (reordered) tokens")
  if strategy == "ring":
    fn = lambda *a: _ring(*a, name=name, cp=cp, window=window)  # noqa: E731
  else:
    fn = lambda *a: _gathered(*a, name=name, window=window)  # noqa: E731
  seq4, seq2 = jax.sharding.PartitionSpec(None, name, None, None), jax.sharding.PartitionSpec(None, name)
  return jax.shard_map(fn, in_specs=(seq4, seq4, seq4, seq2, seq2), out_specs=seq4, axis_names={name},
                       check_vma=False)(q, k, v, segment_ids, positions)
