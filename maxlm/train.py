"""`python -m maxlm.train [config=FILE] [key=value ...]`: the training entry point.

Exit codes: 0 done, 1 run-time failure (e.g. non-finite loss with train.nonfinite=stop), 2 bad
configuration or input (one-line message, nothing written), 3 checkpoint error (none usable, or a
save failed; earlier checkpoints stay intact), 75 preempted by SIGTERM/SIGINT (a checkpoint of the
last step was saved; rerun the same command to resume).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time

from maxlm.config import Config, ConfigError, dump_yaml, load_config

EXIT_BAD_INPUT = 2
EXIT_CHECKPOINT = 3

log = logging.getLogger("maxlm")


class RunError(RuntimeError):
  """A run-time failure with a one-line message (e.g. non-finite loss with train.nonfinite=stop)."""


def _fail(msg: str, code: int) -> int:
  print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)
  return code


class Trainer:
  """Owns the mesh, model, state, data and jitted steps of one run; `train()` drives it."""

  def __init__(self, cfg: Config):
    import jax

    from maxlm import data as data_lib
    from maxlm.layers import check_precision, resolve_backend
    from maxlm.mesh import make_mesh
    from maxlm.model import Transformer

    self.cfg = cfg
    self.backend = resolve_backend(cfg.model.backend)
    check_precision(cfg.model.precision, self.backend)
    self.mesh = make_mesh(cfg.mesh)
    self.packed = cfg.data.type != "synthetic"
    self.model = Transformer(cfg.model, max_segments=cfg.data.max_segments_per_row)
    self.train_data = data_lib.make_train_iterator(cfg.data, cfg.model.vocab_size, jax.process_index(),
                                                   jax.process_count())
    self.eval_data_factory = None
    if cfg.train.eval_every > 0:
      self.eval_data_factory = lambda: data_lib.make_eval_iterator(
          cfg.data, cfg.model.vocab_size, jax.process_index(), jax.process_count())

  @contextlib.contextmanager
  def scope(self):
    """Mesh + logical axis rules + TE autocast: entered for init and for every trace."""
    import jax

    from maxlm.layers import precision_scope
    from maxlm.sharding import TE_MESH_AXES, axis_rules
    with jax.set_mesh(self.mesh), axis_rules(), precision_scope(self.cfg.model.precision, self.backend,
                                                  self.cfg.model.fp8_amax_history_len, TE_MESH_AXES):
      yield

  def build(self):
    import jax

    from maxlm.optim import make_optimizer
    from maxlm.sharding import batch_sharding, replicated
    from maxlm.step import jit_step, make_eval_step, make_train_step
    from maxlm.train_state import create_train_state

    cfg = self.cfg
    self.optimizer, self.schedule = make_optimizer(cfg.optim, cfg.train.steps)
    micro = cfg.data.global_batch_size // cfg.train.grad_accum
    with self.scope():
      self.state, self.state_shardings = create_train_state(
          self.model, self.optimizer, self.mesh, cfg.train.seed, micro, cfg.data.seq_len)
    self.batch_sharding = batch_sharding(self.mesh)
    from maxlm.data import BATCH_KEYS
    bs = {k: self.batch_sharding for k in BATCH_KEYS}
    step = make_train_step(self.model, self.optimizer, self.schedule, grad_accum=cfg.train.grad_accum,
                           packed=self.packed)
    self.train_step = jit_step(step, self.state_shardings, bs, self.scope,
                               metrics_sharding=replicated(self.mesh))
    self.eval_step = jit_step(make_eval_step(self.model, packed=self.packed), self.state_shardings, bs,
                              self.scope, donate=False, metrics_sharding=replicated(self.mesh))
    self.n_devices = jax.device_count()

  def to_device(self, batch):
    import jax
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}

  def evaluate(self) -> dict:
    import jax
    loss_sum, tokens = 0.0, 0.0
    it = self.eval_data_factory()
    if it is None:
      return {}
    for i, batch in enumerate(it):
      if self.cfg.train.eval_steps and i >= self.cfg.train.eval_steps:
        break
      out = jax.device_get(self.eval_step(self.state, self.to_device(batch)))
      loss_sum += float(out["loss_sum"])
      tokens += float(out["tokens"])
    if tokens == 0:
      return {}
    loss = loss_sum / tokens
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


def train(cfg: Config) -> int:
  import jax

  from maxlm.metrics import MetricsWriter, device_peak_flops, echo, progress_line, throughput
  from maxlm.model import count_params, flops_per_step

  trainer = Trainer(cfg)
  run_dir = cfg.run_dir
  is_main = jax.process_index() == 0
  if is_main:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(dump_yaml(cfg))
  trainer.build()
  m, t, d = cfg.model, cfg.train, cfg.data
  n = count_params(m)
  flops = flops_per_step(m, d.global_batch_size, d.seq_len)
  kind = jax.devices()[0].device_kind
  peak = device_peak_flops(kind)
  echo(f"maxlm: {m.name} ({n['total'] / 1e6:.1f}M params, backend={trainer.backend}, "
       f"precision={m.precision}) on {jax.device_count()} x {kind}, mesh "
       f"{dict(trainer.mesh.shape)}, run dir {run_dir}")

  from maxlm import resume
  from maxlm.config import to_dict
  from maxlm.preemption import EXIT_PREEMPTED, Preemption
  ckpt, writer, preemption = None, None, Preemption()
  try:
    ckpt = resume.start(trainer, cfg)  # resume the run / load checkpoint.load_params; None if disabled
    start_step = int(jax.device_get(trainer.state.step))
    writer = MetricsWriter(run_dir, enabled=is_main, start_step=start_step)
    checked, skipped = start_step, int(jax.device_get(trainer.state.nonfinite_steps))
    tokens_per_step = d.global_batch_size * d.seq_len
    t_last, steps_since = None, 0
    for step in range(start_step, t.steps):
      batch = trainer.to_device(next(trainer.train_data))
      trainer.state, metrics = trainer.train_step(trainer.state, batch)
      steps_since += 1
      done = step + 1
      if t_last is None:  # the first step compiles: time from its end
        jax.block_until_ready(metrics)
        t_last, steps_since = time.perf_counter(), 0
      stop = preemption.reached(done)
      if ckpt is not None and (stop or done == t.steps or ckpt.due(done)):
        if t.nonfinite == "stop":  # never checkpoint past a skipped update
          checked = _check_finite(jax.device_get(metrics), checked, skipped, done, ckpt)
        ckpt.save(done, trainer.state, trainer.train_data.get_state(), to_dict(cfg))
      elif ckpt is not None:
        ckpt.poll()
      if done % t.log_every and done != t.steps and not stop:
        continue
      metrics = jax.device_get(metrics)
      now = time.perf_counter()
      row = {k: float(v) for k, v in metrics.items() if k not in ("finite", "tokens")}
      row["nonfinite_steps"] = int(metrics["nonfinite_steps"])
      if steps_since:
        dt = now - t_last
        row.update(throughput(tokens_per_step * steps_since, flops * steps_since, dt, trainer.n_devices, peak))
        row["step_time"] = dt / steps_since
      else:
        row.update({"tokens_per_sec": None, "tflops_per_device": None, "mfu": None, "step_time": None})
      if t.nonfinite == "stop":
        checked = _check_finite(metrics, checked, skipped, done, ckpt)
      if trainer.eval_data_factory and t.eval_every and (done % t.eval_every == 0 or done == t.steps):
        row.update(trainer.evaluate())
      writer.write(done, row)
      echo(progress_line(done, t.steps, row))
      t_last, steps_since = time.perf_counter(), 0
      if stop:
        if ckpt is not None:
          ckpt.wait()
        echo(f"maxlm: {preemption.signal} at step {done}: "
             + (f"checkpoint step {done} saved in {ckpt.directory}" if ckpt else "checkpointing is disabled")
             + f"; exiting with code {EXIT_PREEMPTED} (rerun the same command to resume)")
        return EXIT_PREEMPTED
  finally:
    preemption.close()
    if writer is not None:
      writer.close()
    if ckpt is not None:
      ckpt.close()  # waits for the save in flight
  return 0


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


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__.strip() + "\n\nExample: python -m maxlm.train config=llama8b.yml train.steps=100")
    return 0
  logging.basicConfig(level=os.environ.get("MAXLM_LOG", "WARNING"), format="%(name)s: %(message)s")
  try:
    cfg = load_config(argv)
  except ConfigError as e:
    return _fail(str(e), EXIT_BAD_INPUT)
  from maxlm.checkpoint import CheckpointError
  from maxlm.data import DataError
  from maxlm.layers import PrecisionError
  try:
    return train(cfg)
  except (ConfigError, DataError, PrecisionError) as e:
    return _fail(str(e), EXIT_BAD_INPUT)
  except RunError as e:
    return _fail(str(e), 1)
  except CheckpointError as e:
    return _fail(str(e), EXIT_CHECKPOINT)


if __name__ == "__main__":
  sys.exit(main())
