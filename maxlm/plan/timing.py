"""Step times measured on the devices at hand, for the planner's choice among the candidates that fit.

`time_step(cfg)` runs the train step the trainer will run: the same program (`plan.measure.compile_step`,
whose executable the compilation cache and compile.warm_start keep, so the run that follows does not compile
it again), on a freshly initialized state and a synthetic batch of the run's shape (uniform random token ids:
a step's time does not depend on the tokens), one step to warm up, then `steps` timed between two host
syncs. Nothing is written. The state is dropped before it returns, so candidates are timed one after the
other in the memory one of them needs. A step that runs out of device memory (XLA's estimate fitted, the
allocator did not) is None: the candidate does not fit after all.

One process only: a run of several processes compiles and runs every step on all of them, and the planner
decides on one (maxlm/plan/levers.py), so there the estimate orders the candidates.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from maxlm.config import Config
from maxlm.data.packing import BATCH_KEYS
from maxlm.layers import resolve_backend
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.optim import make_optimizer
from maxlm.plan.measure import compile_step
from maxlm.runtime.devices import is_oom
from maxlm.scope import model_scope
from maxlm.parallel.sharding import batch_sharding
from maxlm.train_state import create_train_state

STEPS = 3  # timed steps per candidate, after one warm-up step


def synthetic_batch(cfg: Config, sharding) -> dict:
  """A batch of the run's shape, on the devices: random token ids, one document per row."""
  b, t = cfg.data.global_batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)  # [B, T + 1]
  host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}
  return {k: jax.device_put(host[k], sharding) for k in BATCH_KEYS}


def time_step(cfg: Config, devices=None, steps: int = STEPS) -> float | None:
  """Seconds per train step of `cfg` on `devices` (default: all), measured (see the module doc); None when
  the step runs out of device memory."""
  compiled, _ = compile_step(cfg, devices)
  mesh = make_mesh(cfg.mesh, devices)
  model = Transformer(cfg.model, max_segments=cfg.data.max_segments_per_row)
  optimizer, _ = make_optimizer(cfg.optim, cfg.train.steps)
  micro = cfg.data.global_batch_size // cfg.train.grad_accum
  state = None
  try:
    with model_scope(cfg.model, resolve_backend(cfg.model.backend), mesh):
      state, _ = create_train_state(model, optimizer, mesh, cfg.train.seed, micro, cfg.data.seq_len,
                                    cfg.optim.offload)
      batch = synthetic_batch(cfg, batch_sharding(mesh))
      state, metrics = compiled(state, batch)  # warm-up: first-run work (autotuning, allocations) not timed
      jax.block_until_ready(metrics)
      start = time.perf_counter()
      for _ in range(steps):
        state, metrics = compiled(state, batch)
      jax.block_until_ready((state, metrics))
      return (time.perf_counter() - start) / steps
  except jax.errors.JaxRuntimeError as e:
    if not is_oom(e):
      raise
    return None
  finally:
    del state  # the next candidate is timed in the memory this one held
