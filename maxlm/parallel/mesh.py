"""Device mesh with axes (pipeline, data, fsdp, expert, context, tensor): intra-node (NVLink) x inter-node
(InfiniBand) degrees.

`pipeline` comes first, the outermost axis: its stages exchange only one micro-batch's activations per tick
(point to point), the least traffic of any axis, so it is the one to lay across nodes (mesh.dcn_pipeline).
`expert` follows data and fsdp: the batch is split over data x fsdp x expert (expert parallelism inside data
parallelism, as Megatron and MaxText arrange it), and its all-to-all, every token of an MoE layer twice each way,
stays among neighbouring devices, inside the node unless mesh.dcn_expert says otherwise."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from maxlm.config import ConfigError, MeshConfig

AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")


def _named(degrees: list[int], what: str) -> str:
  """The degrees as keys, the expert axis only where it is not 1 (most models have no experts)."""
  prefix = "mesh.dcn_" if what == "node" else "mesh."
  return " x ".join(f"{prefix}{a}={d}" for a, d in zip(AXES, degrees) if a != "expert" or d != 1)


def _fill(degrees: list[int], total: int, what: str) -> list[int]:
  auto = [i for i, d in enumerate(degrees) if d == -1]
  where = "nodes" if what == "node" else "devices per node"
  if len(auto) > 1:
    raise ConfigError(f"mesh: at most one {what} degree may be -1, got {_named(degrees, what)}"
                      + (" (mesh.dcn_data is -1 by default: set it to 1)" if what == "node" else ""))
  if any(d == 0 or d < -1 for d in degrees):
    raise ConfigError(f"mesh: {what} degrees must be positive or -1, got {_named(degrees, what)}")
  known = math.prod(d for d in degrees if d != -1)
  if auto:
    if total % known:
      raise ConfigError(f"mesh: the {total} {where} are not divisible by the fixed degrees of "
                        f"{_named(degrees, what)} (product {known}); the -1 takes what they leave")
    degrees = list(degrees)
    degrees[auto[0]] = total // known
  if math.prod(degrees) != total:
    raise ConfigError(f"mesh: {_named(degrees, what)} multiply to {math.prod(degrees)}, but there are {total} "
                      f"{where}; set one of them to -1 to take the rest")
  return degrees


def mesh_shape(cfg: MeshConfig, n_devices: int, n_nodes: int = 1) -> tuple[list[int], list[int]]:
  """(intra-node degrees, inter-node degrees), -1 entries filled. One process per node assumed."""
  dcn = _fill([getattr(cfg, f"dcn_{a}") for a in AXES], n_nodes, "node")
  if n_devices % n_nodes:
    raise ConfigError(f"mesh: {n_devices} devices do not split evenly over {n_nodes} nodes")
  ici = _fill([getattr(cfg, a) for a in AXES], n_devices // n_nodes, "per-node")
  return ici, dcn


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  n_nodes = len({d.process_index for d in devices})
  ici, dcn = mesh_shape(cfg, len(devices), n_nodes)
  if n_nodes > 1:
    arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
  else:
    try:
      arr = mesh_utils.create_device_mesh(ici, devices)
    except (AssertionError, NotImplementedError, ValueError):
      arr = np.asarray(devices).reshape(ici)
  return Mesh(arr, AXES)


def check_context_split(seq_len: int, context: int) -> None:
  """ConfigError unless data.seq_len splits into 2 x context equal chunks: the causal load balancing gives
  each device of the context axis two chunks (maxlm/parallel/context.py)."""
  if context > 1 and seq_len % (2 * context):
    raise ConfigError(f"data.seq_len={seq_len} is not divisible by 2 x the context-parallel degree {context} "
                      f"(mesh.context x mesh.dcn_context): each device holds two chunks of the sequence; use a "
                      f"multiple of {2 * context}")
