"""The hang watchdog: a training process that stops making progress ends itself, so that the launcher
can requeue the job and it resumes from its last checkpoint.

A multi-process run hangs when one process stops (a frozen node, SIGSTOP) or stays alive but stuck (a
collective that never completes, a data read or a checkpoint write that blocks). The stuck process still
sends JAX's heartbeats, so every process would wait until the job's time limit; a stopped one makes
JAX's coordination service abort the others after its heartbeat timeout, with a C++ stack and exit 134
that no launcher acts on.

The trainer marks the points of its loop where the host is anyway with `arm(phase, step)` (a batch is
taken, a step is dispatched, metrics are fetched, a checkpoint is saved ...): the phase runs until the
next `arm`. One thread ("maxlm-watchdog") checks, once a second or at the phase's deadline if sooner, that
the current phase has not run past its limit. If it has, the thread writes the stack of every Python
thread to <run_dir>/watchdog/, prints one line

  maxlm: error: watchdog: <phase> at step N has taken X s (limit Y s: 10 x median step Z s, floor F s);
  stacks of every thread in <file>; exiting with code 76

and ends the process with EXIT_HUNG (76); launch/slurm requeues the job on it (launch/README.md).

No host sync is added: `arm` only records the phase (one tuple assignment) and the thread reads it.
With asynchronous dispatch the host waits for the device inside later phases (a metrics fetch, a
dispatch when the device's queue is full, a data read that asks the other processes), so a hang shows
as one of them not ending.

Limits, each from the run's own measurements, with train.watchdog_factor (F, 10) over the expected time and a
floor (the slow floor S = train.watchdog_first_step_s, 1800 s; the step floor P = train.watchdog_floor_s, 300 s):

* the step phases (data wait, dispatch, metrics fetch), once a step-time median is known (from the trainer's
  `step_time`, measured between two host syncs: the first comes after the first logged interval):
  max(P, F x median x n), n the steps dispatched since the host last waited for the device (each of them may
  still be running when the phase starts, and the phase may wait for all of them). Before a median is known
  (the first steps): S.
* compile (the train step, ahead of the first step): max(S, F x the longest compile known at start: the trace,
  lower and compile of an earlier start of this run (its first metrics row) or this start's planner, which
  compiled the step to measure it). Nothing known: S.
* restore: max(S, F x the state's bytes / the read bandwidth of a probe of the checkpoint directory).
* checkpoint save, the wait at a signal and at the end: max(S, F x one save x n), one save being the last save's
  own time (its start to its files written: `Checkpointer.last_write_s`), before any the state's bytes / the
  write bandwidth of the probe; n the saves the phase may wait for (one in flight, and its own).
* evaluation: every eval batch is its own phase (the loop arms it after each batch), so an evaluation of any
  length that makes progress is never stopped: max(P, F x median eval-batch time), S before one is timed (not
  the train step's median: an eval batch's read is not prefetched like the training data's); the first batch of
  the first evaluation compiles the eval step: the compile limit. An evaluation of N batches may so take up to
  N x its batch limit: F x eval-batch time x eval steps.

The probe (maxlm/checkpoint/disk.py) writes and reads back at most 16 MiB once at the start, on process 0, which
hands the numbers to the others. A probe that cannot run (a full disk) leaves the slow floor. `Limits` does the
arithmetic; the trainer prints its `describe()` at start.

Start-up. The train command starts the watchdog as soon as `distributed.initialize` returns (the join itself has
its own limit, distributed.initialization_timeout_s), so the window from there to the first step is watched
too: a peer stuck or stopped during start-up would otherwise hold every process until the job's time limit,
since JAX's heartbeat is raised to a day while the watchdog is on (HEARTBEAT_S). Its phases, each with the limit
`start_up_limit` derives from what the phase is expected to take:

* "start-up: plan": process 0 measures the plan.mode candidates (maxlm/plan/__init__.py `for_run`), each
  measurement one compile of the train step on abstract shapes, and re-arms the phase before each, with the limit
  `planned_compile_limit` derives from the compiles before it (maxlm/plan/clock.py; the first: the slow floor);
  the other processes wait for its decision (maxlm/runtime/agree.py) and re-arm theirs at each compile process 0
  begins;
* "start-up: data and state": the data inputs opened and checked, the run directory claimed (process 0) and
  the state built, which is one compile (its init) and one run;
* then the trainer's own phases from "restore" on (the first step's compile and run under the slow limit).

A compile is what these phases wait for, and the trainer already gives one compile, with everything around it
that has no step time yet, train.watchdog_first_step_s: so each start-up phase gets the same limit, and the
whole window is bounded by distributed.initialization_timeout_s + (compiles + 2) x train.watchdog_first_step_s
(the join, each of the planner's compiles, data and state, the first step); a waiting process's limit counts
from process 0's last sign of progress. No flat window: a planner that compiles 4 candidates has 4 phases.

`train.watchdog=auto` turns it on for runs of several processes, the ones a hang holds up and a launcher
requeues; a one-process run is often interactive (a notebook, a debugger paused on a breakpoint) and has
no peer to wait for: `train.watchdog=always` watches it too.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from maxlm.config import TrainConfig

EXIT_HUNG = 76  # after EX_TEMPFAIL (75, preempted): "try again", from the last checkpoint
SAMPLES = 101  # the median is over the last SAMPLES step times (odd: one middle value)
POLL_S = 1.0  # the thread wakes at least this often
STACKS_WRITE_S = 10.0  # a stuck file system may be the hang: then the stacks go to stderr instead
# JAX's heartbeat timeout while the watchdog is on (maxlm.runtime.distributed passes it): a stopped process is
# then caught by the watchdog of the others, whose exit code the launcher acts on, not by JAX's abort
# (with JAX's default, 100 s, the others aborted with exit 134 about 80 s after a peer was SIGSTOPped,
# seen on CPU with tests/test_launch.py's hang test and the watchdog off). A process that is gone or stopped is
# reported sooner by maxlm/runtime/peers.py (30 s without a heartbeat of maxlm's own), which JAX's must outlast too.
HEARTBEAT_S = 86400


def enabled(t: TrainConfig, process_count: int) -> bool:
  return t.watchdog == "always" or (t.watchdog == "auto" and process_count > 1)


def jax_heartbeat_s(t: TrainConfig, process_count: int) -> int | None:
  """The heartbeat timeout to give jax.distributed.initialize; None: JAX's default."""
  return HEARTBEAT_S if enabled(t, process_count) else None


class _Phase(NamedTuple):  # a NamedTuple: made 3 times a step, ~4x cheaper than a frozen dataclass
  name: str
  step: int
  start: float
  limit: float
  median: float | None  # None: a limit of its own (`how` says from what)
  in_flight: int
  how: str = ""


@dataclasses.dataclass(frozen=True)
class Limit:
  """A phase's limit in seconds and, for its line, what it came from."""
  seconds: float
  how: str


def scaled(factor: float, floor: float, floor_name: str, expected: float | None, what: str) -> Limit:
  """max(floor, factor x expected); the floor alone when nothing is measured (expected None)."""
  if expected is None:
    return Limit(floor, f"{floor_name}={floor:g} s, {what}")
  return Limit(max(floor, factor * expected), f"{factor:g} x {what} {expected:.3g} s, floor {floor:g} s")


class Limits:
  """The limits of the phases that are not steps (module doc), from what the run measured: `state_bytes` (what a
  save writes and a restore reads), `bandwidth` (write, read bytes/s of the probe; None: no probe) and
  `compile_s` (the longest compile known at start; None: none)."""

  def __init__(self, t: TrainConfig, state_bytes: int, bandwidth: tuple[float, float] | None,
               compile_s: float | None):
    self.factor, self.step_floor, self.floor = t.watchdog_factor, t.watchdog_floor_s, t.watchdog_first_step_s
    self.state_bytes, self.bandwidth, self.compile_s = state_bytes, bandwidth, compile_s
    self._eval: collections.deque[float] = collections.deque(maxlen=SAMPLES)
    self.eval_median: float | None = None

  def _slow(self, expected: float | None, what: str) -> Limit:
    return scaled(self.factor, self.floor, "train.watchdog_first_step_s", expected, what)

  def compile(self) -> Limit:
    return self._slow(self.compile_s, "the compile known at start" if self.compile_s is not None else
                      "no compile time known at start")

  def compiled(self, seconds: float) -> None:
    """This start's own trace, lower and compile of the train step (the eval step's first batch compiles)."""
    self.compile_s = max(self.compile_s or 0.0, seconds)

  def restore(self) -> Limit:
    if self.bandwidth is None:
      return self._slow(None, "no bandwidth measured")
    return self._slow(self.state_bytes / self.bandwidth[1], f"{_gb(self.state_bytes)} read at "
                      f"{_gb(self.bandwidth[1])}/s (probe):")

  def save(self, saves: int = 1, last_write_s: float | None = None) -> Limit:
    """A phase that may wait for `saves` saves; `last_write_s`: the last save's own time, if one finished."""
    n = f" x {saves} saves" if saves > 1 else ""
    if last_write_s is not None:
      return self._slow(last_write_s * saves, f"the last save's time{n}:")
    if self.bandwidth is None:
      return self._slow(None, "no bandwidth measured")
    return self._slow(self.state_bytes / self.bandwidth[0] * saves,
                      f"{_gb(self.state_bytes)} written at {_gb(self.bandwidth[0])}/s (probe){n}:")

  def eval_batch(self, first: bool) -> Limit:
    """The limit of one eval batch: `first` (the first batch of the first evaluation) compiles the eval step."""
    if first:
      return self.compile()
    if self.eval_median is None:
      return self._slow(None, "no eval batch timed yet")
    return scaled(self.factor, self.step_floor, "train.watchdog_floor_s", self.eval_median, "median eval batch")

  def eval_time(self, seconds: float) -> None:
    """One eval batch's measured time."""
    self._eval.append(seconds)
    self.eval_median = statistics.median(self._eval)

  def describe(self) -> str:
    """The limits at start, in one line."""
    save = self.save()
    return (f"watchdog: a phase ends the run (exit {EXIT_HUNG}) after {self.factor:g}x its expected time, at least "
            f"{self.floor:g} s (train.watchdog_first_step_s; steps and eval batches once timed: "
            f"{self.step_floor:g} s, train.watchdog_floor_s): compile {self.compile().seconds:.0f} s, restore "
            f"{self.restore().seconds:.0f} s, save {save.seconds:.0f} s (then from the last save's own time), step "
            f"{self.factor:g} x median step, eval batch {self.factor:g} x median eval batch")


def _gb(n: float) -> str:
  return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


class Watchdog:
  """Create with `start()`; `arm(phase, step)` at every host point of the loop, `step_time(s)` with
  every measured step time, `stop()` at the end. `exit` is for tests."""

  def __init__(self, t: TrainConfig, stack_dir: Path, process_index: int = 0, exit=os._exit):
    self.factor, self.floor_s, self.slow_s = t.watchdog_factor, t.watchdog_floor_s, t.watchdog_first_step_s
    self.stack_dir, self.process_index = Path(stack_dir), process_index
    self._exit = exit
    self._samples: collections.deque[float] = collections.deque(maxlen=SAMPLES)
    self.median: float | None = None
    self._in_flight = 0  # steps dispatched since the host last waited for the device
    self._phase: _Phase | None = None  # replaced whole: one assignment, atomic for the thread
    self._done = threading.Event()
    self._armed = threading.Event()  # the thread waits for the first phase
    self._thread = threading.Thread(target=self._watch, name="maxlm-watchdog", daemon=True)
    self._thread.start()

  def arm(self, phase: str, step: int | None = None, *, limit: Limit | None = None, dispatch: bool = False,
          sync: bool = False) -> None:
    """From now on the run is in `phase` of `step` (None: the step of the phase before). `limit`: the phase's
    own (`Limits`), else a step phase's. `dispatch`: the phase dispatches one more step; `sync`: it waits for
    every step dispatched so far (a fetch), so the phases after it start with none in flight."""
    step = (self._phase.step if self._phase else 0) if step is None else step
    self._in_flight += dispatch
    n = max(1, self._in_flight)
    if sync:
      self._in_flight = 0
    now = time.monotonic()
    if limit is not None:
      self._phase = _Phase(phase, step, now, limit.seconds, None, n, limit.how)
    elif self.median is None:
      self._phase = _Phase(phase, step, now, self.slow_s, None, n,
                           f"train.watchdog_first_step_s={self.slow_s:g} s, no step time is known yet")
    else:
      self._phase = _Phase(phase, step, now, max(self.floor_s, self.factor * self.median * n), self.median, n)
    if not self._armed.is_set():
      self._armed.set()

  @property
  def phase(self) -> _Phase | None:
    """The phase now timed (None once stopped)."""
    return self._phase

  def step_time(self, seconds: float | None) -> None:
    """One measured time per step (a logged interval's training time over its steps)."""
    if seconds is not None and seconds > 0:
      self._samples.append(seconds)
      self.median = statistics.median(self._samples)

  def stop(self) -> None:
    self._phase = None
    self._done.set()
    self._armed.set()

  # --- the thread ---------------------------------------------------------------------------------

  def _watch(self) -> None:
    self._armed.wait()
    while not self._done.is_set():
      phase = self._phase
      wait = POLL_S
      if phase is not None:
        late = time.monotonic() - phase.start - phase.limit
        if late >= 0 and self._phase is phase:
          self._fire(phase)
          return
        wait = min(POLL_S, max(-late, 0.001))
      self._done.wait(wait)

  def message(self, phase: _Phase, taken: float, stacks: str) -> str:
    if phase.median is None:
      how = phase.how
    else:
      steps = f" x {phase.in_flight} steps in flight" if phase.in_flight > 1 else ""
      how = f"{self.factor:g} x median step {phase.median:.3g} s{steps}, floor {self.floor_s:g} s"
    return (f"maxlm: error: watchdog: {phase.name} at step {phase.step} has taken {taken:.1f} s (limit "
            f"{phase.limit:.1f} s: {how}); stacks of every thread in {stacks}; exiting with code {EXIT_HUNG}")

  def _fire(self, phase: _Phase) -> None:
    taken = time.monotonic() - phase.start
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = self.stack_dir / f"stacks-process{self.process_index}-step{phase.step}-{stamp}.txt"
    failed = []

    def write() -> None:
      try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
          f.write(self.message(phase, taken, str(path)) + "\n\nthreads: " + ", ".join(
              f"0x{t.ident or 0:016x} {t.name}" for t in threading.enumerate()) + "\n\n")
          f.flush()
          faulthandler.dump_traceback(f, all_threads=True)
      except OSError as e:
        failed.append(e.strerror or str(e))

    writer = threading.Thread(target=write, name="maxlm-watchdog-stacks", daemon=True)
    writer.start()
    writer.join(STACKS_WRITE_S)
    where = str(path)
    if failed or writer.is_alive():  # an unwritable or stuck run directory: the stacks go to stderr
      why = failed[0] if failed else f"no answer within {STACKS_WRITE_S:g} s"
      where = f"stderr (cannot write {path}: {why})"
      faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
    prefix = getattr(sys.stderr, "prefix", "")  # `[process i/N host] ` (maxlm.runtime.process_output)
    os.write(2, f"{prefix}{self.message(phase, taken, where)}\n".encode())
    _flush_stdout()
    self._exit(EXIT_HUNG)


def _flush_stdout(timeout: float = 1.0) -> None:
  """Flush stdout, but never wait on it for long (the stuck thread may hold its lock)."""
  th = threading.Thread(target=lambda: sys.stdout.flush(), daemon=True)
  th.start()
  th.join(timeout)


class _Off:
  """The watchdog when it is off: every call does nothing."""
  median = None

  def arm(self, *a, **kw) -> None:
    pass

  def step_time(self, seconds) -> None:
    pass

  def stop(self) -> None:
    pass


OFF = _Off()  # stateless


def start_up_limit(t: TrainConfig) -> Limit:
  """The limit of a start-up phase (the module doc: one compile and what surrounds it, as the trainer's phases
  before a step time is known)."""
  return Limit(t.watchdog_first_step_s,
               f"train.watchdog_first_step_s={t.watchdog_first_step_s:g} s: a start-up phase is at most one compile "
               "and its set-up")


def planned_compile_limit(t: TrainConfig, expected: float | None) -> Limit:
  """The limit of one of the planner's compiles (a start-up phase): train.watchdog_factor x the seconds it is expected
  to take (maxlm/plan/clock.py: from the planner's compiles before it), at least train.watchdog_floor_s, as a step
  phase once its time is measured; the first, with nothing measured yet, the slow floor (`start_up_limit`)."""
  if expected is None:
    return start_up_limit(t)
  return scaled(t.watchdog_factor, t.watchdog_floor_s, "train.watchdog_floor_s", expected,
                "the compile expected from the planner's compiles before it")


def start(t: TrainConfig, run_dir: Path, process_index: int, process_count: int,
          phase: str | None = None) -> Watchdog | _Off:
  """The run's watchdog, armed for the start-up `phase` when one is given (the train command starts it at
  start-up, module doc), else waiting for the first `arm`; `OFF` when train.watchdog is off for this run."""
  if not enabled(t, process_count):
    return OFF
  wd = Watchdog(t, Path(run_dir) / "watchdog", process_index)
  if phase is not None:
    wd.arm(phase, 0, limit=start_up_limit(t))
  return wd
