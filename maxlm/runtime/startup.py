"""Start-up: the process settings, applied once before the JAX backend starts (`begin`), and the time from
process start to the end of the first step, in parts (the first-step line, metrics.jsonl).

`begin(cfg)` is the one start sequence of every command that starts JAX for a config (train, --compile-only,
plan, doctor): XLA:CPU's thread pool for simulated devices, the XLA flag preset, train.deterministic's flags,
the share of device memory XLA takes, and the persistent compilation cache. XLA reads its flags and the memory
share once, when the backend starts; the cache must be set before the first compile.

Parts, in order: `backend_s` process start (Linux: the kernel's start time of the process, so Python's
imports count; for `maxlm.train.run` called as a library, the call's start) to the JAX backend up; `plan_s`
`plan.mode`'s measurements (ahead-of-time compiles; 0 where it measured nothing; the line shows it when not 0);
`init_s` the run's checks, data inputs, the state built or restored; `lower_s`
tracing and lowering the train step; `compile_s` compiling it (or loading it from the persistent
compilation cache); `first_run_s` the first batch fetched, moved and the step run. `startup_s` is their
sum: process start to the first step's end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from maxlm.config import Config
from maxlm.runtime import compile_cache as cache_lib
from maxlm.runtime import env as runtime
from maxlm.runtime import xla_presets
from maxlm.runtime.devices import host_memory_bytes
from maxlm.runtime.distributed import processes_on_node
from maxlm.runtime.env import apply_host_pool, apply_mem_fraction

# Why train.deterministic keeps every compiled program (compile.min_compile_s=0): XLA's compiles of one program
# are not bit-identical across processes: the autotuner times its candidate kernels and can pick another one in
# another compile (XLA's docs/determinism.md: "different kernels can be picked as the fastest ones in different
# compilation runs"; persisted autotuning is its workaround), and fusion decisions on near-ties can flip between
# processes (openxla/xla#49047). A restart that loads the first start's binaries from the cache runs exactly them.
DETERMINISTIC_CACHE = ("every compiled program is kept in the compilation cache (compile.min_compile_s=0), so a "
                       "restart runs the binaries of the first start: two compiles of one program can differ")
DETERMINISTIC_EVICTION = ("the compilation cache holds at most {limit} (JAX_COMPILATION_CACHE_MAX_SIZE): a program "
                          "evicted before a restart is compiled again, and two compiles of one program can differ")
DETERMINISTIC_NO_CACHE = ("compile.cache=false: a restart compiles again, and two compiles of one program can "
                          "differ (XLA's autotuning), so a resume may not repeat the first run's bits")


def begin(cfg: Config, compile_cache: bool = True) -> list[str]:
  """Apply the process settings of `cfg` before the backend starts; returns the lines for the log (the cache's
  own line comes at the first step). ConfigError for settings that conflict or a cache directory that fails."""
  lines = []
  pool = runtime.size_cpu_pool()  # simulated CPU devices: XLA's pool, sized (a no-op where a command did it)
  if pool:
    lines.append(pool)
  preset = xla_presets.apply(cfg.xla.preset)  # the preset first: deterministic flags add to it
  if preset:
    lines.append(preset)
  det = cfg.train.deterministic
  lines += [f"train.deterministic=true: {line}" for line in runtime.configure(deterministic=det)]
  gpu = xla_presets.detect_gpu() is not None
  for line in (apply_mem_fraction(cfg.xla.mem_fraction, gpu),
               apply_host_pool(host_memory_bytes() if gpu else None, processes_on_node(os.environ), gpu)):
    if line:
      lines.append(line)
  if compile_cache:
    c = cfg.compile
    if det and c.cache and c.min_compile_s < 0:  # unset: keep every program (a value you set wins)
      c = dataclasses.replace(c, min_compile_s=0.0)
      lines.append(f"train.deterministic=true: {DETERMINISTIC_CACHE}")
    elif det and not c.cache:
      lines.append(f"train.deterministic=true with {DETERMINISTIC_NO_CACHE}")
    runtime.configure_compile_cache(c)
    limit = cache_lib.size_limit()
    if det and limit is not None:
      lines.append(f"train.deterministic=true with {DETERMINISTIC_EVICTION.format(limit=cache_lib.human(limit))}")
  return lines

PARTS = (("backend_s", "imports and backend"), ("plan_s", "plan"), ("init_s", "init"), ("lower_s", "trace and lower"),
         ("compile_s", "compile"), ("first_run_s", "first run"))


def process_age_s() -> float | None:
  """Seconds since this process started (Linux /proc), None where that cannot be read."""
  try:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: clock ticks after boot
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start
  except (OSError, ValueError, IndexError, AttributeError):
    return None
  return age if 0 <= age < 86400 else None


IMPORTS_MAX_S = 300.0  # a process older than this when its command starts is a library's host, not a command


def process_start() -> float:
  """`time.perf_counter()` at this process's start, so that a command's imports count; now where the process
  is older than IMPORTS_MAX_S (maxlm called as a library from a long-lived process) or its age is unknown."""
  # the age first, then the clock: the two clock reads are adjacent (the /proc read comes before both), so a
  # process descheduled in between cannot make it older than it is (once, by 2 ms, on a loaded CI machine)
  age = process_age_s()
  now = time.perf_counter()
  return now - age if age is not None and age < IMPORTS_MAX_S else now


class Startup:
  """Marks on the way to the first step, on `time.perf_counter`'s clock, from `t0` (see `process_start`)."""

  def __init__(self, t0: float):
    self.t0 = t0
    self.marks: dict[str, float] = {}

  def mark(self, name: str) -> None:
    self.marks[name] = time.perf_counter()

  def plan_s(self) -> float:
    """The seconds of plan.mode's decision (its compiles): 0 where the run was not planned here."""
    backend = self.marks.get("backend", self.t0)
    return self.marks.get("plan", backend) - backend

  def parts(self, t_first: float, lower_s: float, compile_s: float) -> dict[str, float]:
    """The parts and startup_s for a first step that ended at `t_first` (the mark "plan": plan.mode's decision,
    made between the backend's start and the state's; none where the run was not planned here)."""
    backend, ready = self.marks.get("backend", self.t0), self.marks.get("state", self.t0)
    planned = self.marks.get("plan", backend)
    return {"startup_s": t_first - self.t0, "backend_s": backend - self.t0, "plan_s": planned - backend,
            "init_s": ready - planned,
            "lower_s": lower_s, "compile_s": compile_s,
            "first_run_s": max(0.0, t_first - ready - lower_s - compile_s)}


def first_step_line(done: int, parts: dict[str, float], peak_gb: float | None, estimate_gb: float | None) -> str:
  split = ", ".join(f"{name} {parts[key]:.1f} s" for key, name in PARTS if key != "plan_s" or parts[key] >= 0.05)
  return (f"maxlm: first step {done} done {parts['startup_s']:.1f} s after start ({split})"
          + (f", peak device memory {peak_gb:.1f} GB" if peak_gb is not None else "")
          + (f", XLA's compiled estimate {estimate_gb:.1f} GB per device" if estimate_gb is not None else ""))
