"""SIGTERM / SIGINT handling (`maxlm.checkpoint.Preemption`), in subprocesses: before the first step
the process exits at once, even inside a long XLA compile; after `step_started()` the first signal
only asks for a save at the step boundary and a second one stops the process."""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from maxlm.checkpoint import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preemption

ROOT = Path(__file__).resolve().parent.parent

# The child builds the Preemption first (as maxlm.train does, before JAX starts), then either
# compiles a long program or declares its first step done and polls reached().
CHILD = r"""
import signal, sys, time
# As Python started from a terminal: a test run started in the background (`cmd &` in a script) hands its
# children SIGINT ignored, and the "second signal takes the previous action" check needs the default.
signal.signal(signal.SIGINT, signal.default_int_handler)
from maxlm.checkpoint import Preemption
from maxlm.runtime.env import backend_started
mode = sys.argv[1]
if mode == "foreign":  # a SIGTERM handler Python does not know about (as JAX's notifier, from C)
  import ctypes
  ctypes.CDLL(None).signal(15, ctypes.c_void_p(1))  # SIG_IGN, installed behind Python's back
p = Preemption(process_count=2 if mode == "foreign" else None)
assert not backend_started(), "Preemption() started the JAX backend"
if len(sys.argv) > 3:  # a multi-process run's `[process i/N host] ` line prefix
  from maxlm.runtime.process_output import prefix_output
  prefix_output(sys.argv[3])
if mode == "ccall":  # a long C call that, unlike XLA's compile, never lets a Python handler run
  import hashlib
  print("CALLING", flush=True)
  hashlib.pbkdf2_hmac("sha256", b"x", b"salt", int(sys.argv[2]))
  print("RETURNED", flush=True)
  sys.exit(0)
import jax
import jax.numpy as jnp
if mode == "compile":
  n = int(sys.argv[2])
  body = lambda i, x: jnp.sin(x) * (i + 1.0) + jnp.cos(x[::-1])
  lowered = jax.jit(lambda x: jax.lax.fori_loop(0, n, body, x, unroll=True)).lower(jnp.ones(16))
  print("COMPILING", flush=True)
  lowered.compile()
  print("COMPILED", flush=True)
  sys.exit(0)
if mode == "foreign":
  print("READY", flush=True)
  time.sleep(float(sys.argv[2]))
  p.step_started()
  print("STARTED", flush=True)
  time.sleep(2)
  print("ALIVE", flush=True)
  sys.exit(0)
p.step_started(checkpointing=sys.argv[2] == "1")
print("READY", flush=True)
end = time.monotonic() + 60
while not p.reached(7) and time.monotonic() < end:
  time.sleep(0.01)
print("REACHED", p.signal, flush=True)
time.sleep(60)
"""

# In jax 0.10 XLA's compile lets the main thread run Python signal handlers (the handler's frame is
# at `backend.compile_and_load`); a C call that does not (PBKDF2 in OpenSSL) checks the watcher thread.
# Unrolled ops in the compiled program: XLA:CPU compiles 4000 of them in ~17 s on this 2-core host
# (measured; compile time grows linearly), so a signal 1 s into the compile lands well inside it.
COMPILE_OPS = 4000
PBKDF2_ROUNDS = 40_000_000  # ~12 s here (5M rounds: 1.5 s, measured)
# The exit path (a pipe read, one write, _exit) takes milliseconds; 5 s covers a loaded host and is
# far below the rest of the compile (~16 s) that a process waiting for it would still need.
EXIT_WITHIN_S = 5.0


class Child:
  def __init__(self, tmp_path: Path, *args):
    name = f"{args[0]}-{args[1]}-{len(args)}"
    self.out, self.err = tmp_path / f"out-{name}.txt", tmp_path / f"err-{name}.txt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one device
    with open(self.out, "w") as out, open(self.err, "w") as err:
      self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], cwd=ROOT, env=env,
                                   stdout=out, stderr=err)

  def text(self) -> str:
    return f"stdout:\n{self.out.read_text()}\nstderr:\n{self.err.read_text()}"

  def wait_for(self, line: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while line not in self.out.read_text():
      assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {line!r}:\n{self.text()}"
      assert time.monotonic() < end, f"no {line!r}:\n{self.text()}"
      time.sleep(0.01)

  def exit_code(self, timeout: float):
    try:
      return self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
      return None


@pytest.mark.parametrize("mode,sig,code", [("compile", signal.SIGTERM, EXIT_PREEMPTED),
                                           ("compile", signal.SIGINT, EXIT_INTERRUPTED),
                                           ("ccall", signal.SIGTERM, EXIT_PREEMPTED)])
def test_signal_before_first_step_exits_at_once_even_inside_cpp(tmp_path, mode, sig, code):
  child = Child(tmp_path, mode, COMPILE_OPS if mode == "compile" else PBKDF2_ROUNDS)
  child.wait_for("COMPILING" if mode == "compile" else "CALLING")
  time.sleep(1.0)
  t0 = time.monotonic()
  child.proc.send_signal(sig)
  rc = child.exit_code(EXIT_WITHIN_S)
  took = time.monotonic() - t0
  assert rc == code, f"exit {rc} after {took:.1f} s (want {code} within {EXIT_WITHIN_S} s):\n{child.text()}"
  out = child.out.read_text()
  assert "COMPILED" not in out and "RETURNED" not in out, "the call ended before the signal: make it longer"
  name = signal.Signals(sig).name
  assert child.err.read_text().splitlines() == [
      f"maxlm: received {name} before the first training step: nothing to save; exiting with code {code}"]


@pytest.mark.parametrize("sig,checkpointing,prefix", [(signal.SIGTERM, True, ""), (signal.SIGINT, False, ""),
                                                     (signal.SIGTERM, True, "[process 2/2 gpu7] ")])
def test_after_first_step_a_signal_sets_the_flag_and_a_second_stops(tmp_path, sig, checkpointing, prefix):
  """The message carries the process prefix of a multi-process run like every other line."""
  child = Child(tmp_path, "started", int(checkpointing), *([prefix] if prefix else []))
  child.wait_for("READY")
  child.proc.send_signal(sig)
  name = signal.Signals(sig).name
  child.wait_for(f"REACHED {name}", timeout=30)
  assert child.proc.poll() is None
  then = ("saving a checkpoint at the end of this step, then exiting" if checkpointing else
          "stopping at the end of this step (checkpointing is disabled: nothing will be saved), exiting")
  assert child.err.read_text().splitlines() == [
      f"{prefix}maxlm: received {name}: {then} with code {EXIT_PREEMPTED} (send it again to stop at once)"]
  child.proc.send_signal(sig)  # the previous (default) action: terminate / KeyboardInterrupt
  assert child.exit_code(30) == -sig, child.text()


def test_foreign_sigterm_handler_is_handed_back_after_the_first_step(tmp_path):
  """With several processes JAX's notifier (a C handler Python cannot see) owns SIGTERM after the
  first step. Simulated with SIG_IGN installed through libc: before step_started() SIGTERM still
  exits at once; afterwards the ignoring handler is back and the process survives SIGTERM."""
  child = Child(tmp_path, "foreign", 60)
  child.wait_for("READY")
  child.proc.send_signal(signal.SIGTERM)
  assert child.exit_code(EXIT_WITHIN_S) == EXIT_PREEMPTED, child.text()
  child = Child(tmp_path, "foreign", 0)
  child.wait_for("STARTED")
  child.proc.send_signal(signal.SIGTERM)
  assert child.exit_code(30) == 0, child.text()
  assert "ALIVE" in child.out.read_text()


def _raw_handler(sig: int) -> bytes:
  buf = ctypes.create_string_buffer(512)  # >= sizeof(struct sigaction) on Linux
  assert ctypes.CDLL(None).sigaction(sig, None, buf) == 0
  return buf.raw[:ctypes.sizeof(ctypes.c_void_p)]


def test_close_restores_handlers_and_wakeup_fd():
  sigs = (signal.SIGTERM, signal.SIGINT)
  before, raw = {s: signal.getsignal(s) for s in sigs}, {s: _raw_handler(s) for s in sigs}
  wakeup = signal.set_wakeup_fd(-1)
  signal.set_wakeup_fd(wakeup)
  p = Preemption()
  assert all(signal.getsignal(s) != before[s] for s in sigs)
  assert [t for t in threading.enumerate() if t.name == "maxlm-preemption"]
  p.close()
  p.close()  # idempotent
  assert {s: signal.getsignal(s) for s in sigs} == before and {s: _raw_handler(s) for s in sigs} == raw
  assert signal.set_wakeup_fd(wakeup) == wakeup
  assert not [t for t in threading.enumerate() if t.name == "maxlm-preemption"]
