"""Preemption: SIGTERM / SIGINT ask the run to save a checkpoint at the next step boundary and exit.

The run then exits with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again"); rerunning the same command
resumes. A second signal acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM terminates).
With several processes (jax.distributed) JAX's preemption service owns SIGTERM and all processes
agree on the step to stop at (`reached_preemption_sync_point`).
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """Installs the handlers on creation (main thread only); `close()` restores the previous ones."""

  def __init__(self):
    import jax
    self.signal: str | None = None
    self._previous: dict[int, object] = {}
    self._multi = jax.process_count() > 1
    if self._multi or threading.current_thread() is not threading.main_thread():
      return  # several processes: JAX's notifier owns SIGTERM (see reached()); SIGINT stays as is
    for sig in SIGNALS:
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    self.signal = signal.Signals(signum).name
    os.write(2, f"maxlm: received {self.signal}: saving a checkpoint at the end of this step, then "
                f"exiting with code {EXIT_PREEMPTED} (send it again to stop at once)\n".encode())
    self.close()  # a second signal takes the previous (default) action

  def reached(self, step: int) -> bool:
    """True at the step boundary where the run should save and exit (the same step on every process)."""
    if self._multi:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = self.signal or "SIGTERM"
        return True
      return False
    return self.signal is not None

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
