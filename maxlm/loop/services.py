"""The training loop's services, each a subscriber of the loop's hooks (maxlm/loop/hooks.py): the hang watchdog,
the profiler, the metrics (start-up timing, rows, metrics.jsonl and the progress line), preemption, the non-finite
checks and checkpointing. `subscribe` makes them for one run, in the order the hooks call them."""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxlm import data as data_lib
from maxlm.checkpoint import EXIT_PREEMPTED, Preemption, disk
from maxlm.checkpoint import complete_steps
from maxlm.checkpoint import run_dir as run_dirs
from maxlm.checkpoint.manager import gather_json
from maxlm.config import Config, ConfigError, dump_yaml, to_dict
from maxlm.errors import RunFailure
from maxlm.loop.hooks import Hooks, Run
from maxlm.metrics import MetricsWriter, device_peak_flops, echo, progress_line, throughput
from maxlm.model import count_params, flops_per_step
from maxlm.optim import warmup_warning
from maxlm.profiling import Profiler
from maxlm.runtime import agree, compile_cache, watchdog
from maxlm.runtime.devices import mesh_placement, peak_memory_gb
from maxlm.runtime.startup import Startup, first_step_line


class RunError(RunFailure, RuntimeError):
  """A run-time failure with a one-line message (e.g. non-finite loss with train.nonfinite=stop)."""


class WatchdogService:
  """Arms the hang watchdog (maxlm/runtime/watchdog.py) for each phase of the loop, with the limits of the slow
  phases from this run's measurements (`watchdog.Limits`: a disk probe, the compile times known, the saves and
  eval batches timed as they happen); feeds it the step times."""

  def __init__(self, cfg: Config, wd, startup: Startup):
    self.on = watchdog.enabled(cfg.train, jax.process_count())
    self.wd, self.startup = wd, startup  # started at start-up by the train command (maxlm/cli/train.py)
    self.limits: watchdog.Limits | None = None
    self.eval_compiled, self.eval_batches, self.t_batch = False, 0, 0.0

  def begin(self, run: Run) -> None:
    self.wd.arm("disk probe", 0)  # the probe writes to the checkpoint storage, which may be the one stuck
    self.limits = measure_limits(run, probe=self.on, plan_s=self.startup.plan_s())
    if self.on and run.is_main:
      echo(f"maxlm: {self.limits.describe()}")
    self.wd.arm("restore", 0, limit=self.limits.restore())

  def compile(self, run: Run) -> None:
    self.wd.arm("compile", run.done + 1, limit=self.limits.compile())

  def step_start(self, run: Run) -> None:
    if run.done == run.start_step:  # the first step of this start: its step is compiled (`compile`)
      # every process waits for the others, so that the first step's collectives start together: a process that
      # compiled from scratch while another loaded from the cache is no stuck peer (maxlm/runtime/agree.py)
      agree.barrier("first step", self.wd, "start-up: every process at the first step",
                    watchdog.start_up_limit(run.cfg.train))
    self.wd.arm("data wait", run.done + 1)

  def dispatch(self, run: Run) -> None:
    self.wd.arm("step dispatch", run.done + 1, dispatch=True)  # the host waits here when the queue is full

  def step_end(self, run: Run) -> None:
    if run.done == run.start_step + 1:  # this start's own compile of the train step
      step = run.trainer.jitted_train_step
      self.limits.compiled((step.lower_s or 0.0) + (step.compile_s or 0.0))

  def save(self, run: Run) -> None:  # it waits for a save in flight first
    self.wd.arm("checkpoint save", run.done, limit=self._save_limit(run, 1 + run.ckpt.in_flight))

  def fetch(self, run: Run) -> None:
    self.wd.arm("metrics fetch", run.done, sync=True)

  def log(self, run: Run) -> None:
    self.wd.step_time(run.row["step_time"])

  def eval(self, run: Run) -> None:
    self.eval_batches = 0
    self._arm_eval_batch(run)

  def eval_batch(self, run: Run) -> None:
    """After each eval batch: its time (but the one that compiled the eval step), and the next one armed."""
    if self.eval_compiled:
      self.limits.eval_time(time.monotonic() - self.t_batch)
    self.eval_compiled = True
    self._arm_eval_batch(run)

  def _arm_eval_batch(self, run: Run) -> None:
    self.eval_batches += 1
    self.t_batch = time.monotonic()
    self.wd.arm(f"evaluation batch {self.eval_batches}", run.done,
                limit=self.limits.eval_batch(first=not self.eval_compiled))

  def stop(self, run: Run) -> None:
    if run.ckpt is not None:
      self.wd.arm("checkpoint save", run.done, limit=self._save_limit(run, 1))

  def end(self, run: Run) -> None:
    if run.ckpt is not None and self.limits is not None:
      self.wd.arm("checkpoint close", limit=self._save_limit(run, 1))

  def closed(self, run: Run) -> None:
    self.wd.stop()

  def _save_limit(self, run: Run, saves: int) -> watchdog.Limit:
    return self.limits.save(saves, run.ckpt.last_write_s)


def measure_limits(run: Run, probe: bool, plan_s: float) -> watchdog.Limits:
  """The watchdog's limits for this run: the state's bytes, with `probe` the checkpoint directory's bandwidth
  (process 0 measures, every process uses its numbers), the longest compile known at start (the first row of
  each earlier start of this run; this start's planner, which compiled the step)."""
  cfg, trainer = run.cfg, run.trainer
  nbytes = disk.state_bytes(trainer.state)
  bandwidth = None
  if probe and cfg.checkpoint.enabled:
    ckpt_dir = cfg.run_dir / "checkpoints"
    size = min(disk.probe_size(nbytes), disk.free_bytes(ckpt_dir) // 10)
    bandwidth = _from_process_0(lambda: disk.probe(ckpt_dir, size, trainer.slow_storage) if size > 0 else None)
  known = [*run_dirs.compile_times(cfg.run_dir), plan_s]
  return watchdog.Limits(cfg.train, nbytes, bandwidth, max(known) if any(known) else None)


def _from_process_0(measure) -> tuple[float, float] | None:
  """`measure()` on process 0, handed to every process (a collective when there are several)."""
  value = measure() if jax.process_index() == 0 else None
  if jax.process_count() == 1:
    return value
  got = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value or (0.0, 0.0), np.float32)))
  return (float(got[0]), float(got[1])) if got[0] > 0 else None


class ProfilerService:
  """The profiling window (maxlm/profiling.py): a step range around every dispatch."""

  def __init__(self, cfg: Config, is_main: bool):
    self.profiler = Profiler(cfg.profile, cfg.run_dir, is_main, echo=echo)

  def step(self, run: Run):
    return self.profiler.step(run.done + 1)  # opens the window at its first step

  def step_end(self, run: Run) -> None:
    self.profiler.step_done(run.done, run.metrics)  # closes the window after its last step

  def end(self, run: Run) -> None:
    self.profiler.close()  # a run that stops inside the window still writes its trace


class MetricsService:
  """The start line, config.yml, the time to the first step, and every metrics row: measured, written to
  metrics.jsonl and TensorBoard (maxlm/metrics.py) and printed."""

  def __init__(self, cfg: Config, startup: Startup):
    self.startup = startup
    d = cfg.data
    self.tokens_per_step = d.global_batch_size * d.seq_len
    self.flops = flops_per_step(cfg.model, d.global_batch_size, d.seq_len)
    self.peak = device_peak_flops(jax.devices()[0].device_kind)
    self.flops_known = jax.devices()[0].platform != "cpu"
    self.writer = None
    self.t_last = self.t_train0 = None  # the end of the last logged interval; of the first step
    self.steps_since = self.steps_timed = 0
    self.first_step: dict | None = None  # the first row's start-up fields

  def begin(self, run: Run) -> None:
    if run.is_main:  # progress and run lines come from process 0 only; warnings and errors from any process
      echo(start_line(run.cfg, run.trainer, count_params(run.cfg.model)["total"], jax.devices()[0].device_kind))
      if jax.process_count() > 1:
        echo(f"maxlm: {mesh_placement(run.trainer.mesh)}")

  def started(self, run: Run) -> None:
    cfg, t = run.cfg, run.cfg.train
    if run.is_main:  # only now is the run known to start (a checkpoint that does not fit has stopped it)
      kept = run_dirs.record_config(cfg.run_dir, dump_yaml(cfg), run.start_step)
      if kept is not None:
        echo(f"maxlm: the config of the steps up to {run.start_step} is kept as {kept.name} (every change: "
             f"config_history.jsonl); config.yml is this start's")
    if run.start_step >= t.steps and run.is_main:
      echo(f"maxlm: {cfg.run_dir} is already at step {run.start_step} of train.steps={t.steps}: nothing to train "
           f"(more steps: train.steps=N; a new run: run_name=...)")
    self.writer = MetricsWriter(cfg.run_dir, enabled=run.is_main, start_step=run.start_step)
    self.startup.mark("state")

  def step_end(self, run: Run) -> None:
    self.steps_since += 1
    if self.t_last is None:  # the first step (compiled before the loop): report it, time from its end
      jax.block_until_ready(run.metrics)
      self.t_last = self.t_train0 = time.perf_counter()
      self.steps_since = 0
      self.first_step = _first_step(run.trainer, self.startup, run.done, self.t_last, run.cache_hit, run.is_main)

  def fetch(self, run: Run) -> None:
    metrics = jax.device_get(run.metrics)
    # training time only: checkpoint saves are reported as save_s
    row = _row(metrics, self.steps_since, time.perf_counter() - self.t_last - run.paused, self.tokens_per_step,
               self.flops, run.trainer.n_devices, self.peak)
    self.steps_timed += self.steps_since
    if run.paused:
      row["save_s"] = run.paused
    if self.first_step is not None:
      row.update(self.first_step)
      self.first_step = None
    row["peak_memory_gb"] = peak_memory_gb()
    run.metrics, run.row = metrics, row

  def write(self, run: Run) -> None:
    t, row = run.cfg.train, run.row
    now = time.perf_counter()
    row["elapsed_s"] = now - self.startup.t0
    if self.steps_timed:
      row["eta_s"] = (t.steps - run.done) * (now - self.t_train0) / self.steps_timed
    self.writer.write(run.done, row)
    if run.is_main:
      echo(progress_line(run.done, t.steps, row, flops_known=self.flops_known))
    self.t_last, self.steps_since, run.paused = time.perf_counter(), 0, 0.0

  def end(self, run: Run) -> None:
    if self.writer is not None:
      self.writer.close()


class PreemptionService:
  """SIGTERM/SIGINT (maxlm/checkpoint/preemption.py): from the first step on, a signal sets `run.stop` at the
  next step boundary (the same one on every process)."""

  def __init__(self, preemption: Preemption):
    self.preemption = preemption

  def step_end(self, run: Run) -> None:
    if run.done == run.start_step + 1:  # a signal means "save" once the first step has completed
      jax.block_until_ready(run.metrics)
      self.preemption.step_started(checkpointing=run.ckpt is not None)
    run.stop = self.preemption.reached(run.done)
    if run.stop:
      run.signal = self.preemption.signal


class NonFiniteService:
  """train.nonfinite: with stop, no checkpoint past a skipped update and an error at the first one logged;
  with skip, a warning for the updates skipped since the last row."""

  def __init__(self, cfg: Config):
    self.stop_mode = cfg.train.nonfinite == "stop"
    self.checked = self.skipped = self.logged = 0

  def started(self, run: Run) -> None:
    self.checked = run.start_step
    self.skipped = self.logged = int(jax.device_get(run.trainer.state.nonfinite_steps))

  def save(self, run: Run) -> None:
    if self.stop_mode:  # never checkpoint past a skipped update
      self.checked = _check_finite(jax.device_get(run.metrics), self.checked, self.skipped, run.done, run.ckpt)

  def log(self, run: Run) -> None:
    row = run.row
    if self.stop_mode:
      self.checked = _check_finite(run.metrics, self.checked, self.skipped, run.done, run.ckpt)
    elif row["nonfinite_steps"] > self.logged and run.is_main:  # the same count on every process
      echo(f"maxlm: warning: {row['nonfinite_steps'] - self.logged} update(s) skipped for a non-finite "
           f"loss or gradient up to step {run.done} ({row['nonfinite_steps']} in all; last loss "
           f"{row['loss']}, grad norm {row['grad_norm']})")
      self.logged = row["nonfinite_steps"]


class CheckpointService:
  """Checks the disk before the first step (maxlm/checkpoint/disk.py), saves when due (maxlm/checkpoint/manager.py:
  it checks the free space again before each save), reports finished background saves, waits for the save in
  flight at a signal and at the end."""

  def check(self, run: Run) -> None:
    cfg = run.cfg
    if not cfg.checkpoint.enabled:
      return
    ckpt_dir = cfg.run_dir / "checkpoints"
    try:
      warning = disk.check_start(cfg.checkpoint, cfg.train, cfg.output_dir, ckpt_dir,
                                 disk.state_bytes(run.trainer.state), complete_steps(ckpt_dir))
      error = ""
    except ConfigError as e:
      warning, error = "", str(e)
    refused = [m for m in gather_json(error) if m]  # every process stops, or none
    if refused:
      raise ConfigError(refused[0])
    if warning and run.is_main:
      echo(f"maxlm: warning: {warning}")

  def step_end(self, run: Run) -> None:
    if run.ckpt is not None and not run.save_due:
      run.ckpt.poll()

  def save(self, run: Run) -> None:
    trainer = run.trainer
    jax.block_until_ready(trainer.state)  # the step's own time stays training time
    t0 = time.perf_counter()
    run.ckpt.save(run.done, trainer.state, run.batches.position(), to_dict(run.cfg))
    run.paused += time.perf_counter() - t0

  def stop(self, run: Run) -> None:
    if run.ckpt is not None:
      run.ckpt.wait()
    echo(_preempted_line(run.signal, run.done, run.ckpt))

  def end(self, run: Run) -> None:
    if run.ckpt is not None:
      run.ckpt.close()  # waits for the save in flight


def subscribe(run: Run, preemption: Preemption, startup: Startup, wd) -> Hooks:
  """The services of one run, in the order the hooks call them: the watchdog first (it times each point's work),
  preemption before the first-step line (a test, and a user, may signal the run as soon as it is printed) and
  before checkpointing (a signal makes a save due), the non-finite check before a save. `wd`: the run's watchdog,
  started at start-up (maxlm/runtime/watchdog.py `start`)."""
  cfg = run.cfg
  return Hooks(WatchdogService(cfg, wd, startup), ProfilerService(cfg, run.is_main), PreemptionService(preemption),
               MetricsService(cfg, startup), NonFiniteService(cfg), CheckpointService())


def start_line(cfg: Config, trainer, n_params: int, kind: str) -> str:
  m = cfg.model
  # precision bf16 quantizes nothing: with model.dtype=float32 everything computes in fp32
  precision = "fp32" if (m.precision, m.dtype) == ("bf16", "float32") else m.precision
  warmup = warmup_warning(cfg.optim, cfg.train.steps)
  return (f"maxlm: {m.name} ({n_params / 1e6:.1f}M params, backend={trainer.backend}, precision={precision}) on "
          f"{jax.device_count()} x {kind}, mesh {dict(trainer.mesh.shape)}, run dir {cfg.run_dir}\n"
          f"maxlm: {data_lib.start_line(trainer.train_data.info, cfg.data)}"  # what the batches are made of
          + (f"\nmaxlm: warning: {warmup}" if warmup else ""))


def _first_step(trainer, startup: Startup, done: int, t_first: float, hit: bool, is_main: bool) -> dict:
  """The first-step lines (the time to it in parts; the compilation cache) and the fields of the first row."""
  step = trainer.jitted_train_step
  parts = startup.parts(t_first, step.lower_s, step.compile_s)
  if is_main:
    echo(first_step_line(done, parts, peak_memory_gb(), step.compiled_memory_gb))
    echo(f"maxlm: {compile_cache.step_line(hit, step.compile_s, step.loaded, step.background_s)}")
  return {"first_step_s": parts["startup_s"], **parts, "compile_cache_hit": hit, "warm_start": step.loaded,
          "warm_load_background_s": step.background_s,
          **compile_cache.stats(),
          "compiled_memory_gb": step.compiled_memory_gb}


def _row(metrics: dict, steps: int, seconds: float, tokens_per_step: int, flops: float, n_devices: int,
         peak: float | None) -> dict:
  """A metrics row from the fetched step metrics and the `steps` trained in `seconds` since the last row."""
  row = {k: float(v) for k, v in metrics.items() if k not in ("finite", "tokens")}
  row["nonfinite_steps"] = int(metrics["nonfinite_steps"])
  if "overflow_steps" in metrics:  # fp16 loss scaling: skips for overflow, not non-finite steps
    row["overflow_steps"] = int(metrics["overflow_steps"])
  if steps:
    row.update(throughput(tokens_per_step * steps, flops * steps, seconds, n_devices, peak))
    row["step_time"] = seconds / steps
  else:
    row.update({"tokens_per_sec": None, "tflops_per_device": None, "mfu": None, "step_time": None})
  return row


def _preempted_line(signal_name: str, done: int, ckpt) -> str:
  if ckpt is not None:
    return (f"maxlm: {signal_name} at step {done}: checkpoint step {done} saved in {ckpt.directory}; exiting "
            f"with code {EXIT_PREEMPTED} (rerun the same command to resume)")
  return (f"maxlm: {signal_name} at step {done}: nothing was saved (checkpoint.enabled=false), so a rerun "
          f"starts again from step 0; exiting with code {EXIT_PREEMPTED}")


def _check_finite(metrics: dict, checked: int, skipped: int, done: int, ckpt) -> int:
  """train.nonfinite=stop: raise RunError if an update after step `checked` was skipped; else `done`."""
  if int(metrics["nonfinite_steps"]) == skipped:
    return done
  if bool(metrics["finite"]):
    where = f"between steps {checked + 1} and {done}"
  else:
    where = f"at step {done} (loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])})"
  kept = "no checkpoint was written"
  if ckpt is not None and ckpt.latest is not None:
    kept = f"the last good checkpoint is step {ckpt.latest} in {ckpt.directory}"
  raise RunError(f"non-finite loss or gradient {where}; the update was not applied; {kept}")
