"""Facts about the devices at hand, for the trainer, the dry run, the planner and doctor: a device's memory, the
peak memory in use, and how a mesh lies over the processes."""

from __future__ import annotations

import os

import jax
import numpy as np


def device_memory_bytes() -> int | None:
  """Memory of one local device: the allocator's limit on GPUs, host RAM shared by CPU devices."""
  dev = jax.local_devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if dev.platform == "cpu":
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()
    except (ValueError, OSError):
      return None
  return None


def peak_memory_gb() -> float | None:
  """Peak device memory in use so far (GB, max over local devices), where the backend reports it."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p]
  return max(peaks) / 1e9 if peaks else None


def mesh_placement(mesh) -> str:
  """How the mesh axes lie over the processes, e.g. 'mesh over 2 processes (processes along each axis:
  data 2, fsdp 1, context 1, tensor 1); process of each device by mesh position: [[[[0]], [[0]]], [[[1]], [[1]]]]'
  (the array only up to 64 devices)."""
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)  # [data, fsdp, context, tensor]
  along = []
  for i, name in enumerate(mesh.axis_names):
    lines = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])  # every line of devices along this axis
    along.append(f"{name} {max(len(set(line.tolist())) for line in lines)}")
  text = f"mesh over {len(np.unique(procs))} processes (processes along each axis: {', '.join(along)})"
  if procs.size <= 64:
    text += f"; process of each device by mesh position: {procs.tolist()}"
  return text
