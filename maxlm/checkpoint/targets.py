"""Restore targets: the abstract state a checkpoint is read into (`abstract_like`), that target with the dtypes the
checkpoint was written in (`saved_dtypes`: another optim.mu_dtype / optim.nu_dtype), and the restored state cast
back to the run's dtypes and placement (`cast_like`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def saved_dtypes(arrays: dict[str, list], target):
  """`target` (ShapeDtypeStructs) with every leaf's dtype as the checkpoint's `meta` records it: e.g. the
  moments of a run with another optim.mu_dtype / optim.nu_dtype."""
  def one(path, x):
    return jax.ShapeDtypeStruct(x.shape, jnp.dtype(arrays[jax.tree_util.keystr(path)][1]), sharding=x.sharding)
  return jax.tree_util.tree_map_with_path(one, target)


def cast_like(state, target):
  """`state` with each array whose dtype differs from `target`'s cast to it (on the device, round to nearest
  even) and placed with the target's sharding (and memory kind: optim.offload); the rest as it is."""
  def one(x, t):
    if x.dtype == t.dtype:
      return x
    return jax.device_put(jax.device_put(x, t.sharding.with_memory_kind("device")).astype(t.dtype), t.sharding)
  return jax.tree_util.tree_map(one, state, target)


def abstract_like(state, shardings):
  """ShapeDtypeStructs (with shardings) of `state`: the restore target on this run's mesh."""
  return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                state, shardings)
