"""`optim.offload`: the optimizer state (`host`), or it and the float32 master parameters (`host_params`), in
pinned host memory between steps.

`place` gives the train state's shardings their memory kinds (the jitted step's in/out shardings and the
checkpoint restore target carry them). Inside a jitted function `to_device_memory` / `to_host_memory` move
values between the memories (JAX lowers the moves on GPU and TPU; on CPU every memory kind is the same
memory and they change only the abstract values' memory space), and `in_host_memory` tells where a traced
value lives. The optimizer (maxlm/optim.py) streams the state (and with host_params the parameters) through the
device one parameter at a time; with host_params the train step (maxlm/step.py) moves the parameters to the
device for the forward and backward passes, each leaf moved first and only then cast (`to_device_in_turn`): every
computation reads device-memory values, none a host-memory one.
"""

from __future__ import annotations

import re

import jax

HOST = "pinned_host"  # JAX's memory kind of page-locked host memory (DMA to and from the GPU)
OFFLOADS = ("none", "host", "host_params")  # optim.offload


def place(shardings, offload: str):
  """A TrainState of shardings with their memory kinds: offload="host" puts every optimizer-state leaf
  (moments and step counts) in pinned host memory, "host_params" also every parameter; "none" leaves every leaf
  in the default (device) memory."""
  if offload not in OFFLOADS:
    raise ValueError(f"unknown offload {offload!r}")
  if offload == "none":
    return shardings
  host = lambda tree: jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST), tree)  # noqa: E731
  out = shardings.replace(opt_state=host(shardings.opt_state))
  return out.replace(params=host(shardings.params)) if offload == "host_params" else out


def _space(x):
  return jax.typeof(x).memory_space


def in_host_memory(tree) -> bool:
  """Whether any leaf of `tree` (arrays or tracers) is in host memory."""
  return any(_space(x) == jax.memory.Space.Host for x in jax.tree_util.tree_leaves(tree))


def to_device_memory(tree):
  """`tree` with its host-memory leaves moved into device memory (same sharding); the others as they are."""
  return jax.tree_util.tree_map(
      lambda x: jax.device_put(x, jax.memory.Space.Device) if _space(x) == jax.memory.Space.Host else x, tree)


def to_host_memory(tree):
  """`tree` with its device-memory leaves moved into host memory (same sharding); the others as they are."""
  return jax.tree_util.tree_map(
      lambda x: jax.device_put(x, jax.memory.Space.Host) if _space(x) == jax.memory.Space.Device else x, tree)


def _natural(path) -> tuple:
  """A sort key of a leaf's path with its numbers compared as numbers (layers_2 before layers_10): the unrolled
  layers in the order the forward pass reads them."""
  return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", jax.tree_util.keystr(path)))


def to_device_in_turn(tree, fn, lag: int):
  """`fn(path, leaf)` of every leaf of `tree` moved into device memory first (optim.offload=host_params: e.g. a
  cast to the compute dtype), one leaf after another in the paths' natural order: leaf k is moved once
  `fn` of leaf k - lag is done, so at most `lag` leaves are on the device as they were in host memory (XLA would
  otherwise move them all before it casts any: the float32 parameters on the device at once)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  order = sorted(range(len(flat)), key=lambda i: _natural(flat[i][0]))
  out, done = [None] * len(flat), []
  for k, i in enumerate(order):
    path, x = flat[i]
    if k >= lag:
      x, _ = jax.lax.optimization_barrier((x, done[k - lag]))
    out[i] = fn(path, to_device_memory(x))
    done.append(out[i])
  return treedef.unflatten(out)
