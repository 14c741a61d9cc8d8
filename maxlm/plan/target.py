"""Where a plan is for (`Target`: the devices, their memory, how the step is measured; `make_target` makes it) and
the simulator that measures for devices not at hand.

For more devices than are present, `Simulator(n)` runs maxlm/plan/measure.py's measurement in one child process on n
simulated CPU devices (`--xla_force_host_platform_device_count=n`, `JAX_PLATFORMS=cpu`), one JSON line per config
(measure.py says how that stands in for a GPU's step), or, where JAX's CUDA plugin is installed, XLA:GPU's compiler
for n compile-only GPUs of a kind (maxlm/plan/xla_gpu.py, the kinds in maxlm/plan/kinds.py). `Target.progress` gets a
line every 30 s of a compile (heartbeat.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import jax

from maxlm.config import Config, ConfigError, to_dict
from maxlm.plan import heartbeat, xla_gpu
from maxlm.plan.clock import CompileClock
from maxlm.plan.kinds import KINDS, NODE_HOST, NODE_HOST_PER_GPU, kind_for
from maxlm.plan.measure import measure, offloaded
from maxlm.runtime.devices import bytes_limit, device_kind, host_memory_bytes, is_gpu, local_device, physical_memory_bytes
from maxlm.runtime.distributed import processes_on_node
from maxlm.runtime.env import GPU_FRACTION, XLA_DEFAULT_FRACTION, fraction_in_environment
from maxlm.tables import DEFAULT_GPU, gpu_named, human_bytes


def simulated_env(n_devices: int) -> dict[str, str]:
  """The environment of a child with n simulated CPU devices (other XLA flags kept: CPU accepts them)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  # LLVM's optimization level changes the generated code, not the HLO buffer assignment: compiles faster
  if not any(f.startswith("--xla_backend_optimization_level") for f in flags):
    flags.append("--xla_backend_optimization_level=0")
  flags.append(f"--xla_force_host_platform_device_count={n_devices}")
  return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


class Simulator:
  """`measure(..., gpu_footprint=True)` on n simulated CPU devices in one child process (started on the first call),
  or what `command` measures on in the environment `env` (xla_gpu.py's compile-only GPUs, one_memory=False). On
  XLA:CPU's one memory, configs that differ only in optim.offload are one program: compiled once, the offload by
  `offloaded` (host_params: offload=none's program with model.cast_params_once, holding the compute copy)."""

  def __init__(self, n_devices: int, command: list[str] | None = None, env: dict | None = None,
               label: str = "", one_memory: bool = True):
    self.n, self.proc, self.cache, self.one_memory = n_devices, None, {}, one_memory
    self.command = command or [sys.executable, "-m", "maxlm.plan.measure"]
    self.env, self.label = env, label or f"{n_devices} simulated CPU devices"

  def measure(self, cfg: Config) -> dict:
    data = to_dict(cfg)
    arithmetic = self.one_memory and cfg.optim.offload != "none"
    if arithmetic:
      data["optim"]["offload"] = "none"
      data["model"]["cast_params_once"] |= cfg.optim.offload == "host_params"
    key = json.dumps(data, sort_keys=True)
    if key not in self.cache:
      self.cache[key] = self._ask(key)
    out = self.cache[key]
    if "error" in out:
      raise ConfigError(out["error"])
    return offloaded(out, cfg.optim.offload) if "oom" not in out and arithmetic else out

  def _ask(self, line: str) -> dict:
    if self.proc is None:
      self.proc = subprocess.Popen(self.command, env=self.env or simulated_env(self.n),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.proc.stdin.write(line + "\n")
    self.proc.stdin.flush()
    answer = self.proc.stdout.readline()
    if not answer:
      code = self.proc.wait()
      self.proc = None
      raise RuntimeError(f"the measuring process on {self.label} ended (exit code {code}) "
                         "before it answered; its output is above")
    return json.loads(answer)

  def close(self) -> None:
    if self.proc is not None:
      self.proc.stdin.close()
      self.proc.wait()
      self.proc = None


MARGIN = 0.02  # of the usable memory, for fragmentation of XLA's pool (see maxlm/plan/__init__.py)


@dataclasses.dataclass
class Target:
  """Where a plan is for: devices, their memory, and how the step is measured (see `make_target`)."""
  n_devices: int
  n_nodes: int
  kind: str  # device kind, e.g. "NVIDIA H200"; "cpu" for CPU devices
  device_bytes: int  # one device's memory (a GPU's total; a CPU device's share of RAM)
  fraction: float | None  # xla.mem_fraction in effect on a GPU; None on CPU
  simulated: bool  # measured on simulated CPU devices (`Simulator`), else on the devices at hand
  devices: list | None = None  # the devices at hand to measure on
  assumed: str = ""  # what was assumed about the device (no GPU here to ask)
  gpu_target: str = ""  # a key of maxlm/plan/kinds.py's KINDS: measured by XLA:GPU on compile-only GPUs
  note: str = ""  # why a simulation is XLA:CPU's (no CUDA plugin, --simulate)
  host_bytes: int | None = None  # the node's RAM over its devices (GPUs only: a CPU has one memory), None: unknown
  host_assumed: str = ""  # what was assumed about the host (a compile-only target: no node to ask)
  _sim: Simulator | None = None
  # told before each measurement, with the seconds its compile is expected to take (None: nothing compiled yet),
  # by the start-up watchdog, which derives the compile's limit from it
  on_measure: Callable[[float | None], None] | None = None
  clock: CompileClock = dataclasses.field(default_factory=CompileClock)  # the compiles made, for the expectation
  progress: Callable[[str], None] | None = None  # a line while a compile runs (heartbeat.py) and XLA's warnings
  heartbeat_s: float = heartbeat.EVERY

  @property
  def usable(self) -> int:
    return int(self.device_bytes * (self.fraction or 1.0) * (1 - MARGIN))

  @property
  def gpu(self) -> bool:
    return self.kind != "cpu"

  @property
  def measured_by(self) -> str:
    """Which compiler measures: "XLA on the devices at hand", "XLA:GPU target h200 (compile-only), jax 0.10.2",
    "XLA:CPU simulation, jax 0.10.2"."""
    if not self.simulated:
      return "XLA on the devices at hand"
    return (f"XLA:GPU target {self.gpu_target} (compile-only), jax {jax.__version__}" if self.gpu_target else
            f"XLA:CPU simulation, jax {jax.__version__}")

  def measure(self, cfg: Config) -> dict:
    if self.on_measure is not None:
      self.on_measure(self.clock.expect(cfg))
    if self.simulated and self._sim is None:
      self._sim = (gpu_compiler(self.gpu_target, self.n_devices, self.n_nodes, cfg.xla.preset) if self.gpu_target
                   else Simulator(self.n_devices))
    what = f"compiling {heartbeat.candidate(cfg)} on {self._sim.label if self._sim else 'the devices at hand'}"
    began = time.monotonic()
    try:
      with heartbeat.beating(self.progress, what, self.heartbeat_s):
        out = self._sim.measure(cfg) if self._sim else measure(cfg, self.devices)
    finally:
      self.clock.add(cfg, time.monotonic() - began)
    if self.progress is not None and "xla_log" in out:
      self.progress(f"plan: {out['xla_log']}; while {what}")
    return out

  def close(self) -> None:
    if self._sim is not None:
      self._sim.close()

  def describe(self, compiled: bool = True) -> str:
    """The devices and their usable memory, and how memory was measured: by XLA (on the devices at hand, by
    XLA:GPU for compile-only GPUs, or on simulated CPU devices), or (compiled=False: every candidate pruned)
    not at all."""
    how = "by XLA on the devices at hand"
    if self.gpu_target:
      how = (f"by {self.measured_by}: {self.n_devices} GPUs over {self.n_nodes} node(s), fused attention's "
             "footprint" + (f"; {xla_gpu.COND_COPY}" if xla_gpu.cond_copies() else ""))
    elif self.simulated:
      how = (f"by XLA on {self.n_devices} simulated CPU devices ({self.measured_by}, with fused attention's "
             "footprint" + (f"; {self.note}" if self.note else "") + ")")
    frac = f" x xla.mem_fraction {self.fraction:g}" if self.fraction else ""
    return (f"{self.n_devices} x {self.kind}{self.assumed}: {human_bytes(self.device_bytes)}{frac} - {MARGIN:.0%} "
            f"= {human_bytes(self.usable)} usable per device; "
            + (f"memory measured {how}" if compiled else "pruned by the analytic model, nothing compiled"))


def gpu_compiler(key: str, n_devices: int, n_nodes: int, preset: str) -> Simulator:
  """A Simulator whose child compiles with XLA:GPU for n_devices compile-only GPUs of kind `key`."""
  plugin, why = xla_gpu.find_plugin()
  if plugin is None:
    raise RuntimeError(why)
  return Simulator(n_devices, [sys.executable, "-c", xla_gpu.WORKER, key, str(n_devices), str(n_nodes)],
                   xla_gpu.compiler_env(plugin, preset, KINDS[key]),
                   f"{n_devices} compile-only {key} GPUs (XLA:GPU)", one_memory=False)


def _local_memory(dev) -> int | None:
  """The allocator's limit of a GPU (or the test switch's); a CPU device's share of the host's RAM."""
  limit = bytes_limit(dev)
  if limit:
    return limit
  physical = physical_memory_bytes()
  return physical // jax.local_device_count() if physical else None


def make_target(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
                device_memory: int | None = None, simulate: bool = False, gpu: str | None = None) -> Target:
  """The devices at hand (all, or the first n_devices of one process), else n_devices GPUs of kind `gpu` (a key
  of maxlm/plan/kinds.py's KINDS; default: this machine's GPU, else h200), compiled for by XLA:GPU where the
  CUDA plugin is installed, else (or with simulate) simulated on CPU devices with that GPU's memory (this
  machine's when it has one; an H200's, said so, when no kind is named). device_memory: bytes of one device
  (a GPU's total, before xla.mem_fraction; on CPU what a device may use)."""
  if gpu is not None and gpu not in KINDS:
    raise ConfigError(f"argument --target: unknown GPU {gpu!r} (known: {', '.join(KINDS)})")
  dev = local_device()  # a process asks only its own devices (another process's are not addressable)
  gpu_here = is_gpu(dev)
  frac_here = (fraction_in_environment() or XLA_DEFAULT_FRACTION) if gpu_here else None
  here = _local_memory(dev)
  other_gpu = gpu is not None and not (gpu_here and kind_for(dev.device_kind) == gpu)  # --target
  at_hand = not simulate and not other_gpu and ((n_devices is None and n_nodes is None) or (
      jax.process_count() == 1 and (n_nodes or 1) == 1 and n_devices <= jax.device_count()))
  if at_hand:
    n = n_devices or jax.device_count()
    total = device_memory or (int(here / frac_here) if gpu_here and here else here)
    if not total:
      raise ConfigError("this device reports no memory size: give --device-memory-gb G")
    host = host_memory_bytes() if gpu_here else None
    return Target(n, n_nodes or jax.process_count(), device_kind(dev) if gpu_here else "cpu", total, frac_here,
                  False, jax.devices()[:n],
                  host_bytes=host // (jax.local_device_count() * processes_on_node(os.environ)) if host else None)
  kind, total, assumed = f"NVIDIA {DEFAULT_GPU}", gpu_named(DEFAULT_GPU).memory, " (assumed: no GPU here)"
  key = gpu or (kind_for(dev.device_kind) if gpu_here else "h200")
  if gpu is not None:
    kind, total, assumed = KINDS[gpu].kind, KINDS[gpu].memory, ""
  elif gpu_here and here:
    kind, total, assumed = dev.device_kind, int(here / frac_here), ""
  frac = fraction_in_environment() or cfg.xla.mem_fraction or GPU_FRACTION
  n_nodes = n_nodes or 1
  plugin, note = (None, "--simulate") if simulate else xla_gpu.find_plugin()
  if plugin is None or key is None:  # no XLA:GPU here, or no description of this GPU
    note = note or f"no target description of {dev.device_kind} in maxlm/plan/gpu_targets"
  return Target(n_devices or n_nodes * jax.local_device_count(), n_nodes, kind, device_memory or total, frac, True,
                assumed=assumed if not device_memory else "", gpu_target=key if plugin and key else "",
                note="" if plugin and key else note, host_bytes=NODE_HOST_PER_GPU, host_assumed=NODE_HOST)

