"""The training run: `Trainer` owns the mesh, model, state, data and jitted steps; `train()` drives it.

Order of a run, so that bad input stops before anything is written: the train command creates the run directory
and locks it first (one run at a time: maxlm/checkpoint/run_lock.py; a duplicate stops before the planner), then
check everything that can be checked (backend and precision, mesh and batch split, a memory lower bound, every data
input), build the state, resume from checkpoints, train. A start that fails on bad input before the directory
holds a run removes the directory it created.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import yaml

from maxlm import data as data_lib
from maxlm import evaluate
from maxlm.batches import Batches
from maxlm.build import build_step
from maxlm.checkpoint import CheckpointError, Preemption
from maxlm.checkpoint import run_dir as run_dirs
from maxlm.checkpoint import run_lock
from maxlm.checkpoint import start as start_checkpoints
from maxlm.config import Config, ConfigError, DataConfig, TrainConfig, dump_yaml
from maxlm.config.rules import check_expert_degree
from maxlm.layers import PrecisionError, check_precision, check_remat, resolve_backend
from maxlm.loop import Run, RunError, subscribe
from maxlm.parallel.mesh import check_context_split, make_mesh
from maxlm.metrics import echo
from maxlm.runtime import agree, compile_cache, warm_start, watchdog
from maxlm.runtime.startup import Startup
from maxlm.parallel.pipelining import check as check_pipeline

__all__ = ["RunEnd", "RunError", "Trainer", "check_batch_split", "train"]


def check_batch_split(d: DataConfig, t: TrainConfig, mesh_shape) -> None:
  """ConfigError unless each micro-batch splits evenly over the data-parallel devices (data x fsdp x expert)."""
  ep = mesh_shape.get("expert", 1)
  dp = mesh_shape["data"] * mesh_shape["fsdp"] * ep
  micro = d.global_batch_size // t.grad_accum
  if micro % dp:
    raise ConfigError(f"data.global_batch_size={d.global_batch_size} gives micro-batches of {micro} rows "
                      f"(train.grad_accum={t.grad_accum}), not divisible by the {dp} data-parallel devices "
                      f"(mesh data={mesh_shape['data']} x fsdp={mesh_shape['fsdp']}"
                      + (f" x expert={ep}" if ep > 1 else "") + "); use a "
                      f"multiple of {dp * t.grad_accum}")


class Trainer:
  """Owns the mesh, model, state, data and jitted steps of one run; `train()` drives it. `cfg` is the run's
  decided config: plan.mode's levers are chosen before (maxlm/plan/__init__.py `for_run`, the train command)."""
  slow_storage = None  # tests: a checkpoint storage slow or stuck on purpose (maxlm/checkpoint/disk.py)

  def __init__(self, cfg: Config):
    self.cfg = cfg
    self.backend = resolve_backend(cfg.model.backend)
    check_precision(cfg.model.precision, self.backend)
    check_remat(cfg.model.remat, self.backend)
    self.mesh = make_mesh(cfg.mesh)
    check_pipeline(cfg.model, cfg.train, cfg.mesh, self.mesh.shape["pipeline"], self.mesh.shape["context"])
    self._check_batch_split()
    if warm_start.active():  # the config is final: load the executables kept by the last start, in the background
      warm_start.prefetch(warm_start.run_signature(cfg))
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
    check_expert_degree(self.cfg.model.moe.experts, self.mesh.shape["expert"])  # a -1 degree, filled
    check_batch_split(self.cfg.data, self.cfg.train, self.mesh.shape)
    check_context_split(self.cfg.data.seq_len, self.mesh.shape["context"])

  def build(self, abstract: bool = False):
    """The optimizer, the state and the jitted steps (maxlm/build.py); abstract: the state as ShapeDtypeStructs
    carrying their shardings, nothing allocated (`--compile-only`)."""
    built = self.built = build_step(self.cfg, self.mesh, abstract=abstract)
    self.model, self.optimizer, self.schedule = built.model, built.optimizer, built.schedule
    self.state, self.state_shardings, self.batch_sharding = built.state, built.state_shardings, built.batch_sharding
    # jitted_train_step keeps XLA's memory estimate (compiled_memory_gb) also where train_step gets wrapped
    self.train_step = self.jitted_train_step = built.train_step
    self.eval_step = built.eval_step
    self.n_devices = jax.device_count()

  def compile_train_step(self) -> bool:
    """Trace, lower and compile the train step for the state (arrays or abstract) and the batch's shape ahead
    of the first step: the steps then reuse it. True when XLA's executable came from the persistent cache."""
    hits = compile_cache.COUNTER.snapshot()[0]
    self.jitted_train_step.compile(self.state, self.built.batch_structs())  # [B, T] each, as `to_device` makes them
    return compile_cache.COUNTER.snapshot()[0] > hits

  def to_device(self, batch):
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}

  def close(self) -> None:
    """Stop the training data's prefetch threads (a process that goes on after the run keeps none reading)."""
    self.train_data.close()

  def evaluate(self, progress=None) -> dict:
    """Loss over the held-out data, weighted by tokens (sum of token losses / number of tokens); `progress()`
    after each batch."""
    it = self.eval_data_factory()
    if it is None:
      return {}
    try:
      sums = evaluate.token_weighted(lambda batch: self.eval_step(self.state, self.to_device(batch)), it,
                                     self.cfg.train.eval_steps, on_batch=progress and (lambda _: progress()))
    finally:
      it.close()
    if sums.tokens == 0:
      return {}
    return {"eval_loss": sums.loss, "eval_perplexity": sums.perplexity}


@dataclasses.dataclass(frozen=True)
class RunEnd:
  """How a run ended, when it did not raise: every step trained (or the data ended), or stopped by a signal
  after saving (maxlm/cli/train.py turns that into exit code 75, EXIT_PREEMPTED)."""
  preempted: bool


def train(cfg: Config, preemption: Preemption, t_start: float | None = None) -> RunEnd:
  """Run `cfg` as given to train.steps (the train command decides plan.mode's levers first, then calls `run`);
  returns how it ended (RunEnd: done, or preempted after saving)."""
  startup = Startup(time.perf_counter() if t_start is None else t_start)
  jax.devices()  # the backend starts here at the latest
  startup.mark("backend")
  cfg = dataclasses.replace(cfg, data=data_lib.resolve_type(cfg.data))  # data.type=auto made concrete
  wd = watchdog.start(cfg.train, cfg.run_dir, jax.process_index(), jax.process_count(), "start-up: data and state")
  trainer = Trainer(cfg)
  try:
    return run(trainer, preemption, startup, wd)
  finally:
    trainer.close()  # its data's prefetch threads: a process that goes on after the run keeps none reading
    wd.stop()


def run(trainer: Trainer, preemption: Preemption, startup: Startup, wd, held: run_lock.Held | None = None) -> RunEnd:
  """Train the built trainer's run under the watchdog `wd` (started at start-up), in its run directory as `held`
  (created and locked by the train command: maxlm/checkpoint/run_lock.py `take`; taken here when None, and then
  released here). Process 0 claims the directory, the others receiving its answer (maxlm/runtime/agree.py). A
  directory this start created is removed again when the run fails on bad input or a checkpoint before it logged a
  step or saved a checkpoint, so such a failure leaves nothing behind."""
  cfg, run_dir = trainer.cfg, trainer.cfg.run_dir
  limit = watchdog.start_up_limit(cfg.train)
  own = held is None
  if own:  # one run at a time (a second one stops here, the first untouched)
    held = run_lock.take(cfg, jax.process_index(), wd, limit)
  try:
    # process 0 looks at the directory (a run it holds is only resumed), every process gets its answer
    agree.decide("run directory claim", lambda: _claim(cfg), wd, "start-up: run directory", limit)
    wd.arm("start-up: data and state", limit=limit)  # the state's init: one compile and one run
    return _train(cfg, trainer, functools.partial(subscribe, preemption=preemption, startup=startup, wd=wd))
  except (ConfigError, CheckpointError, data_lib.DataError, PrecisionError):
    held.discard = held.new is not None and held.main and not run_dirs.previous(run_dir).holds_run
    raise
  finally:
    if own:
      held.release()


def _claim(cfg: Config) -> None:
  run_dirs.claim(cfg.run_dir, yaml.safe_load(dump_yaml(cfg)), cfg.checkpoint.enabled)


def _train(cfg: Config, trainer: Trainer, services) -> RunEnd:
  """The loop: the run's own work, with its services (maxlm/loop/services.py; `services(run)` makes them) called at
  fixed points."""
  trainer.build()
  t, d = cfg.train, cfg.data
  run = Run(cfg, trainer, is_main=jax.process_index() == 0)
  hooks = services(run)
  try:
    hooks.check(run)
    hooks.begin(run)
    run.ckpt = _start_state(trainer, cfg)  # resume the run / load checkpoint.load_params; None if disabled
    run.start_step = run.done = int(jax.device_get(trainer.state.step))
    hooks.started(run)
    if run.done < t.steps:
      hooks.compile(run)
      run.cache_hit = trainer.compile_train_step()  # ahead of the first step; hit or miss, for its line
    batches = run.batches = Batches(trainer.train_data, finite=d.num_epochs > 0)
    for step in range(run.start_step, t.steps):
      hooks.step_start(run)
      local = batches.take()
      if local is None:  # finite data that had ended before this (resumed) run
        if run.is_main:
          echo(f"maxlm: the training data ended (data.num_epochs={d.num_epochs}) before step {step + 1}")
        break
      with hooks.step(run):
        trainer.state, run.metrics = trainer.train_step(trainer.state, trainer.to_device(local))
      run.done, run.last = step + 1, step + 1 == t.steps or batches.ended
      hooks.step_end(run)
      if run.save_due:
        hooks.save(run)
      if run.done % t.log_every and not run.last and not run.stop:
        continue
      hooks.fetch(run)
      hooks.log(run)
      if trainer.eval_data_factory and t.eval_every and (run.done % t.eval_every == 0 or run.last):
        hooks.eval(run)
        run.row.update(trainer.evaluate(lambda: hooks.eval_batch(run)))
      hooks.write(run)
      if run.stop:
        hooks.stop(run)
        return RunEnd(preempted=True)
      if batches.ended and run.done < t.steps:
        if run.is_main:
          echo(f"maxlm: the training data ended after step {run.done} (data.num_epochs={d.num_epochs})")
        break
  finally:
    hooks.end(run)
  return RunEnd(preempted=False)


def _start_state(trainer: Trainer, cfg: Config):
  """The state the run starts from (maxlm/checkpoint/resume.py), taken into the trainer; the Checkpointer."""
  started = start_checkpoints(trainer.state, trainer.state_shardings, trainer.train_data, cfg, trainer.slow_storage)
  trainer.state = started.state
  return started.checkpointer
