"""The training loop's one door to its services: `Hooks`, called by the loop at fixed points with the `Run`.

The loop (maxlm/trainer.py `_train`) does the run's own work: restore the state, take a batch, dispatch a step,
evaluate. Everything around it (the hang watchdog, the profiler, preemption, checkpointing, the non-finite checks,
the metrics and the start-up timing: maxlm/loop/services.py) subscribes to these points and reads or writes the
`Run` they share. A subscriber is any object with methods named after the points it wants; the Hooks call them in
the order the subscribers were given, so one that arms the watchdog comes first and sees each point before the
work behind it starts.

  check       before anything is written for the run (the disk check: it may stop the run)
  begin       before the state is restored (the start line, the watchdog's limits)
  started     the state is restored or built: `run.start_step` is known (config.yml, the metrics writer)
  compile     before the train step is compiled ahead of the first step
  step_start  before a batch is taken (the host may wait for the data)
  dispatch    before a step is dispatched (the host may wait when the device's queue is full)
  step        a context around the dispatch (the profiler's step range); `run.done` is the step before it
  step_end    a step is dispatched: `run.done`, `run.last`, `run.metrics` (device arrays); sets `run.stop`
  save        a checkpoint is due (`run.save_due`): the state of step `run.done` is saved
  fetch       the step's metrics are fetched into `run.row` (the host waits for every step in flight)
  log         `run.row` is complete: its step time, its non-finite count
  eval        an evaluation starts; `eval_batch` after each of its batches
  write       `run.row` (with the eval's numbers) is written and printed
  stop        a signal stopped the run after its save was started (`run.stop`)
  end         the loop has ended, normally or not: every subscriber's `end` runs, the first error is raised
  closed      after `end`
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from maxlm.config import Config

POINTS = ("check", "begin", "started", "compile", "step_start", "dispatch", "step", "step_end", "save", "fetch", "log",
          "eval", "eval_batch", "write", "stop", "end", "closed")


@dataclasses.dataclass
class Run:
  """What the loop and its services share about the run."""
  cfg: Config
  trainer: Any  # maxlm.trainer.Trainer: its state, steps and data
  is_main: bool  # process 0: progress lines and files written once
  start_step: int = 0  # the step the state was restored at (0 for a fresh run)
  done: int = 0  # steps done: the last step dispatched
  last: bool = False  # that step is the run's last (train.steps, or the data's end)
  stop: bool = False  # a signal asked the run to save and exit (the same step on every process)
  signal: str | None = None  # its name
  metrics: Any = None  # the last step's metrics, device arrays
  row: dict | None = None  # the metrics row being logged (host numbers)
  paused: float = 0.0  # seconds since the last row spent saving (not training time)
  cache_hit: bool | None = None  # the train step came from the persistent compilation cache
  ckpt: Any = None  # maxlm.checkpoint.Checkpointer, or None with checkpointing off
  batches: Any = None  # maxlm.batches.Batches

  @property
  def save_due(self) -> bool:
    return self.ckpt is not None and (self.stop or self.last or self.ckpt.due(self.done))


class Hooks:
  """Calls the subscribers' methods named after each point, in subscriber order (see the module doc)."""

  def __init__(self, *subscribers):
    self.subscribers = subscribers
    self._calls = {p: tuple(getattr(s, p) for s in subscribers if hasattr(s, p)) for p in POINTS}

  def _call(self, point: str, run: Run) -> None:
    for call in self._calls[point]:
      call(run)

  def check(self, run: Run) -> None:
    self._call("check", run)

  def begin(self, run: Run) -> None:
    self._call("begin", run)

  def started(self, run: Run) -> None:
    self._call("started", run)

  def compile(self, run: Run) -> None:
    self._call("compile", run)

  def step_start(self, run: Run) -> None:
    self._call("step_start", run)

  @contextlib.contextmanager
  def step(self, run: Run):
    """`dispatch`, then the `step` contexts around the block."""
    self._call("dispatch", run)
    with contextlib.ExitStack() as stack:
      for context in self._calls["step"]:
        stack.enter_context(context(run))
      yield

  def step_end(self, run: Run) -> None:
    self._call("step_end", run)

  def save(self, run: Run) -> None:
    self._call("save", run)

  def fetch(self, run: Run) -> None:
    self._call("fetch", run)

  def log(self, run: Run) -> None:
    self._call("log", run)

  def eval(self, run: Run) -> None:
    self._call("eval", run)

  def eval_batch(self, run: Run) -> None:
    self._call("eval_batch", run)

  def write(self, run: Run) -> None:
    self._call("write", run)

  def stop(self, run: Run) -> None:
    self._call("stop", run)

  def end(self, run: Run) -> None:
    """Every subscriber's `end`, then every `closed`, even when one raises; the first error is raised after."""
    error = None
    for call in self._calls["end"] + self._calls["closed"]:
      try:
        call(run)
      except BaseException as e:  # noqa: BLE001 - the others still end; the first error goes on
        error = error or e
    if error is not None:
      raise error
