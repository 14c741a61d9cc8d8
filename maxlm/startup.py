"""The time from process start to the end of the first step, in parts (the first-step line, metrics.jsonl).

Parts, in order: `backend_s` process start (Linux: the kernel's start time of the process, so Python's
imports count; for `maxlm.train.run` called as a library, the call's start) to the JAX backend up; `init_s`
the run's checks, data inputs, the state built or restored (and `plan.mode`'s measurements); `lower_s`
tracing and lowering the train step; `compile_s` compiling it (or loading it from the persistent
compilation cache); `first_run_s` the first batch fetched, moved and the step run. `startup_s` is their
sum: process start to the first step's end.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PARTS = (("backend_s", "imports and backend"), ("init_s", "init"), ("lower_s", "trace and lower"),
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
  now, age = time.perf_counter(), process_age_s()
  return now - age if age is not None and age < IMPORTS_MAX_S else now


class Startup:
  """Marks on the way to the first step, on `time.perf_counter`'s clock, from `t0` (see `process_start`)."""

  def __init__(self, t0: float):
    self.t0 = t0
    self.marks: dict[str, float] = {}

  def mark(self, name: str) -> None:
    self.marks[name] = time.perf_counter()

  def parts(self, t_first: float, lower_s: float, compile_s: float) -> dict[str, float]:
    """The parts and startup_s for a first step that ended at `t_first`."""
    backend, ready = self.marks.get("backend", self.t0), self.marks.get("state", self.t0)
    return {"startup_s": t_first - self.t0, "backend_s": backend - self.t0, "init_s": ready - backend,
            "lower_s": lower_s, "compile_s": compile_s,
            "first_run_s": max(0.0, t_first - ready - lower_s - compile_s)}


def first_step_line(done: int, parts: dict[str, float], peak_gb: float | None, estimate_gb: float | None) -> str:
  split = ", ".join(f"{name} {parts[key]:.1f} s" for key, name in PARTS)
  return (f"maxlm: first step {done} done {parts['startup_s']:.1f} s after start ({split})"
          + (f", peak device memory {peak_gb:.1f} GB" if peak_gb is not None else "")
          + (f", XLA's compiled estimate {estimate_gb:.1f} GB per device" if estimate_gb is not None else ""))
