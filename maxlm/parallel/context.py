"""Context parallelism: the layout of a sequence split over the context axis, and the exchanges of keys and
values over it (the kernels that use them: maxlm/layers/cp_attention.py).

The logical rules (maxlm/parallel/sharding.py) may map `activation_length` to a mesh axis; when that axis has cp > 1
devices, each device holds T / cp positions of every activation, and attention, the one layer that mixes
positions, exchanges keys and values over that axis (maxlm/layers/cp_attention.py, inside `shard_map`). The model knows none
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
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.parallel.sharding import rule_axes, split_axis

RING_FROM = 32768  # tokens per device from which `auto` passes K/V around a ring instead of gathering them
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
  return split_axis("activation_length")


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


def batch_axes(batch: int) -> tuple[str, ...]:
  """The mesh axes that split the batch (`activation_batch`) under the current mesh and rules, those of more
  than one device, when together they divide `batch`; else ()."""
  names, mesh = rule_axes("activation_batch"), jax.sharding.get_abstract_mesh()
  names = tuple(a for a in names or () if a in mesh.axis_names and mesh.shape[a] > 1)
  return names if batch % math.prod(mesh.shape[a] for a in names) == 0 else ()


def sharded(fn, name: str, q, k, v, segment_ids, positions):
  """fn(q, k, v, segment ids, positions) on each device's share of the length (split over mesh axis `name`) and
  of the batch (its axes manual too where they divide it: `batch_axes`) -> [B, T, H, Dh], split the same way.
  Heads stay sharded as the rules put them. With the batch axes left automatic, XLA partitioned the exchange with
  the batch replicated over them: each device gathered (and reduce-scattered) every row of the batch, fsdp x the
  bytes of its own rows."""
  rows = batch_axes(q.shape[0]) or None
  seq4, seq2 = jax.sharding.PartitionSpec(rows, name, None, None), jax.sharding.PartitionSpec(rows, name)
  return jax.shard_map(fn, in_specs=(seq4, seq4, seq4, seq2, seq2), out_specs=seq4,
                       axis_names={name, *(rows or ())}, check_vma=False)(q, k, v, segment_ids, positions)
