"""Logical-axis rules (one table) and the helpers that turn them into shardings on a mesh.

Model code names axes logically ("embed", "heads", "activation_batch", ...); this table alone
decides which mesh axis shards them. A dimension that does not divide evenly by its mesh axes
is replicated instead (logged once), so small models run on any mesh.
"""

from __future__ import annotations

import logging

import jax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

BATCH = ("data", "fsdp", "expert")  # expert parallelism inside data parallelism (maxlm/parallel/experts.py)
# The axes a parameter's `embed` dimension is split over: fsdp and context together (ZeRO-3 over both, as MaxText's
# rules shard `embed` over its context axis and Megatron's distributed optimizer over data x context). The devices
# of a context group compute gradients of the same weights on different tokens, so those gradients are summed over
# `context` anyway: split over it, the sum is a reduce-scatter and the parameters and optimizer state a cp-th each,
# instead of every context device holding them whole (the 8B at 131k tokens on context 8: 96 GiB of state each).
# `expert` is in it too, for the same reason: the devices of an expert group hold different tokens (the batch is split
# over it) and the same dense weights, whose gradients are summed over `expert`; Megatron's distributed optimizer
# shards the dense parameters' state over data x expert likewise. The experts' own weights [E, D, F] are split over
# `expert` on E, so their D dimension (`expert_embed`) is split over fsdp x context only: a mesh axis shards one
# dimension of an array at most.
ZERO = ("fsdp", "context", "expert")
EXPERT_ZERO = ("fsdp", "context")

# logical axis -> mesh axes. Parameters are FSDP-sharded on `embed` (over fsdp x context x expert: ZERO) and tensor-parallel
# (Megatron-style) on heads / mlp / vocab; activations are sharded on batch, on length over `context`
# (context parallelism: maxlm/parallel/context.py) and on heads/mlp. The scanned
# layer stack [L, ...] is split over `pipeline` in contiguous blocks: stage s holds layers s*L/S .. (s+1)*L/S - 1
# (maxlm/parallel/pipelining.py); the stored tree stays per layer, whatever the pipeline degree.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", ZERO),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("qkv", None),
    ("act", None),
    ("norm", None),
    ("layers", "pipeline"),
    ("expert", "expert"),  # the experts of an MoE block [E, ...] (maxlm/layers/moe.py; maxlm/parallel/experts.py)
    ("expert_embed", EXPERT_ZERO),  # the experts' D dimension
    ("expert_logits", None),  # the router's output dimension [D, E]
    # activations
    ("activation_batch", BATCH),
    ("stages", "pipeline"),  # the pipeline's stage axis of its activations (maxlm/parallel/pipelining.py)
    ("stage_length", "pipeline"),  # the length outside the stages (embedding, head, loss): split over them
    ("activation_length", "context"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_head_dim", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)

# Roles Transformer Engine needs to know (its MeshResource), set in one place.
TE_MESH_AXES = {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "cp": "context", "pp": "pipeline"}


def _divisible(spec: P, shape: tuple[int, ...], mesh: Mesh, name: str) -> P:
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if axes is None:
      out.append(None)
      continue
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for a in names:
      size *= mesh.shape[a]
    if dim % size:
      log.info("sharding: %s dim %d not divisible by %s=%d; replicated", name, dim, names, size)
      out.append(None)
    else:
      out.append(axes)
  return P(*out)


def shardings_from_logical(abstract_tree, mesh: Mesh):
  """NamedShardings for a tree of (possibly LogicallyPartitioned-boxed) abstract arrays."""
  specs = nn.get_partition_spec(abstract_tree)
  mesh_specs = nn.logical_to_mesh(specs, LOGICAL_RULES)
  plain = strip_boxes(abstract_tree)
  paths = jax.tree_util.tree_flatten_with_path(plain)[0]
  spec_leaves = jax.tree_util.tree_leaves(mesh_specs, is_leaf=lambda x: isinstance(x, P))
  treedef = jax.tree_util.tree_structure(plain)
  out = []
  for (path, leaf), spec in zip(paths, spec_leaves):
    spec = _divisible(spec, leaf.shape, mesh, jax.tree_util.keystr(path))
    out.append(NamedSharding(mesh, spec))
  return jax.tree_util.tree_unflatten(treedef, out)


def strip_boxes(tree):
  """Drop LogicallyPartitioned boxes without applying constraints (works on abstract values)."""
  return jax.tree_util.tree_map(lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x, tree,
                                is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [B, T] are split over the data-parallel axes (data x fsdp x expert)."""
  return NamedSharding(mesh, P(BATCH, None))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def rule_axes(logical: str) -> tuple[str, ...] | None:
  """The mesh axes the installed logical rules map `logical` to, () for none; None without a current mesh or
  without rules."""
  if jax.sharding.get_abstract_mesh().empty:
    return None
  try:
    spec = nn.logical_to_mesh_axes((logical,))
  except ValueError:  # no rules installed
    return None
  name = spec[0] if len(spec) else None
  return () if name is None else name if isinstance(name, tuple) else (name,)


def split_axis(logical: str) -> tuple[str, int] | None:
  """(mesh axis, size) when the rules map `logical` to one axis of the current mesh with more than one device;
  else None (the one lookup of context parallelism's `activation_length` and expert parallelism's `expert`)."""
  names, mesh = rule_axes(logical), jax.sharding.get_abstract_mesh()
  if not names or len(names) != 1 or names[0] not in mesh.axis_names or mesh.shape[names[0]] == 1:
    return None
  return names[0], mesh.shape[names[0]]


def axis_rules():
  """Context manager installing the logical rules for `nn.with_logical_constraint`."""
  return nn.logical_axis_rules(LOGICAL_RULES)
