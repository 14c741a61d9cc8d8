"""Expert parallelism: the experts of a mixture-of-experts layer split over a mesh axis, tokens exchanged to them.

The tokens are split over the batch axes, the expert axis among them (expert parallelism inside data
parallelism, as Megatron, DeepSpeed-MoE and MaxText arrange it); the E experts' weights over the expert axis,
L = E / ep on each device. Each device routes its own tokens, then (inside `shard_map`, manual over the batch
axes, so every array below is one device's):

1. dispatch: its N x k (token, slot) assignments sorted by expert, stably; the rows bound for device d are then
   contiguous, and go to d in one all-to-all, with the counts per (destination, local expert) in another;
2. each device sorts what it received by its local expert (stably: by source, then by the source's order) and
   applies its L experts to their groups (`expert_fn`, the layer's grouped GEMMs);
3. combine: the outputs go back by the inverse permutations and the reverse all-to-all, and each token sums its
   k outputs, weighted.

Dropless: a device may send every assignment it has to one destination, so each (source, destination) slot of
the exchange holds N k rows (`padded`: XLA's all-to-all moves fixed shapes; ep x the rows a ragged exchange
would move, which is what runs on CPU and in the tests). No assignment is ever dropped, whatever the balance.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from maxlm.parallel import context
from maxlm.parallel.sharding import split_axis


def axis() -> tuple[str, int] | None:
  """(mesh axis, size) that splits the experts (the logical axis `expert`) under the current mesh and rules, when
  it has more than one device; else None."""
  return split_axis("expert")


@dataclasses.dataclass(frozen=True)
class Routed:
  """One device's dispatch, what combine needs to undo it: `order` [N k] the assignments sorted by expert, `dest`
  and `slot` [N k] where each sorted assignment sits in the send buffer [ep, N k, D], `back` [ep N k] the
  permutation that sorted the received rows by local expert."""
  order: jax.Array
  dest: jax.Array
  slot: jax.Array
  back: jax.Array


def dispatch(x, experts, n_experts: int, name: str, ep: int):
  """x [N, D] and experts [N, k] int32 (global expert ids) on one device of the shard_map over `name` (ep
  devices) -> (rows [ep N k, D] sorted by local expert, the rows past sum(group_sizes) padding; group_sizes [L];
  Routed)."""
  n, k = experts.shape
  local = n_experts // ep
  flat = experts.reshape(-1)  # [N k]
  order = jnp.argsort(flat, stable=True)  # [N k]
  sorted_e = flat[order]
  dest = sorted_e // local  # [N k]: the device holding the expert
  counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32).reshape(ep, local)  # [ep (dest), L]
  starts = jnp.cumsum(jnp.sum(counts, axis=1)) - jnp.sum(counts, axis=1)  # [ep]: first sorted row per dest
  slot = jnp.arange(n * k) - starts[dest]  # [N k]: its row in the slot of its destination
  send = jnp.zeros((ep, n * k, x.shape[-1]), x.dtype).at[dest, slot].set(x[order // k])  # [ep, N k, D]
  recv = jax.lax.all_to_all(send, name, 0, 0, tiled=True)  # [ep (source), N k, D]
  got = jax.lax.all_to_all(counts, name, 0, 0, tiled=True)  # [ep (source), L]: what each source sent to me
  # each received row's local expert (rows past the source's total are padding: group L)
  ends = jnp.cumsum(got, axis=1)  # [ep, L]
  row = jnp.arange(n * k)
  expert_of = jnp.sum(row[None, :, None] >= ends[:, None, :], axis=-1)  # [ep, N k] in 0..L
  back = jnp.argsort(expert_of.reshape(-1), stable=True)  # [ep N k]
  rows = recv.reshape(ep * n * k, -1)[back]  # [ep N k, D] grouped by local expert, padding last
  return rows, jnp.sum(got, axis=0).astype(jnp.int32), Routed(order, dest, slot, back)


def combine(ys, weights, routed: Routed, name: str, ep: int):
  """ys [ep N k, D]: the experts' outputs of `dispatch`'s rows, in its order; weights [N, k] -> [N, D] in float32
  at least: each token's k outputs weighted and summed."""
  n, k = weights.shape
  recv = jnp.zeros_like(ys).at[routed.back].set(ys).reshape(ep, n * k, -1)  # [ep (source), N k, D]
  sent = jax.lax.all_to_all(recv, name, 0, 0, tiled=True)  # [ep (dest), N k, D]: the outputs of what I sent
  y = jnp.zeros((n * k, ys.shape[-1]), ys.dtype).at[routed.order].set(sent[routed.dest, routed.slot])
  y = y.reshape(n, k, -1)  # [N, k, D]
  wide = jnp.promote_types(ys.dtype, jnp.float32)
  return jnp.einsum("nkd,nk->nd", y.astype(wide), weights.astype(wide))


def apply(expert_fn: Callable, x, weights, experts, params, *, n_experts: int, name: str, ep: int):
  """[N, D]: each token's k experts' outputs, weighted, with the experts split over mesh axis `name` (ep
  devices) and the tokens over the batch axes (`context.batch_axes`, the expert axis among them). params: the
  experts' weights, each [E, ...] (split over `name` on E); expert_fn(rows, params of the L local experts,
  group_sizes [L]) -> outputs of the rows, each by its group's expert (rows past the groups are padding, never
  read: any value).
  x, weights and experts are [N, ...] with N the batch's tokens, split as the batch is."""
  if n_experts % ep:
    raise ValueError(f"{n_experts} experts do not split over {ep} devices of the expert axis {name!r}")
  rows_axes = context.batch_axes(x.shape[0])
  if name not in rows_axes:
    raise ValueError(f"the tokens must be split over the expert axis {name!r} too (activation_batch)")
  tok = jax.sharding.PartitionSpec(rows_axes)
  per_expert = jax.sharding.PartitionSpec(name)

  def local(x, weights, experts, params):
    rows, sizes, routed = dispatch(x, experts, n_experts, name, ep)
    return combine(expert_fn(rows, params, sizes), weights, routed, name, ep).astype(x.dtype)

  pspecs = jax.tree_util.tree_map(lambda _: per_expert, params)
  return jax.shard_map(local, in_specs=(tok, tok, tok, pspecs), out_specs=tok, axis_names=set(rows_axes),
                       check_vma=False)(x, weights, experts, params)
