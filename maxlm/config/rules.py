"""The config checks on single values that need more than a range or a choice (maxlm/config/schema.py): the run
name as one directory inside output_dir, the distributed section's address and device ids, and the model's
mixture of experts against the rest of the model and the mesh."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from maxlm.config import schema
from maxlm.config.schema import ConfigError

if TYPE_CHECKING:  # annotations only: the section is defined in maxlm/config/__init__.py, which imports this
  from maxlm.config import DistributedConfig, MeshConfig, ModelConfig


def check_run_name(output_dir: str, name: str) -> None:
  """run_name is one plain path component that stays inside output_dir (even through a symlink)."""
  plain = (name not in ("", ".", "..") and not any(c in name for c in "/\\")
           and all(c.isprintable() for c in name))
  if not plain:
    raise ConfigError(f"config key 'run_name' must be a single plain directory name (no '/', '\\', "
                      f"'.', '..' or control characters), got {schema.show(name)}")
  parent = os.path.realpath(output_dir or ".")
  target = os.path.realpath(os.path.join(parent, name))
  if os.path.dirname(target) != parent:
    raise ConfigError(f"config key 'run_name' {schema.show(name)} resolves to {target!r}, outside "
                      f"output_dir {schema.show(output_dir)}")


def local_device_ids(text: str) -> tuple[int, ...] | None:
  """`distributed.local_device_ids` as ids; None for "" (chosen from the launcher) and "all"."""
  if text.strip() in ("", "all"):
    return None
  try:
    ids = tuple(int(p) for p in text.split(","))
  except ValueError:
    ids = ()
  if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
    raise ConfigError(f"config key 'distributed.local_device_ids' must be \"\", all, or distinct device "
                      f"numbers like 0,1; got {schema.show(text)}")
  return ids


def check_distributed(d: DistributedConfig) -> None:
  """coordinator_address is host:port, process_id below num_processes, local_device_ids parses."""
  if d.coordinator_address:
    host, _, port = d.coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
      raise ConfigError(f"config key 'distributed.coordinator_address' must be host:port (port 1-65535), "
                        f"got {schema.show(d.coordinator_address)}")
  if d.num_processes and d.process_id >= d.num_processes:
    raise ConfigError(f"config key 'distributed.process_id' ({d.process_id}) must be below "
                      f"distributed.num_processes ({d.num_processes})")
  local_device_ids(d.local_device_ids)


def check_expert_degree(experts: int, ep: int) -> None:
  """ConfigError unless the total expert degree `ep` (mesh.expert x mesh.dcn_expert) is 1 or splits
  model.moe.experts: each device of the expert axis holds experts / ep whole experts."""
  if ep > 1 and (not experts or experts % ep):
    what = "no experts (a dense model)" if not experts else f"{experts} experts, not divisible by it"
    raise ConfigError(f"mesh.expert x mesh.dcn_expert = {ep} (expert parallelism) but model.moe.experts={experts}: "
                      f"{what}; use an expert degree that divides model.moe.experts, or 1")


def check_moe(m: ModelConfig, mesh: MeshConfig) -> None:
  """model.moe: k <= E; the MoE layers exist; what the scanned stack and the pipeline cannot run yet; the expert
  degree, where no -1 leaves it to the device count, divides E (a -1 degree: checked on the mesh, by the trainer and the dry
  run)."""
  e = m.moe
  if mesh.expert != -1 and mesh.dcn_expert != -1:
    check_expert_degree(e.experts, mesh.expert * mesh.dcn_expert)
  if not e.experts:
    return
  if e.top_k > e.experts:
    raise ConfigError(f"config key 'model.moe.top_k' ({e.top_k}) must be at most model.moe.experts ({e.experts})")
  if e.every > m.n_layers:
    raise ConfigError(f"config key 'model.moe.every' ({e.every}) must be at most model.n_layers ({m.n_layers}): "
                      "no block would be MoE")
  if e.every > 1 and m.scan_layers:
    raise ConfigError(f"config key 'model.moe.every' ({e.every}) > 1 needs model.scan_layers=false (the scanned "
                      "stack repeats one block; mixing dense and MoE blocks in it is not built yet)")
  if mesh.pipeline > 1 or mesh.dcn_pipeline > 1:
    raise ConfigError("config key 'model.moe.experts' > 0 does not run with pipeline stages yet "
                      f"(mesh.pipeline={mesh.pipeline}, mesh.dcn_pipeline={mesh.dcn_pipeline})")
