"""Test-only entry point: `python tests/resume_launcher.py key=value ...` runs `maxlm.cli.train.main`
with hooks the checkpoint/resume tests need (never used outside tests).

Environment:
  MAXLM_TEST_FAKE_FP8=1      TE's GPU probe reports a Hopper GPU, so FP8 recipes run on CPU (pure JAX)
  MAXLM_TEST_TRACE=FILE      append one JSON line per train step: {"step", "batch": sha256 of the batch}
  MAXLM_TEST_STEP_SLEEP=SEC  sleep after every step (so a test can place signals and kills)
  MAXLM_TEST_STEP_GATE=FILE  before the second step, print "GATED" and wait while FILE exists (a test holds the
                             run in training, past its first step, for as long as it needs, then lets it go on)
  MAXLM_TEST_SLOW_SAVE=SEC[,FROM]  in the save thread, once all files are written and before the checkpoint
                             is committed, print "SAVE-COMMITTING <step>" and sleep (only the saves of step FROM on)
  MAXLM_TEST_NAN_STEPS=3,5   make the loss of those steps NaN (chosen by batch content)
  MAXLM_TEST_FSIZE_AFTER=N   saves after step N hit a 64 KiB file-size limit (EFBIG, like a full disk)
  MAXLM_TEST_READONLY_AFTER=N  before the first save after step N, remount the checkpoints directory
                             read-only (run under `unshare -m` with that directory bind-mounted on itself)
  MAXLM_TEST_DISTRIBUTED=ADDR,N,I  jax.distributed with N CPU processes (this one I; Gloo collectives)
  MAXLM_TEST_DATA_HANG=N,P   process P's N-th training batch read of this start blocks forever (a stuck
                             read: the hang watchdog's case), after printing "DATA-HANG <N>"
  MAXLM_TEST_EVAL_SLEEP=SEC  every eval batch read sleeps SEC first (an eval that is slow but progresses)
  MAXLM_TEST_EVAL_HANG=N     the N-th eval batch read of this start blocks forever, after "EVAL-HANG <N>"
  MAXLM_TEST_STORAGE=BPS[,N] the checkpoint storage writes BPS bytes per second (each write, the disk probe's
                             and every checkpoint's, takes its bytes / BPS more: `Trainer.slow_storage`); its
                             N-th write (the probe at the start is the first when the watchdog is on) never
                             ends, after "STORAGE-STUCK <N>"
  MAXLM_TEST_PLAN_COMPILES=S1,S2,...  the planner's i-th measurement (Target.measure: a compile of the step) takes Si
                             seconds instead ("hang": forever), after printing "PLAN-COMPILE <i>", and reports a
                             made-up peak: the first over the usable memory (the config as written does not fit),
                             the others at half of it
  MAXLM_TEST_STOP_IN=WHERE,P,DIR  process P stops itself (SIGSTOP, as a frozen node) where start-up reaches WHERE:
                             `plan` (the planner's decision begins) or `data` (the trainer opens its data), every
                             process having met at a barrier first and every other process having left it (a
                             file of its own in DIR, see `stop_at`), after printing "STOPPING <WHERE>"
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def compile_cache(path):
  """Share XLA executables between runs of the same program inside this block (JAX's persistent
  compilation cache in `path`, every compilation cached); the previous settings come back after."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  old = {k: getattr(jax.config, k) for k in keys}
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    for k, v in old.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


def fake_fp8_gpu() -> None:
  """Make TE's compute-capability probe report SM 9.0 and drop every cached answer."""
  from maxlm.layers.te_env import import_te
  import_te()
  import transformer_engine_jax
  from transformer_engine.jax.quantize import device_utils, helper
  transformer_engine_jax.get_device_compute_capability = lambda gpu_id=0: 90
  device_utils.get_device_compute_capability.cache_clear()
  device_utils.is_fp8_gemm_with_all_layouts_supported.cache_clear()
  helper._is_scaling_mode_supported = None


def batch_hash(batch) -> str:
  """sha256 of the batch this process can read: the whole batch, or in a run of several processes (an array over
  devices of other processes) this process's shards, in device order."""
  h = hashlib.sha256()
  for k in sorted(batch):
    x = batch[k]
    if getattr(x, "is_fully_addressable", True):
      parts = [np.asarray(x)]
    else:
      parts = [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]
    h.update(k.encode() + b"".join(np.ascontiguousarray(part).tobytes() for part in parts))
  return h.hexdigest()


def poisoned_losses(cfg, steps: list[int]):
  """A `maxlm.step.token_losses` whose loss is NaN (gradients stay finite) on the batches of `steps`
  (1-based, recognized by the sum of their targets)."""
  import jax.numpy as jnp

  from maxlm import step as step_lib
  from maxlm.data import make_train_iterator
  it = make_train_iterator(cfg.data, cfg.model.vocab_size, 0, 1)
  sums = [int(next(it)["targets"].astype(np.int64).sum()) for _ in range(max(steps) + 64)]
  it.close()
  bad = {sums[s - 1] for s in steps}
  assert not bad & {v for i, v in enumerate(sums) if i + 1 not in steps}, "batch sums collide"
  original = step_lib.token_losses

  def poisoned(logits, targets, mask):
    loss, n = original(logits, targets, mask)
    hit = jnp.isin(jnp.sum(targets), jnp.asarray(sorted(bad), jnp.int32))
    return loss + jnp.where(hit, jnp.nan, 0.0), n

  return poisoned


class BlockingData:
  """A training data iterator whose `n`-th batch read blocks forever."""

  def __init__(self, data, n: int):
    self._data, self._n, self._reads = data, n, 0

  def __iter__(self):
    return self

  def __next__(self):
    self._reads += 1
    if self._reads == self._n:
      print(f"DATA-HANG {self._n}", flush=True)
      threading.Event().wait()
    return next(self._data)

  def __getattr__(self, name):
    return getattr(self._data, name)


class SlowData:
  """A data iterator whose every read sleeps `sleep` s first and whose `hang`-th read (0: none) blocks forever."""

  def __init__(self, data, sleep: float, hang: int, reads: list):
    self._data, self._sleep, self._hang, self._reads = data, sleep, hang, reads

  def __iter__(self):
    return self

  def __next__(self):
    self._reads.append(1)  # counted over every iterator of this start (each evaluation makes a new one)
    if len(self._reads) == self._hang:
      print(f"EVAL-HANG {self._hang}", flush=True)
      threading.Event().wait()
    time.sleep(self._sleep)
    return next(self._data)

  def __getattr__(self, name):
    return getattr(self._data, name)


class SlowStorage:
  """A checkpoint storage of `bps` bytes per second whose `stuck`-th write (0: none) never ends."""

  def __init__(self, bps: float, stuck: int = 0):
    self.bps, self.stuck, self.writes = bps, stuck, 0

  def __call__(self, nbytes: int) -> None:
    self.writes += 1
    if self.writes == self.stuck:
      print(f"STORAGE-STUCK {self.writes}", flush=True)
      threading.Event().wait()
    time.sleep(nbytes / self.bps)


def stop_at(where: str, process: str, handshake: str) -> None:
  """MAXLM_TEST_STOP_IN: wrap the start-up call named by `where` so that process `process` SIGSTOPs itself there.
  Every process first meets the others at a barrier placed outside the watchdog phase the test is about: a
  barrier inside that phase would spend its limit waiting for the slower process, and the waiting process could
  run out there (two CI failures) instead of in its wait for process 0's answer. For `plan`, the barrier comes just
  before the start-up watchdog starts (its first phase is "start-up: plan"); for `data`, as the planner ends, just
  before the "data and state" phase is armed, the plan itself unwatched (under a phase of its own, of 120 s).
  Process 0 then stops as the planner begins, or as its trainer opens its data.

  The barrier's answers come from the coordination service, which runs inside process 0: process 0 can have its
  own answer and freeze before the service has sent the other processes theirs, and they then wait in the
  barrier, where no watchdog phase is armed yet (one `make test` run, 2026-12-07: process 1 still running 45 s
  after process 0 stopped, no watchdog line). So each process, once out of the barrier, writes a file of its own
  in `handshake`, a directory outside the coordination service, and the stopping process waits for every other
  process's file before it stops."""
  import jax

  from maxlm import plan, trainer
  from maxlm.runtime import watchdog

  def left(i: int) -> Path:
    return Path(handshake) / f"left-barrier-{where}-{i}"

  def meet():
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.wait_at_barrier(f"maxlm-test-stop-{where}", 120_000)
    left(jax.process_index()).touch()

  def stop():
    if jax.process_index() == int(process):
      end = time.monotonic() + 120
      while not all(left(i).exists() for i in range(jax.process_count())):
        assert time.monotonic() < end, f"the other processes never left the barrier (files in {handshake})"
        time.sleep(0.05)
      print(f"STOPPING {where}", flush=True)
      os.kill(os.getpid(), signal.SIGSTOP)

  for_run, make_train_iterator, start = plan.for_run, trainer.data_lib.make_train_iterator, watchdog.start
  if where == "plan":
    def meet_then_start(*a, **kw):
      meet()
      return start(*a, **kw)

    def stop_then_plan(*a, **kw):
      stop()
      return for_run(*a, **kw)
    watchdog.start = meet_then_start
    plan.for_run = stop_then_plan
  else:
    def planned_then_meet(cfg, say=None, watch=None):
      # the plan unwatched, under a phase of the test's own: this case is about the run directory's phase, and a
      # process 0 slowed in its planner by a loaded machine (one CI failure: 15 s) must not end process 1 there
      if watch is not None:
        watch.arm("test: plan, then every process meets", limit=watchdog.Limit(120, "the test's own phase"))
      out = for_run(cfg, say, None)
      meet()
      return out

    def stop_then_open(*a, **kw):
      stop()
      return make_train_iterator(*a, **kw)
    plan.for_run = planned_then_meet
    trainer.data_lib.make_train_iterator = stop_then_open


def plan_compiles(seconds: list) -> None:
  """MAXLM_TEST_PLAN_COMPILES: the planner's measurements take the given times (None: forever) and report made-up
  peaks, the first too big, the others fitting; the clock and the start-up watchdog's phase around them are the
  planner's own (Target.measure's hook and timing)."""
  from maxlm.plan import target as plan_target
  made: list[int] = []

  def slow_measure(self, cfg):
    i = len(made) + 1
    made.append(i)
    if self.on_measure is not None:
      self.on_measure(self.clock.expect(cfg))
    print(f"PLAN-COMPILE {i}", flush=True)
    began = time.monotonic()
    wait = seconds[min(i, len(seconds)) - 1]
    while wait is None:
      time.sleep(1)
    time.sleep(wait)
    self.clock.add(cfg, time.monotonic() - began)
    return {"device": self.usable + 1 if i == 1 else self.usable // 2, "how": "measured"}
  plan_target.Target.measure = slow_measure


def install_hooks(argv: list[str]) -> None:
  import jax

  from maxlm.checkpoint import manager as checkpoint
  from maxlm.trainer import Trainer
  trace = os.environ.get("MAXLM_TEST_TRACE")
  pause = float(os.environ.get("MAXLM_TEST_STEP_SLEEP", "0"))
  gate = os.environ.get("MAXLM_TEST_STEP_GATE")
  hang = os.environ.get("MAXLM_TEST_DATA_HANG")
  data_hang = [int(v) for v in hang.split(",")] if hang else None
  eval_sleep, eval_hang = float(os.environ.get("MAXLM_TEST_EVAL_SLEEP", "0")), int(os.environ.get(
      "MAXLM_TEST_EVAL_HANG", "0"))
  storage = [float(v) for v in os.environ.get("MAXLM_TEST_STORAGE", "").split(",") if v]
  build = Trainer.build

  def traced_build(self):
    build(self)
    if data_hang and data_hang[1] == jax.process_index():
      self.train_data = BlockingData(self.train_data, data_hang[0])
    if (eval_sleep or eval_hang) and self.eval_data_factory:
      factory, reads = self.eval_data_factory, []
      self.eval_data_factory = lambda: SlowData(factory(), eval_sleep, eval_hang, reads)
    if storage:
      self.slow_storage = SlowStorage(storage[0], int(storage[1]) if len(storage) > 1 else 0)
    inner = self.train_step

    def step(state, batch):
      if gate and int(state.step) == 1:
        print("GATED", flush=True)
        while os.path.exists(gate):
          time.sleep(0.05)
      if trace:
        row = {"step": int(state.step) + 1, "batch": batch_hash(batch)}
        with open(trace, "a") as f:
          f.write(json.dumps(row) + "\n")
      out = inner(state, batch)
      if pause:
        time.sleep(pause)
      return out
    self.train_step = step

  Trainer.build = traced_build
  slow, _, slow_from = os.environ.get("MAXLM_TEST_SLOW_SAVE", "0").partition(",")
  if float(slow):
    finalized = checkpoint.Checkpointer._on_finalized

    def slow_finalized(self):
      finalized(self)
      if self._pending is not None and self._pending >= int(slow_from or 0):
        print(f"SAVE-COMMITTING {self._pending}", flush=True)
        time.sleep(float(slow))
    checkpoint.Checkpointer._on_finalized = slow_finalized
  fsize_after = int(os.environ.get("MAXLM_TEST_FSIZE_AFTER", "-1"))
  if fsize_after >= 0:
    import resource
    import signal
    save = checkpoint.Checkpointer.save

    def limited_save(self, step, *a, **kw):
      if step > fsize_after:
        self.wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
      return save(self, step, *a, **kw)
    checkpoint.Checkpointer.save = limited_save
  readonly_after = int(os.environ.get("MAXLM_TEST_READONLY_AFTER", "-1"))
  if readonly_after >= 0:
    import subprocess
    save = checkpoint.Checkpointer.save

    def save_then_readonly(self, step, *a, **kw):
      if step > readonly_after and not getattr(self, "_test_readonly", False):
        self.wait()
        subprocess.run(["mount", "-o", "remount,bind,ro", str(self.directory)], check=True)
        self._test_readonly = True
      return save(self, step, *a, **kw)
    checkpoint.Checkpointer.save = save_then_readonly
  compiles = os.environ.get("MAXLM_TEST_PLAN_COMPILES")
  if compiles:
    plan_compiles([None if v == "hang" else float(v) for v in compiles.split(",")])
  stop_in = os.environ.get("MAXLM_TEST_STOP_IN")
  if stop_in:
    stop_at(*stop_in.split(",", 2))
  nan_steps = os.environ.get("MAXLM_TEST_NAN_STEPS")
  if nan_steps:
    from maxlm import step as step_lib
    from maxlm.config import load_config
    step_lib.token_losses = poisoned_losses(load_config(argv), [int(s) for s in nan_steps.split(",")])


if __name__ == "__main__":
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that gives up on this process asks for its stacks
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  args = sys.argv[1:]
  if os.environ.get("MAXLM_TEST_DISTRIBUTED"):
    import jax
    addr, n, i = os.environ["MAXLM_TEST_DISTRIBUTED"].split(",")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=addr, num_processes=int(n), process_id=int(i))
  if os.environ.get("MAXLM_TEST_FAKE_FP8") == "1":
    fake_fp8_gpu()
  install_hooks(args)
  from maxlm.cli.train import main
  sys.exit(main(args))
