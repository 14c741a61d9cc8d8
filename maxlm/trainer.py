"""The training run: `Trainer` owns the mesh, model, state, data and jitted steps; `train()` drives it.

Order of a run, so that bad input stops before anything is written: check everything that can be
checked (backend and precision, mesh and batch split, a memory lower bound, every data input, the
output directory), then create the run directory, build the state, resume from checkpoints, train.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from maxlm import data as data_lib
from maxlm import evaluate
from maxlm import plan as planner
from maxlm.batches import Batches
from maxlm.checkpoint import EXIT_PREEMPTED, CheckpointError, Preemption
from maxlm.checkpoint import run_dir as run_dirs
from maxlm.checkpoint import start as start_checkpoints
from maxlm.config import Config, ConfigError, DataConfig, TrainConfig, dump_yaml, to_dict
from maxlm.errors import RunFailure
from maxlm.layers import PrecisionError, check_precision, check_remat, resolve_backend
from maxlm.mesh import check_context_split, make_mesh
from maxlm.metrics import MetricsWriter, device_peak_flops, echo, progress_line, throughput
from maxlm.model import Transformer, count_params, flops_per_step
from maxlm.optim import make_optimizer, warmup_warning
from maxlm.pipeline import check as check_pipeline
from maxlm.profiling import Profiler
from maxlm.runtime import compile_cache, warm_start, watchdog
from maxlm.runtime.devices import mesh_placement, peak_memory_gb
from maxlm.runtime.startup import Startup, first_step_line
from maxlm.scope import model_scope
from maxlm.sharding import batch_sharding, replicated
from maxlm.step import jit_step, make_eval_step, make_train_step
from maxlm.train_state import abstract_state, create_train_state


class RunError(RunFailure, RuntimeError):
  """A run-time failure with a one-line message (e.g. non-finite loss with train.nonfinite=stop)."""


def _check_writable(run_dir: Path) -> None:
  """Stop with one line when the run directory cannot be created or written (read-only output_dir)."""
  probe = run_dir if run_dir.exists() else next(p for p in run_dir.parents if p.exists())
  try:
    probe_file = probe / f".maxlm-write-test-{os.getpid()}"
    probe_file.write_bytes(b"")
    probe_file.unlink()
  except OSError as e:
    raise ConfigError(f"output_dir: cannot write the run directory {run_dir} ({e.strerror or e} in "
                      f"{probe}); set output_dir to a writable place") from None


def check_batch_split(d: DataConfig, t: TrainConfig, mesh_shape) -> None:
  """ConfigError unless each micro-batch splits evenly over the data-parallel devices (data x fsdp)."""
  dp = mesh_shape["data"] * mesh_shape["fsdp"]
  micro = d.global_batch_size // t.grad_accum
  if micro % dp:
    raise ConfigError(f"data.global_batch_size={d.global_batch_size} gives micro-batches of {micro} rows "
                      f"(train.grad_accum={t.grad_accum}), not divisible by the {dp} data-parallel devices "
                      f"(mesh data={mesh_shape['data']} x fsdp={mesh_shape['fsdp']}); use a "
                      f"multiple of {dp * t.grad_accum}")


class Trainer:
  """Owns the mesh, model, state, data and jitted steps of one run; `train()` drives it."""

  def __init__(self, cfg: Config):
    self.cfg = cfg
    self.backend = resolve_backend(cfg.model.backend)
    check_precision(cfg.model.precision, self.backend)
    check_remat(cfg.model.remat, self.backend)
    self.mesh = make_mesh(cfg.mesh)
    check_pipeline(cfg.model, cfg.train, cfg.mesh, self.mesh.shape["pipeline"])
    self._check_batch_split()
    # plan.mode (maxlm/plan/__init__.py): levers measured by XLA replace the config's where it plans; it checks the fit
    t_plan = time.perf_counter()
    cfg = self.cfg = planner.for_run(cfg, echo if jax.process_index() == 0 else None)
    self.plan_s = time.perf_counter() - t_plan  # its compiles: a part of the time to the first step
    planner.remember(self)  # for the out-of-memory line (maxlm/cli/train.py)
    if warm_start.active():  # the config is final: load the executables kept by the last start, in the background
      warm_start.prefetch(warm_start.run_signature(cfg))
    self.packed = cfg.data.type != "synthetic"  # real documents are packed: attention stays inside each
    self.model = Transformer(cfg.model, max_segments=cfg.data.max_segments_per_row,
                             context_strategy=cfg.mesh.context_strategy, stages=self.mesh.shape["pipeline"],
                             microbatches=cfg.train.grad_accum)
    pi, pc = jax.process_index(), jax.process_count()
    self.train_data = data_lib.make_train_iterator(cfg.data, cfg.model.vocab_size, pi, pc)
    self.eval_data_factory = None
    if cfg.train.eval_every > 0:
      self.eval_data_factory = lambda: data_lib.make_eval_iterator(cfg.data, cfg.model.vocab_size, pi, pc)
      probe = self.eval_data_factory()  # opens and checks every eval input now, not at the first eval
      if probe is None:
        self.eval_data_factory = None
      else:
        probe.close()

  def _check_batch_split(self) -> None:
    check_batch_split(self.cfg.data, self.cfg.train, self.mesh.shape)
    check_context_split(self.cfg.data.seq_len, self.mesh.shape["context"])

  def scope(self):
    """Mesh + logical axis rules + TE autocast (maxlm/scope.py): entered for init and for every trace."""
    return model_scope(self.cfg.model, self.backend, self.mesh)

  def build(self, abstract: bool = False):
    """The optimizer, the state and the jitted steps; abstract: the state as ShapeDtypeStructs carrying their
    shardings, nothing allocated (`--compile-only`)."""
    cfg = self.cfg
    self.optimizer, self.schedule = make_optimizer(cfg.optim, cfg.train.steps)
    micro = cfg.data.global_batch_size // cfg.train.grad_accum
    # compile.warm_start (maxlm/runtime/warm_start.py): executables kept from an earlier start of this run, else kept now
    compiler = warm_start.Compiler(warm_start.run_signature(cfg)) if warm_start.active() else None
    make = (abstract_state if abstract else
            functools.partial(create_train_state, seed=cfg.train.seed, compiler=compiler))
    with self.scope():
      self.state, self.state_shardings = make(self.model, self.optimizer, self.mesh, batch=micro,
                                              seq_len=cfg.data.seq_len, offload=cfg.optim.offload)
    self.batch_sharding = batch_sharding(self.mesh)
    bs = {k: self.batch_sharding for k in data_lib.BATCH_KEYS}
    step = make_train_step(self.model, self.optimizer, self.schedule, grad_accum=cfg.train.grad_accum,
                           packed=self.packed)
    # jitted_train_step keeps XLA's memory estimate (compiled_memory_gb) also where train_step gets wrapped
    self.train_step = self.jitted_train_step = jit_step(step, self.state_shardings, bs, self.scope,
                                                        metrics_sharding=replicated(self.mesh), compiler=compiler)
    self.eval_step = jit_step(make_eval_step(self.model, packed=self.packed), self.state_shardings, bs,
                              self.scope, donate=False, metrics_sharding=replicated(self.mesh))
    self.n_devices = jax.device_count()

  def compile_train_step(self) -> bool:
    """Trace, lower and compile the train step for the state (arrays or abstract) and the batch's shape ahead
    of the first step: the steps then reuse it. True when XLA's executable came from the persistent cache."""
    d = self.cfg.data
    batch = {k: jax.ShapeDtypeStruct((d.global_batch_size, d.seq_len), np.int32, sharding=self.batch_sharding)
             for k in data_lib.BATCH_KEYS}  # [B, T] each, as `to_device` makes them
    hits = compile_cache.COUNTER.snapshot()[0]
    self.jitted_train_step.compile(self.state, batch)
    return compile_cache.COUNTER.snapshot()[0] > hits

  def to_device(self, batch):
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}

  def close(self) -> None:
    """Stop the training data's prefetch threads (a process that goes on after the run keeps none reading)."""
    self.train_data.close()

  def evaluate(self) -> dict:
    """Loss over the held-out data, weighted by tokens (sum of token losses / number of tokens)."""
    it = self.eval_data_factory()
    if it is None:
      return {}
    try:
      sums = evaluate.token_weighted(lambda batch: self.eval_step(self.state, self.to_device(batch)), it,
                                     self.cfg.train.eval_steps)
    finally:
      it.close()
    if sums.tokens == 0:
      return {}
    return {"eval_loss": sums.loss, "eval_perplexity": math.exp(min(sums.loss, 50.0))}


@dataclasses.dataclass(frozen=True)
class RunEnd:
  """How a run ended, when it did not raise: every step trained (or the data ended), or stopped by a signal
  after saving (maxlm/cli/train.py turns that into exit code 75, EXIT_PREEMPTED)."""
  preempted: bool


def train(cfg: Config, preemption: Preemption, t_start: float | None = None) -> RunEnd:
  """Run `cfg` to train.steps; returns how it ended (RunEnd: done, or preempted after saving).

  The run directory is claimed first (maxlm/checkpoint/run_dir.py: a directory holding another run is used
  only to resume it). A directory this call created is removed again when the run fails on bad input or a
  checkpoint before it logged a step or saved a checkpoint, so such a failure leaves nothing behind."""
  startup = Startup(time.perf_counter() if t_start is None else t_start)
  jax.devices()  # the backend starts here at the latest
  startup.mark("backend")
  cfg = dataclasses.replace(cfg, data=data_lib.resolve_type(cfg.data))  # data.type=auto made concrete
  trainer = Trainer(cfg)
  try:
    return _claim_and_train(cfg, trainer, preemption, startup)
  finally:
    trainer.close()  # its data's prefetch threads: a process that goes on after the run keeps none reading


def _claim_and_train(cfg: Config, trainer: Trainer, preemption: Preemption, startup: Startup) -> RunEnd:
  run_dir = cfg.run_dir
  is_main = jax.process_index() == 0
  if cfg.checkpoint.load_params and not Path(cfg.checkpoint.load_params).exists():
    raise CheckpointError(f"checkpoint.load_params={cfg.checkpoint.load_params}: no such file or directory")
  cfg = trainer.cfg  # with plan.mode=auto, the levers the planner chose
  run_dirs.claim(run_dir, yaml.safe_load(dump_yaml(cfg)), cfg.checkpoint.enabled)
  created = is_main and not run_dir.exists()
  if is_main:
    _check_writable(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
  try:
    return _train(cfg, trainer, preemption, startup)
  except (ConfigError, CheckpointError, data_lib.DataError, PrecisionError):
    if created and not run_dirs.previous(run_dir).holds_run:
      shutil.rmtree(run_dir, ignore_errors=True)
    raise


def _train(cfg: Config, trainer: Trainer, preemption: Preemption, startup: Startup) -> RunEnd:
  run_dir = cfg.run_dir
  is_main = jax.process_index() == 0
  trainer.build()
  m, t, d = cfg.model, cfg.train, cfg.data
  n = count_params(m)
  flops = flops_per_step(m, d.global_batch_size, d.seq_len)
  kind = jax.devices()[0].device_kind
  peak = device_peak_flops(kind)
  flops_known = jax.devices()[0].platform != "cpu"
  if is_main:  # progress and run lines come from process 0 only; warnings and errors from any process
    echo(_start_line(cfg, trainer, n["total"], kind))
    if jax.process_count() > 1:
      echo(f"maxlm: {mesh_placement(trainer.mesh)}")

  ckpt, writer = None, None
  profiler = Profiler(cfg.profile, run_dir, is_main, echo=echo)
  wd = watchdog.start(cfg.train, run_dir, jax.process_index(), jax.process_count())  # arm(): each host phase
  try:
    ckpt = _start_state(trainer, cfg)  # resume the run / load checkpoint.load_params; None if disabled
    start_step = int(jax.device_get(trainer.state.step))
    if is_main:  # only now is the run known to start (a checkpoint that does not fit has stopped it)
      (run_dir / "config.yml").write_text(dump_yaml(cfg))
    if start_step >= t.steps and is_main:
      echo(f"maxlm: {run_dir} is already at step {start_step} of train.steps={t.steps}: nothing to train "
           f"(more steps: train.steps=N; a new run: run_name=...)")
    writer = MetricsWriter(run_dir, enabled=is_main, start_step=start_step)
    startup.mark("state")
    first = _compile(trainer, wd, start_step) if start_step < t.steps else None  # hit or miss, for the line
    checked, skipped = start_step, int(jax.device_get(trainer.state.nonfinite_steps))
    logged_skips = skipped
    tokens_per_step = d.global_batch_size * d.seq_len
    t_last, steps_since, paused, first_step = None, 0, 0.0, None
    t_train0, steps_timed = None, 0
    batches = Batches(trainer.train_data, finite=d.num_epochs > 0)
    for step in range(start_step, t.steps):
      wd.arm("data wait", step + 1)
      local = batches.take()
      if local is None:  # finite data that had ended before this (resumed) run
        if is_main:
          echo(f"maxlm: the training data ended (data.num_epochs={d.num_epochs}) before step {step + 1}")
        break
      wd.arm("step dispatch", step + 1, dispatch=True)  # the host waits here when the device's queue is full
      with profiler.step(step + 1):  # NVTX/XProf step range; opens the profile window at its first step
        trainer.state, metrics = trainer.train_step(trainer.state, trainer.to_device(local))
      profiler.step_done(step + 1, metrics)  # closes the window after its last step
      steps_since += 1
      done = step + 1
      last = done == t.steps or batches.ended
      if t_last is None:  # the first step (compiled before the loop): report it, time from its end
        jax.block_until_ready(metrics)
        t_last = t_train0 = time.perf_counter()
        steps_since = 0
        preemption.step_started(checkpointing=ckpt is not None)
        first_step = _first_step(trainer, startup, done, t_last, first, is_main)  # once, in the first row
      stop = preemption.reached(done)
      save_s = 0.0
      if ckpt is not None and (stop or last or ckpt.due(done)):
        wd.arm("checkpoint save", done, slow=True)
        if t.nonfinite == "stop":  # never checkpoint past a skipped update
          checked = _check_finite(jax.device_get(metrics), checked, skipped, done, ckpt)
        jax.block_until_ready(trainer.state)  # the step's own time stays training time
        t0 = time.perf_counter()
        ckpt.save(done, trainer.state, batches.position(), to_dict(cfg))
        save_s = time.perf_counter() - t0
        paused += save_s
      elif ckpt is not None:
        ckpt.poll()
      if done % t.log_every and not last and not stop:
        continue
      wd.arm("metrics fetch", done, sync=True)
      metrics = jax.device_get(metrics)
      # training time only: checkpoint saves are reported as save_s
      row = _row(metrics, steps_since, time.perf_counter() - t_last - paused, tokens_per_step, flops,
                 trainer.n_devices, peak)
      if steps_since:
        wd.step_time(row["step_time"])
        steps_timed += steps_since
      if paused:
        row["save_s"] = paused
      if first_step is not None:
        row.update(first_step)
        first_step = None
      row["peak_memory_gb"] = peak_memory_gb()
      if t.nonfinite == "stop":
        checked = _check_finite(metrics, checked, skipped, done, ckpt)
      elif row["nonfinite_steps"] > logged_skips and is_main:  # the same count on every process
        echo(f"maxlm: warning: {row['nonfinite_steps'] - logged_skips} update(s) skipped for a non-finite "
             f"loss or gradient up to step {done} ({row['nonfinite_steps']} in all; last loss "
             f"{row['loss']}, grad norm {row['grad_norm']})")
        logged_skips = row["nonfinite_steps"]
      if trainer.eval_data_factory and t.eval_every and (done % t.eval_every == 0 or last):
        wd.arm("evaluation", done, slow=True)
        row.update(trainer.evaluate())
      now = time.perf_counter()
      row["elapsed_s"] = now - startup.t0
      if steps_timed:
        row["eta_s"] = (t.steps - done) * (now - t_train0) / steps_timed
      writer.write(done, row)
      if is_main:
        echo(progress_line(done, t.steps, row, flops_known=flops_known))
      t_last, steps_since, paused = time.perf_counter(), 0, 0.0
      if stop:
        if ckpt is not None:
          wd.arm("checkpoint save", done, slow=True)
          ckpt.wait()
        echo(_preempted_line(preemption.signal, done, ckpt))
        return RunEnd(preempted=True)
      if batches.ended and done < t.steps:
        if is_main:
          echo(f"maxlm: the training data ended after step {done} (data.num_epochs={d.num_epochs})")
        break
  finally:
    profiler.close()  # a run that stops inside the window still writes its trace
    if writer is not None:
      writer.close()
    if ckpt is not None:
      wd.arm("checkpoint close", slow=True)
      ckpt.close()  # waits for the save in flight
    wd.stop()
  return RunEnd(preempted=False)


def _start_line(cfg: Config, trainer: Trainer, n_params: int, kind: str) -> str:
  m = cfg.model
  # precision bf16 quantizes nothing: with model.dtype=float32 everything computes in fp32
  precision = "fp32" if (m.precision, m.dtype) == ("bf16", "float32") else m.precision
  warmup = warmup_warning(cfg.optim, cfg.train.steps)
  return (f"maxlm: {m.name} ({n_params / 1e6:.1f}M params, backend={trainer.backend}, precision={precision}) on "
          f"{jax.device_count()} x {kind}, mesh {dict(trainer.mesh.shape)}, run dir {cfg.run_dir}\n"
          f"maxlm: {data_lib.start_line(trainer.train_data.info, cfg.data)}"  # what the batches are made of
          + (f"\nmaxlm: warning: {warmup}" if warmup else ""))


def _compile(trainer: Trainer, wd, start_step: int) -> bool:
  """The train step compiled (or loaded from the persistent cache) before the first step; True for a hit."""
  wd.arm("compile", start_step + 1)
  return trainer.compile_train_step()


def _start_state(trainer: Trainer, cfg: Config):
  """The state the run starts from (maxlm/checkpoint/resume.py), taken into the trainer; the Checkpointer."""
  started = start_checkpoints(trainer.state, trainer.state_shardings, trainer.train_data, cfg)
  trainer.state = started.state
  return started.checkpointer


def _first_step(trainer: Trainer, startup: Startup, done: int, t_first: float, hit: bool, is_main: bool) -> dict:
  """The first-step lines (the time to it in parts; the compilation cache) and the fields of the first row."""
  step = trainer.jitted_train_step
  parts = startup.parts(t_first, step.lower_s, step.compile_s, trainer.plan_s)
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
