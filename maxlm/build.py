"""The one builder of a run's train step: `build_step(cfg, mesh)` makes the model, the optimizer and its schedule,
the train state (or, with abstract=True, its ShapeDtypeStructs carrying their shardings: nothing allocated), the
state's and the batch's shardings, and the jitted train and eval steps (`CompiledStep`).

Its callers: the trainer (maxlm/trainer.py), the planner's measurement (maxlm/plan/measure.py `compile_step`), the
dry run (maxlm/cli/dryrun.py, abstract state only, on an AbstractMesh) and the benchmarks. Since all of them
build here, the program the planner compiles is the trainer's, and so is the warm start's key for it
(maxlm/runtime/warm_start.py): the same jit, shardings, arguments and kind ("train_step").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable

import jax
import numpy as np
import optax

from maxlm.config import Config
from maxlm.data.packing import BATCH_KEYS
from maxlm.layers import resolve_backend
from maxlm.model import Overrides, Transformer
from maxlm.optim import make_optimizer
from maxlm.parallel.pipelining import repeats as pipeline_repeats
from maxlm.runtime import warm_start
from maxlm.scope import model_scope
from maxlm.parallel.sharding import batch_sharding, replicated
from maxlm.step import make_eval_step, make_train_step
from maxlm.train_state import TrainState, abstract_state, create_train_state

MEMORY_FIELDS = ("argument", "output", "alias", "temp")


def memory_stats(compiled) -> dict[str, int]:
  """Bytes per device of a compiled step: XLA's fields, `device` (arguments + outputs + temporaries - aliased,
  the donated buffers: as MaxText's `Total estimated memory size`) and `host` (the same over the host_* fields,
  the state kept in pinned host memory)."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError("this JAX backend gives no compiled memory analysis")
  out = {}
  for where in ("", "host_"):
    for k in MEMORY_FIELDS:
      out[where + k] = int(getattr(m, f"{where}{k}_size_in_bytes", 0) or 0)
  out["device"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  out["host"] = out["host_argument"] + out["host_output"] + out["host_temp"] - out["host_alias"]
  return out


def compiled_memory_gb(compiled) -> float | None:
  """XLA's estimate of one device's memory for a compiled step (GB, 1e9 bytes; `memory_stats`'s `device`);
  None where the backend gives no analysis."""
  return None if compiled.memory_analysis() is None else memory_stats(compiled)["device"] / 1e9


class CompiledStep:
  """A step jitted with explicit in/out shardings (the state donated unless donate=False, which returns the
  metrics alone); every call, hence every trace, runs inside `scope()`. The first call compiles ahead of time
  (`compile`), and keeps the executable with how it came:

  executable          the compiled step (kept for profiling: its optimized HLO)
  compiled_memory_gb  XLA's estimate of one device's memory for it (`compiled_memory_gb`)
  lower_s, compile_s  seconds to trace and lower it, and to compile it (or to load it, see `compiler`)
  loaded              True: the executable came from an earlier start (warm start), nothing was traced
  background_s        loaded ahead, in the background (warm_start.prefetch): that load's seconds, else None

  `compiler(name, jitted, args)`, when given, supplies the executable (maxlm/runtime/warm_start.py `Compiler`:
  loaded from an earlier start, else compiled and kept), and the calls run that executable."""

  def __init__(self, step: Callable, state_shardings, batch_shardings,
               scope: Callable[[], contextlib.AbstractContextManager], *, donate: bool = True, metrics_sharding=None,
               compiler: Callable | None = None, name: str = "train_step"):
    self.fn, self.donate = step, donate
    self.jitted = self.jitted_with(state_shardings, batch_shardings, metrics_sharding)
    self.scope, self.compiler, self.name = scope, compiler, name
    self.executable = self.compiled_memory_gb = self.lower_s = self.compile_s = self.background_s = None
    self.loaded = False

  def jitted_with(self, state_shardings, batch_shardings, metrics_sharding):
    """This step jitted with these shardings (the run's, or the planner's: its state in host memory over an
    AbstractMesh, maxlm/plan/target.py `compile_in_host_memory`); the state donated as this step donates it."""
    return jax.jit(self.fn, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, metrics_sharding) if self.donate else metrics_sharding,
                   donate_argnums=(0,) if self.donate else ())

  def lower(self, state, batch):
    """The step traced and lowered for these arguments (arrays, or ShapeDtypeStructs carrying their shardings)."""
    with self.scope():
      return self.jitted.lower(state, batch)

  def compile(self, state, batch):
    """Trace, lower and compile for these arguments (arrays, or ShapeDtypeStructs carrying their shardings: the
    same program); the calls reuse the executable. Keeps the seconds of each part (maxlm/runtime/startup.py)."""
    with self.scope():
      return self._compile(state, batch)

  def _compile(self, state, batch):
    if self.compiler is not None:
      got = self.compiler(self.name, self.jitted, (state, batch))
      self.executable, self.loaded, self.lower_s, self.compile_s = got.executable, got.loaded, got.lower_s, got.compile_s
      self.background_s = got.background_s
    else:
      t0 = time.perf_counter()
      lowered = self.jitted.lower(state, batch)
      t1 = time.perf_counter()
      self.executable = lowered.compile()
      self.lower_s, self.compile_s = t1 - t0, time.perf_counter() - t1
    self.compiled_memory_gb = compiled_memory_gb(self.executable)
    return self.executable

  def __call__(self, state, batch):
    with self.scope():  # once per call
      if self.executable is None:  # the first call compiles ahead of time to read XLA's estimate; jitted reuses it
        self._compile(state, batch)
      return self.jitted(state, batch) if self.compiler is None else self.executable(state, batch)


@dataclasses.dataclass
class Built:
  """What `build_step` made: the model and its optimizer, the state (arrays, or ShapeDtypeStructs carrying their
  shardings) and its shardings, the batch's sharding, the steps, and the scope every trace runs in."""
  cfg: Config
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  backend: str
  model: Transformer
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  state: TrainState
  state_shardings: TrainState
  batch_sharding: jax.sharding.NamedSharding
  train_step: CompiledStep
  eval_step: CompiledStep
  scope: Callable[[], contextlib.AbstractContextManager]

  def batch_structs(self) -> dict:
    """The global batch as abstract arrays: [B, T] int32 each, carrying the batch's sharding."""
    d = self.cfg.data
    return {k: jax.ShapeDtypeStruct((d.global_batch_size, d.seq_len), np.int32, sharding=self.batch_sharding)
            for k in BATCH_KEYS}


@dataclasses.dataclass(frozen=True)
class Standins:
  """What a measurement of the step changes in what it builds (maxlm/plan/standins.py): the model's overrides,
  and a scope entered beside the model's for every trace. Such a program is never the run's."""
  overrides: Overrides = Overrides()
  scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
  guard: str = "cond"  # the step's non-finite guard (maxlm/step.py make_train_step)


@contextlib.contextmanager
def _scope(cfg: Config, backend: str, mesh, quantized: bool, standins: Standins | None):
  with model_scope(cfg.model, backend, mesh, quantized=quantized), (standins or Standins()).scope():
    yield


def build_step(cfg: Config, mesh, *, abstract: bool = False, quantized: bool = True,
               standins: Standins | None = None) -> Built:
  """Build `cfg`'s train step on `mesh` (a Mesh; an AbstractMesh for the abstract state alone, whose steps
  cannot be lowered).

  abstract: the state as ShapeDtypeStructs with their shardings, nothing allocated (`--compile-only`, the planner,
  the dry run); else initialized into its shards from train.seed. quantized=False: traced under the unquantized
  precision scope whatever model.precision says (the dry run, where the FP8 recipe does not run). standins: the
  planner's measurement stand-ins (maxlm/plan/standins.py); such a program is never the run's, so it is never
  kept for a warm start. Otherwise, with compile.warm_start active, the init and the train step come from (and
  go to) the warm start's store."""
  backend = resolve_backend(cfg.model.backend)
  model = Transformer(cfg.model, max_segments=cfg.data.max_segments_per_row,
                      context_strategy=cfg.mesh.context_strategy, stages=mesh.shape["pipeline"],
                      microbatches=cfg.train.grad_accum, repeats=pipeline_repeats(cfg.train),
                      gather_once=cfg.train.pipeline_gather == "step", schedule=cfg.train.pipeline_schedule,
                      overrides=standins.overrides if standins is not None else None)
  # an offloaded state streams the scanned stack a layer at a time where no pipeline stages split it
  optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps, split_layers=mesh.shape["pipeline"] == 1)
  # compile.warm_start (maxlm/runtime/warm_start.py): executables kept from an earlier start of this run, else kept now
  compiler = (warm_start.Compiler(warm_start.run_signature(cfg)) if warm_start.active() and standins is None
              and quantized else None)
  scope = functools.partial(_scope, cfg, backend, mesh, quantized, standins)
  make = (abstract_state if abstract else
          functools.partial(create_train_state, seed=cfg.train.seed, compiler=compiler))
  with scope():
    state, shardings = make(model, optimizer, mesh, batch=cfg.data.global_batch_size // cfg.train.grad_accum,
                            seq_len=cfg.data.seq_len, offload=cfg.optim.offload)
  packed = cfg.data.type != "synthetic"  # real documents are packed: attention stays inside each
  bs = batch_sharding(mesh)
  batch_shardings = {k: bs for k in BATCH_KEYS}
  train = make_train_step(model, optimizer, schedule, grad_accum=cfg.train.grad_accum, packed=packed,
                          guard=standins.guard if standins is not None else "cond")
  return Built(cfg, mesh, backend, model, optimizer, schedule, state, shardings, bs,
               CompiledStep(train, shardings, batch_shardings, scope, metrics_sharding=replicated(mesh),
                            compiler=compiler),
               CompiledStep(make_eval_step(model, packed=packed), shardings, batch_shardings, scope, donate=False,
                            metrics_sharding=replicated(mesh), name="eval_step"),
               scope)

