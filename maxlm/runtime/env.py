"""Process-level settings that must be in place before the JAX backend starts.

`configure(deterministic=...)` is called by every entry point that trains, before anything asks JAX
about devices: XLA reads `XLA_FLAGS` once, when the backend starts, and Transformer Engine reads
`NVTE_ALLOW_NONDETERMINISTIC_ALGO` whenever it traces fused attention.

`size_cpu_pool()` (every command, before JAX starts) sizes XLA:CPU's thread pool when the CPU is split into
simulated devices (`--xla_force_host_platform_device_count=N`: the tests' 8-device meshes, a sharding tried on a
laptop; `plan --simulate`'s children only compile, and run nothing). XLA runs each device's share of a program as
one task of a pool of max(cores, N) threads, and a collective holds its thread until all N shares arrive. With
async dispatch the next program's launches take threads too, and block while a device has its maximum of programs
in flight. Seen on a 2-core machine (pool of 8 for 8 devices, two trainings at once): 7 threads in an all-gather,
the 8th in such a launch, the missing share queued behind them, and XLA aborting the process 40 s later
("Termination timeout for `all gather ...`. Expected 8 threads to join the rendezvous, but only 7 of them arrived
on time"). JAX waits for one program's launches before it dispatches the next (the dispatching thread sat in that
wait), so one dispatching thread can block N - 1 shares in a collective and N launches: 2N - 1 threads.
CPU_POOL_PER_DEVICE * N threads, twice that, leave the missing share a thread. XLA reads the pool size from
`PJRT_NPROC` (else `NPROC`, else the cores); a value you set wins. Measured: benchmarks/cpu_collectives_stress.py
(benchmarks/README.md).
"""

from __future__ import annotations

import os

from maxlm.config import ConfigError

# What a GPU run needs to repeat bit for bit (measured on an H200: with the XLA flag alone, two
# identical runs differed by 3.6e-4 in loss; with both, repeats and resumes were exact):
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true",)  # deterministic reductions/scatters
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}  # TE: cuDNN fused-attention backward


def backend_started() -> bool:
  """True once JAX has created a backend (XLA flags can no longer change)."""
  from jax._src import xla_bridge  # noqa: PLC0415 - private, read only here; jax is imported lazily
  return bool(getattr(xla_bridge, "_backends", None))


CPU_POOL_PER_DEVICE = 4  # threads per simulated CPU device: twice the 2N that one dispatching thread can block
POOL_ENV = ("PJRT_NPROC", "NPROC")  # what XLA reads for its CPU pool's size, in its order


def simulated_cpu_devices(environ=None) -> int:
  """The CPU devices XLA will simulate (`--xla_force_host_platform_device_count`, JAX_NUM_CPU_DEVICES); 1 if
  neither is set."""
  environ = os.environ if environ is None else environ
  n = 1
  for flag in environ.get("XLA_FLAGS", "").split():
    name, _, value = flag.partition("=")
    if name == "--xla_force_host_platform_device_count" and value.isdigit():
      n = int(value)  # the last one wins, as in XLA
  count = environ.get("JAX_NUM_CPU_DEVICES", "")
  return max(n, int(count)) if count.isdigit() else n


def size_cpu_pool(environ=None) -> str | None:
  """Give XLA:CPU's pool CPU_POOL_PER_DEVICE threads per simulated device (module doc), before the backend
  starts; returns the line for the log, or None when nothing was set (one device, a size you set, or a backend
  already started)."""
  environ = os.environ if environ is None else environ
  n = simulated_cpu_devices(environ)
  if n < 2 or any(k in environ for k in POOL_ENV) or backend_started():
    return None
  threads = max(os.cpu_count() or 1, CPU_POOL_PER_DEVICE * n)
  environ["PJRT_NPROC"] = str(threads)
  return (f"PJRT_NPROC={threads}: XLA:CPU's thread pool sized for {n} simulated devices, so that collectives "
          "cannot take all its threads (maxlm/runtime/env.py)")


def _flag_name(flag: str) -> str:
  return flag.split("=", 1)[0]


def configure(deterministic: bool = False) -> list[str]:
  """Apply the process settings; returns a description of what was set (for the log)."""
  if not deterministic:
    return []
  done = []
  flags = os.environ.get("XLA_FLAGS", "").split()
  have = {_flag_name(f) for f in flags}
  missing = [f for f in DETERMINISTIC_XLA_FLAGS if _flag_name(f) not in have]
  user_set = [f for f in flags if _flag_name(f) in {_flag_name(d) for d in DETERMINISTIC_XLA_FLAGS}]
  conflict = [f for f in user_set if f not in DETERMINISTIC_XLA_FLAGS]
  if conflict:
    raise ConfigError(f"train.deterministic=true conflicts with XLA_FLAGS {' '.join(conflict)}")
  if missing:
    if backend_started():
      raise RuntimeError("train.deterministic=true must be applied before the JAX backend starts")
    os.environ["XLA_FLAGS"] = " ".join(flags + missing)
    done.append(f"XLA_FLAGS += {' '.join(missing)}")
  for key, value in DETERMINISTIC_ENV.items():
    if os.environ.get(key) not in (None, value):
      raise ConfigError(f"train.deterministic=true conflicts with {key}={os.environ[key]}")
    if os.environ.get(key) != value:
      os.environ[key] = value
      done.append(f"{key}={value}")
  return done


def configure_compile_cache(c) -> str:
  """`compile:` (a CompileConfig): JAX's persistent compilation cache, before the first compile. Returns
  what was set, for the log; ConfigError for a cache directory that cannot be used."""
  from maxlm.runtime import compile_cache, warm_start  # noqa: PLC0415 - import jax: only once a process is about to compile
  line = compile_cache.configure(c)
  warm_start.configure(compile_cache.directory(), c.warm_start)
  return line


# xla.mem_fraction: the share of a GPU's memory that XLA's pool takes, set before the backend starts.
GPU_FRACTION = 0.95  # xla.mem_fraction=auto on a GPU
XLA_DEFAULT_FRACTION = 0.75
FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # the new name, the old one


def fraction_in_environment() -> float | None:
  for var in FRACTION_VARS:
    if os.environ.get(var):
      try:
        return float(os.environ[var])
      except ValueError:
        raise ConfigError(f"{var}={os.environ[var]!r} is not a number") from None
  return None


def apply_mem_fraction(value: float, gpu: bool) -> str | None:
  """xla.mem_fraction, before the backend starts: a line for the log, or None when nothing was set. A
  fraction already in the environment wins; 0 (auto) means 0.95 on a GPU and nothing on CPU."""
  have = fraction_in_environment()
  if have is not None:
    if value and value != have:
      return f"xla.mem_fraction={value:g} not applied: your environment sets {have:g}"
    return None
  if not value and not gpu:
    return None
  why = "set" if value else ("auto on an NVIDIA GPU: XLA's default 0.75 leaves a quarter of the GPU unused "
                             "(35 GiB of an H200, 20 GiB of an H100); the 5% left outside XLA's pool "
                             "holds the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers")
  value = value or GPU_FRACTION
  os.environ[FRACTION_VARS[0]] = f"{value:g}"
  return f"xla.mem_fraction={value:g} ({why}): {FRACTION_VARS[0]}={value:g}"


# XLA's pinned host memory pool, where optim.offload keeps the optimizer state (host_params: and the parameters).
# XLA:GPU caps it at 64 GiB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise (xla/pjrt/gpu/gpu_helpers.cc,
# GetGpuHostAllocator). The pool grows on demand, so a higher cap pins nothing by itself. Under the default, the
# 8B's float32 host state (89.7 GiB with host_params) failed at the first step on the H200 ("Allocator
# (xla_gpu_host_bfc) ran out of memory", benchmarks/results/2026-12-06-h200_golden_emulation/).
HOST_POOL_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_HOST_POOL_GIB = 64
# Of the host RAM per device, what the pinned state may take: a choice, not a measurement; the rest is for the
# system, this process (its data pipeline's buffers, its compiled programs) and what a checkpoint save stages
HOST_SHARE = 0.9


def apply_host_pool(host_bytes: int | None, processes: int, gpu: bool) -> str | None:
  """XLA's pinned host pool cap, before the backend starts: HOST_SHARE of this node's RAM (`host_bytes`) over the
  run's `processes` on it, in whole GiB, where that is above XLA's 64 GiB default. A cap in the environment wins;
  nothing is set off a GPU or where the RAM is unknown. A line for the log, or None."""
  if not gpu or os.environ.get(HOST_POOL_VAR) or not host_bytes:
    return None
  gib = int(host_bytes * HOST_SHARE / max(processes, 1)) >> 30
  if gib <= XLA_HOST_POOL_GIB:
    return None
  os.environ[HOST_POOL_VAR] = str(gib)
  return (f"XLA's pinned host pool (optim.offload's state) up to {gib} GiB, {HOST_SHARE:.0%} of this node's "
          f"{host_bytes / 2**30:.0f} GiB RAM over {processes} process(es) (XLA's default: {XLA_HOST_POOL_GIB} "
          f"GiB): {HOST_POOL_VAR}={gib}")
