"""Preemption: SIGTERM / SIGINT stop the run cleanly.

Before the first training step has completed (while the model is built, the checkpoint restored or
the step compiled) there is nothing to save: the process exits at once, with EXIT_PREEMPTED (75)
for SIGTERM and EXIT_INTERRUPTED (130) for SIGINT, saying so in one stderr line. This also works
while the main thread is inside a long C++ call that runs no Python bytecode (a Python signal
handler would wait for it to return): Python's C-level handler writes the signal number to a wakeup
pipe (`signal.set_wakeup_fd`) and a watcher thread prints the line and calls `os._exit`. The watcher
needs the call to release the GIL, as XLA's compile and most long C calls do.

Once the trainer calls `step_started()`, a signal asks the run to save a checkpoint at the next
step boundary and exit with EXIT_PREEMPTED; rerunning the same command resumes. A second signal
acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM terminates). With several processes
(jax.distributed) JAX's preemption service owns SIGTERM from then on and all processes agree on
the step to stop at (`reached_preemption_sync_point`); SIGINT keeps its previous handler.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODES = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}

# Raw `struct sigaction` bytes, to hand SIGTERM back to a handler installed outside Python (JAX's
# preemption notifier, a C++ handler Python cannot reinstall). 512 bytes hold the struct on every
# Linux ABI (152 on x86-64 and aarch64 glibc); the handler pointer comes first.
_SIGACTION_BYTES = 512
_PTR = ctypes.sizeof(ctypes.c_void_p)


def _libc():
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc if hasattr(libc, "sigaction") else None
  except OSError:
    return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _raw_action(sig: int) -> bytes | None:
  """The current `struct sigaction` of `sig` as bytes (None where libc cannot be asked)."""
  if _LIBC is None:
    return None
  buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
  return buf.raw if _LIBC.sigaction(int(sig), None, buf) == 0 else None


def _set_raw_action(sig: int, raw: bytes) -> bool:
  buf = ctypes.create_string_buffer(raw, _SIGACTION_BYTES)
  return _LIBC is not None and _LIBC.sigaction(int(sig), buf, None) == 0


def _line_prefix() -> str:
  """`[process i/N host] ` in a multi-process run (maxlm.runtime.distributed wraps sys.stderr), else ''. The
  signal messages are written with os.write (no locks in a signal context), so they add it themselves."""
  return getattr(sys.stderr, "prefix", "")


def _flush_stdout(timeout: float = 1.0) -> None:
  """Flush stdout, but never wait on it for long (another thread may hold its lock)."""
  th = threading.Thread(target=lambda: sys.stdout.flush(), daemon=True)
  th.start()
  th.join(timeout)


class Preemption:
  """Create at the very start of a run (main thread; it does not touch JAX). `step_started()` once the
  first step has completed; `reached(step)` at every step boundary; `close()` restores the previous
  handlers. `signal` is the name of the signal received ("SIGTERM"/"SIGINT"), else None.

  `process_count`: the number of JAX processes, or None to ask JAX in `step_started()` (its backend is
  up by then). With more than one, SIGTERM goes back to JAX's preemption service after the first step.
  """

  def __init__(self, process_count: int | None = None):
    self.signal: str | None = None
    self._process_count = process_count
    self._multi = False
    self._started = False
    self._saving = True
    self._lock = threading.RLock()  # RLock: the main thread's handler may run inside step_started()
    self._previous: dict[int, object] = {}  # Python-level handlers to restore
    self._raw_before: dict[int, bytes | None] = {}  # raw actions before ours
    self._raw_ours: dict[int, bytes | None] = {}  # raw actions once ours are installed
    self._pipe: tuple[int, int] | None = None
    self._old_wakeup_fd = -1
    self._watcher: threading.Thread | None = None
    if threading.current_thread() is not threading.main_thread():
      return  # signal handlers can only be installed from the main thread
    for sig in SIGNALS:
      self._raw_before[sig] = _raw_action(sig)
      self._previous[sig] = signal.signal(sig, self._handle)
      self._raw_ours[sig] = _raw_action(sig)
    r, w = os.pipe()
    os.set_blocking(w, False)  # the C handler must never block on a full pipe
    self._pipe = (r, w)
    self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    self._watcher = threading.Thread(target=self._watch, args=(r,), name="maxlm-preemption", daemon=True)
    self._watcher.start()

  # --- before the first step: exit at once ------------------------------------------------------

  def _watch(self, fd: int) -> None:
    """Watcher thread: read signal numbers from the wakeup pipe until it is closed."""
    while True:
      try:
        data = os.read(fd, 64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum in EXIT_CODES:
          self._exit_before_first_step(signum)

  def _exit_before_first_step(self, signum: int) -> None:
    """Exit the process at once, unless the first step has completed (then the handler decides)."""
    with self._lock:
      if self._started:
        return
      name = signal.Signals(signum).name
      code = EXIT_CODES[signum]
      os.write(2, f"{_line_prefix()}maxlm: received {name} before the first training step: nothing to save; "
                  f"exiting with code {code}\n".encode())
      _flush_stdout()
      os._exit(code)

  # --- after the first step: save at the step boundary, then exit -----------------------------

  def _handle(self, signum, frame) -> None:
    self._exit_before_first_step(signum)  # returns only once the first step has completed
    self.signal = signal.Signals(signum).name
    then = ("saving a checkpoint at the end of this step, then exiting" if self._saving else
            "stopping at the end of this step (checkpointing is disabled: nothing will be saved), exiting")
    os.write(2, f"{_line_prefix()}maxlm: received {self.signal}: {then} with code {EXIT_PREEMPTED} "
                f"(send it again to stop at once)\n".encode())
    self.close()  # a second signal takes the previous (default) action

  def step_started(self, checkpointing: bool = True) -> None:
    """The first training step has completed: from now on a signal means "save, then exit".
    `checkpointing=False` only changes what the signal's message promises (nothing is saved)."""
    if self._started:
      return
    if self._process_count is None:
      import jax  # noqa: PLC0415 - constructing a Preemption must not touch JAX
      self._process_count = jax.process_count()
    with self._lock:
      self._multi = self._process_count > 1
      self._saving = checkpointing
      self._started = True
      if self._multi:  # JAX's notifier owns SIGTERM (see reached()); SIGINT: its previous handler
        self._restore(signal.SIGTERM)
        self._restore(signal.SIGINT)
    self._stop_watching()

  def reached(self, step: int) -> bool:
    """True at the step boundary where the run should save and exit (the same step on every process)."""
    if self._multi:
      from jax.experimental import multihost_utils  # noqa: PLC0415 - jax is imported by the trainer already
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = self.signal or "SIGTERM"
        return True
      return False
    return self.signal is not None

  # --- teardown ---------------------------------------------------------------------------------

  def _stop_watching(self) -> None:
    """End the watcher thread (never called with the lock held: the watcher may be waiting for it)."""
    pipe, self._pipe = self._pipe, None  # no call in between: a handler cannot run here and repeat it
    if pipe is None:
      return
    if threading.current_thread() is threading.main_thread():
      signal.set_wakeup_fd(self._old_wakeup_fd)
    r, w = pipe
    os.close(w)  # the watcher reads EOF and ends
    if self._watcher is not None and self._watcher is not threading.current_thread():
      self._watcher.join(timeout=5)
      if self._watcher.is_alive():
        return  # never close a descriptor it may still read (the number could be reused)
    os.close(r)

  def _restore(self, sig: int) -> None:
    """Give `sig` back to whoever had it before us. Python's table may not know that handler (JAX's
    preemption notifier is installed from C++; Python still reports SIG_DFL), so the raw `sigaction`
    seen before ours is put back when it differs. A handler installed over ours since is left alone."""
    if sig not in self._previous:
      return
    previous = self._previous.pop(sig)
    raw_before, raw_ours = self._raw_before.pop(sig, None), self._raw_ours.pop(sig, None)
    now = _raw_action(sig)
    if now is not None and raw_ours is not None and now[:_PTR] != raw_ours[:_PTR]:
      return  # someone replaced our handler since: theirs stays
    signal.signal(sig, signal.SIG_DFL if previous is None else previous)
    now = _raw_action(sig)
    if raw_before is not None and now is not None and now[:_PTR] != raw_before[:_PTR]:
      _set_raw_action(sig, raw_before)

  def close(self) -> None:
    """Restore the previous handlers and the wakeup fd (idempotent; main thread)."""
    with self._lock:
      for sig in list(self._previous):
        self._restore(sig)
    self._stop_watching()
