"""Facts about the devices at hand, for the trainer, the dry run, the planner and doctor: a device's memory, the
peak memory in use, and how a mesh lies over the processes. Every fact comes from this process's own (local)
devices: in a run of several processes the others' devices are not addressable (asking one for its memory is
an error).

The test switch (docs/testing.md): `MAXLM_TEST_GPU_PATHS=1` makes CPU devices take the code paths that only a GPU
takes otherwise (`gpu_paths`): plan.mode=fit measuring on the devices at hand, the GPU memory arithmetic, the
out-of-memory line. `MAXLM_TEST_DEVICE_BYTES=N` (with the switch) is what a local device reports as the
allocator's limit, as a GPU's `bytes_limit`, so that tests can give processes different memories;
`MAXLM_TEST_HOST_BYTES=N` (with the switch) is this node's RAM as `host_memory_bytes` reports it."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np


GPU_PATHS_ENV = "MAXLM_TEST_GPU_PATHS"
DEVICE_BYTES_ENV = "MAXLM_TEST_DEVICE_BYTES"
HOST_BYTES_ENV = "MAXLM_TEST_HOST_BYTES"


def gpu_paths() -> bool:
  """The test switch is on: CPU devices take the GPU-only code paths (module doc)."""
  return os.environ.get(GPU_PATHS_ENV) == "1"


def local_device():
  """This process's first device: the one whose memory it can ask about."""
  return jax.local_devices()[0]


def is_gpu(dev) -> bool:
  """A GPU, or any device under the test switch."""
  return dev.platform == "gpu" or gpu_paths()


def device_kind(dev) -> str:
  """The device's kind as JAX names it; under the test switch a CPU device says that it stands for a GPU."""
  return dev.device_kind if dev.platform == "gpu" else f"{dev.device_kind} (as a GPU: {GPU_PATHS_ENV}=1)"


def bytes_limit(dev) -> int | None:
  """The allocator's limit of a local device (a GPU's memory for XLA); the switch's MAXLM_TEST_DEVICE_BYTES where
  set; None where the device reports none (CPU)."""
  if gpu_paths() and os.environ.get(DEVICE_BYTES_ENV, "").isdigit():
    return int(os.environ[DEVICE_BYTES_ENV])
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def device_memory_bytes() -> int | None:
  """Memory of one local device: the allocator's limit on GPUs, host RAM shared by CPU devices."""
  dev = local_device()
  limit = bytes_limit(dev)
  if limit:
    return limit
  if dev.platform == "cpu":
    physical = physical_memory_bytes()
    return physical // jax.local_device_count() if physical else None
  return None


def physical_memory_bytes() -> int | None:
  """This machine's physical RAM; None where the system does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError):
    return None


def cgroup_memory_limit(cgroups: str, root: Path = Path("/sys/fs/cgroup")) -> int | None:
  """The lowest memory limit over this process's cgroup and those above it (`cgroups`: /proc/self/cgroup's text):
  cgroup v2's memory.max, v1's memory.limit_in_bytes (a SLURM job's --mem, a container's limit); None where
  none is set or readable."""
  limits = []
  for line in cgroups.splitlines():
    _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
    if controllers == "":
      base, name = root, "memory.max"  # v2: one unified hierarchy
    elif "memory" in controllers.split(","):
      base, name = root / "memory", "memory.limit_in_bytes"
    else:
      continue
    parts = [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):  # this cgroup, then each one above it, to the (namespace's) root
      try:
        text = (base.joinpath(*parts[:depth]) / name).read_text().strip()
      except OSError:
        continue
      if text.isdigit():
        limits.append(int(text))
  return min(limits) if limits else None


def host_memory_bytes() -> int | None:
  """This node's RAM as this process may use it: the physical memory, or a cgroup's limit where lower
  (`cgroup_memory_limit`); the test switch's MAXLM_TEST_HOST_BYTES where set."""
  if gpu_paths() and os.environ.get(HOST_BYTES_ENV, "").isdigit():
    return int(os.environ[HOST_BYTES_ENV])
  physical = physical_memory_bytes()
  if physical is None:
    return None
  try:
    limit = cgroup_memory_limit(Path("/proc/self/cgroup").read_text())
  except OSError:
    limit = None
  return min(physical, limit) if limit else physical


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


OOM_STATUS = "RESOURCE_EXHAUSTED"


def is_oom(e: BaseException) -> bool:
  """An XLA out-of-memory error (RESOURCE_EXHAUSTED), at compile or at run time."""
  return isinstance(e, jax.errors.JaxRuntimeError) and OOM_STATUS in str(e)
