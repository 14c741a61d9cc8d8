"""The trainer's profiling window: an XProf trace, NVTX step ranges and the CUDA profiler API.

`profile.start_step=N profile.num_steps=K` profiles steps N .. N+K-1, numbered from 1 as in the
progress lines (step 1 includes tracing and compilation; start later to see steady-state steps).

* XProf: process 0 calls `jax.profiler.start_trace(<run_dir>/profile)` just before step N is dispatched
  (after the previous step has finished, so no earlier work leaks in) and `stop_trace()` once step
  N+K-1 has finished. The trace lands in `<run_dir>/profile/plugins/profile/<time>/<host>.xplane.pb`:
  `xprof --logdir <run_dir>/profile` or TensorBoard's profile plugin opens it.
* nsys: every step (in or out of the window) runs inside `jax.profiler.StepTraceAnnotation("train_step",
  step_num=n)`, which XLA forwards to NVTX on GPUs, and every process calls cudaProfilerStart/Stop
  (libcudart through ctypes; nothing happens without a GPU or a CUDA runtime) around the window, so
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop` records only those steps.
  XProf and nsys both use CUPTI: under nsys set `profile.xprof=false`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import jax

from maxlm.config import ProfileConfig

log = logging.getLogger(__name__)

STEP_ANNOTATION = "train_step"


def _loaded_cudart() -> str | None:
  """Path of a libcudart this process has already loaded (the one XLA uses), if any."""
  try:
    with open("/proc/self/maps") as f:
      for line in f:
        path = line.split()[-1]
        if os.path.basename(path).startswith("libcudart.so"):
          return path
  except OSError:
    pass
  return None


def _find_cudart() -> ctypes.CDLL | None:
  """The CUDA runtime library: the loaded one, else a CUDA toolkit's or a pip wheel's (nvidia-cuda-runtime)."""
  candidates = [_loaded_cudart(), ctypes.util.find_library("cudart")]
  for base in sys.path:
    candidates += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libcudart.so*")))
    candidates += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
  for name in candidates:
    if not name:
      continue
    try:
      return ctypes.CDLL(name)
    except OSError:
      continue
  return None


class CudaProfilerApi:
  """cudaProfilerStart / cudaProfilerStop, for nsys's `--capture-range=cudaProfilerApi`.

  Only on a GPU backend and only where a CUDA runtime library loads; otherwise both do nothing.
  """

  def __init__(self):
    self._lib = _find_cudart() if jax.default_backend() == "gpu" else None
    if self._lib is None:
      log.info("no CUDA runtime here: cudaProfilerStart/Stop skipped")

  def _call(self, name: str) -> None:
    if self._lib is None:
      return
    rc = getattr(self._lib, name)()
    if rc:
      log.warning("%s returned CUDA error %d", name, rc)

  def start(self) -> None:
    self._call("cudaProfilerStart")

  def stop(self) -> None:
    self._call("cudaProfilerStop")


class Profiler:
  """Drives the window from the training loop:

      with profiler.step(n):                 # NVTX / XProf step range; opens the window at its first step
        state, metrics = train_step(state, batch)
      profiler.step_done(n, metrics)         # after the window's last step: wait for it, stop the trace
      ...
      profiler.close()                       # in `finally`: a run that ends inside the window still stops it
  """

  def __init__(self, cfg: ProfileConfig, run_dir: Path, is_main: bool, cuda: Any = None,
               echo: Callable[[str], None] = print):
    self.first, self.last = cfg.start_step, cfg.start_step + cfg.num_steps - 1
    self.pending = cfg.start_step > 0  # the window is still ahead
    self.trace_dir = Path(run_dir) / "profile"
    self.xprof = cfg.xprof and is_main
    self.is_main, self.echo = is_main, echo
    self.cuda = cuda if cuda is not None or not self.pending else CudaProfilerApi()
    self.active_from: int | None = None  # first step traced while the window is open
    self._previous: Any = None  # outputs of the last step dispatched (waited for when the window opens)

  @contextlib.contextmanager
  def step(self, n: int):
    if self.pending and self.active_from is None:
      if self.first <= n <= self.last:
        self._open(n)
      elif n > self.last:  # a resumed run that starts after the window
        self.pending = False
        self._say(f"maxlm: profile window steps {self.first}-{self.last} lies before this run's first step "
                  f"{n}; nothing profiled")
    with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=n):
      yield

  def step_done(self, n: int, outputs: Any) -> None:
    self._previous = outputs
    if self.active_from is not None and n >= self.last:
      self._close(n)

  def close(self) -> None:
    """Stop a window that is still open (the run ended early: preemption, end of data, an error)."""
    if self.active_from is not None:
      self._close(None)

  def _say(self, line: str) -> None:
    if self.is_main:
      self.echo(line)

  def _open(self, n: int) -> None:
    if self._previous is not None:
      jax.block_until_ready(self._previous)  # earlier steps' device work stays out of the window
    if self.xprof:
      self.trace_dir.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self.trace_dir))
    self.cuda.start()
    self.active_from = n
    self._say(f"maxlm: profiling steps {n}-{self.last}" + (f" (XProf trace to {self.trace_dir})" if self.xprof
                                                             else ""))

  def _close(self, n: int | None) -> None:
    try:
      if self._previous is not None:
        jax.block_until_ready(self._previous)  # the window's device work is in the trace
    finally:
      self.cuda.stop()
      if self.xprof:
        jax.profiler.stop_trace()
      first, self.active_from, self.pending = self.active_from, None, False
    upto = f"{first}-{n}" if n is not None else f"from {first} until the run stopped"
    where = f": {self.trace_dir} (view: xprof --logdir {self.trace_dir})" if self.xprof else ""
    self._say(f"maxlm: profiled steps {upto}{where}")
