"""The one builder of the train step (maxlm/build.py): its CompiledStep (shardings, scope per call, donation,
XLA's memory estimate, an executable supplied by a compiler), and that the trainer, the planner's measurement and
the dry run get the same program from it (the lowered StableHLO text, compared as text)."""

import contextlib
import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from maxlm.build import CompiledStep, Standins, build_step, memory_stats
from maxlm.cli import dryrun
from maxlm.config import load_config
from maxlm.parallel.mesh import AXES, make_mesh
from maxlm.plan import measure
from maxlm.runtime import warm_start
from maxlm.trainer import Trainer

# A tiny run on the 8 simulated devices (mesh fsdp=-1: all 8), two micro-batches. Scanned and without remat, as
# the dry run traces every model, so that the dry run's build is the run's too.
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=2", "model.vocab_size=128", "model.scan_layers=true", "model.remat=none",
        "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=16", "train.grad_accum=2",
        "train.steps=3", "train.eval_every=0", "checkpoint.enabled=false"]
BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]


def _lowered_text(step: CompiledStep, state, batch) -> str:
  return step.lower(state, batch).as_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_trainer_planner_and_dry_run_lower_the_same_train_step(tmp_path, backend):
  """The trainer (its initialized state, and --compile-only's abstract one), the planner's measurement and the dry
  run's build (on a concrete mesh of the same shape) lower one program, character for character; the dry run on
  its AbstractMesh builds the same state shapes, dtypes and partition specs. A different config (one micro-batch
  instead of two) lowers another text: the comparison can tell programs apart."""
  cfg = load_config([*TINY, f"model.backend={backend}", f"output_dir={tmp_path}"])
  trainer = Trainer(cfg)
  try:
    trainer.build()
    batch = trainer.built.batch_structs()
    want = _lowered_text(trainer.jitted_train_step, trainer.state, batch)
    abstract = Trainer(cfg)
    abstract.build(abstract=True)  # --compile-only
    abstract.close()
    assert _lowered_text(abstract.jitted_train_step, abstract.state, batch) == want
    planned, gpu_dtypes = measure.measured_build(cfg)
    assert not gpu_dtypes and _lowered_text(planned.train_step, planned.state, planned.batch_structs()) == want
    dry = dryrun.build(cfg, trainer.mesh, exact_meta=True)
    assert _lowered_text(dry.train_step, dry.state, dry.batch_structs()) == want

    sized = dryrun.build(cfg, AbstractMesh(tuple(trainer.mesh.shape[a] for a in AXES), AXES), exact_meta=True)
    got = jax.tree.leaves(jax.tree.map(lambda a, s: (a.shape, a.dtype, s.spec), sized.state, sized.state_shardings))
    ran = jax.tree.leaves(jax.tree.map(lambda a, s: (a.shape, a.dtype, s.spec), trainer.state,
                                       trainer.state_shardings))
    assert got == ran and len(got) > 10

    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=1))
    planned, _ = measure.measured_build(other)
    assert _lowered_text(planned.train_step, planned.state, planned.batch_structs()) != want
  finally:
    trainer.close()


def test_the_warm_start_keeps_the_runs_program_never_a_measurement_with_stand_ins(tmp_path):
  """Under compile.warm_start the run's train step gets the store's compiler (keyed by the run's config); a build
  with the planner's stand-ins (a program the run never runs) gets none, nor does the eval step."""
  cfg = load_config([*TINY, "model.backend=flax"])
  mesh = make_mesh(cfg.mesh)
  warm_start.configure(tmp_path, True)
  try:
    run = build_step(cfg, mesh, abstract=True)
    measured = build_step(cfg, mesh, abstract=True, standins=Standins())
  finally:
    warm_start.configure(None, False)
  assert isinstance(run.train_step.compiler, warm_start.Compiler)
  assert run.train_step.compiler.cfg_parts == warm_start.run_signature(cfg)
  assert run.eval_step.compiler is None and measured.train_step.compiler is None


# ---- CompiledStep ----------------------------------------------------------------------------------

def test_compiled_step_places_outputs_enters_the_scope_per_call_and_donates():
  """The trainer's jit wrapper: outputs land on the given shardings (state split over 2 devices, metrics
  replicated), every call runs inside `scope()`, the state is donated (its buffers consumed) unless
  donate=False, which returns the metrics alone and leaves the state usable."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  split, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  entered = []

  @contextlib.contextmanager
  def scope():
    entered.append(len(entered))
    yield

  def step(state, batch):
    return {"w": state["w"] + batch["x"].sum()}, {"m": state["w"] * 2}

  train = CompiledStep(step, {"w": split}, {"x": rep}, scope, metrics_sharding=rep)
  state = {"w": jax.device_put(np.arange(4.0, dtype=np.float32), split)}
  new, m = train(state, {"x": np.ones(3, np.float32)})
  np.testing.assert_array_equal(new["w"], [3.0, 4.0, 5.0, 6.0])  # exact small integers
  np.testing.assert_array_equal(m["m"], [0.0, 2.0, 4.0, 6.0])
  assert new["w"].sharding.is_equivalent_to(split, 1) and m["m"].sharding.is_equivalent_to(rep, 1)
  assert state["w"].is_deleted() and entered == [0]
  assert train.lower_s >= 0 and train.compile_s >= 0 and not train.loaded and train.background_s is None
  evaluate = CompiledStep(lambda s, b: {"loss": s["w"].sum() + b["x"].sum()}, {"w": split}, {"x": rep}, scope,
                          donate=False, metrics_sharding=rep)
  out = evaluate(new, {"x": np.ones(3, np.float32)})
  assert set(out) == {"loss"} and float(out["loss"]) == 21.0 and out["loss"].sharding.is_equivalent_to(rep, 0)
  assert not new["w"].is_deleted() and entered == [0, 1]


def test_compiled_step_compiles_for_the_batch_shardings_and_estimates_per_device_memory():
  """The batch is placed as batch_shardings say before the step runs: split over 2 devices, XLA's
  per-device estimate (compiled_memory_gb, 1e9 bytes) holds half of its 4 MiB; replicated, at least all of it.
  The donated state (1 MiB per device) counts once, its update reusing its buffer; the rest (a scalar metric,
  no temporaries worth a page) stays under 1 KiB."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  split, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

  def step(state, batch):
    return {"w": state["w"] + batch["x"].sum()}, {"m": state["w"].sum()}
  gb = {}
  for name, batch_sharding in (("split", split), ("replicated", rep)):
    train = CompiledStep(step, {"w": split}, {"x": batch_sharding}, contextlib.nullcontext, metrics_sharding=rep)
    assert train.compiled_memory_gb is None  # until the first call compiles
    state = {"w": jax.device_put(np.zeros(2 ** 19, np.float32), split)}  # 1 MiB per device, donated
    train(state, {"x": np.ones(2 ** 20, np.float32)})
    gb[name] = train.compiled_memory_gb
    assert memory_stats(train.executable)["device"] == round(gb[name] * 1e9)
  # split: half the batch (2 MiB) and the donated state's 1 MiB once (the new state reuses its buffer)
  assert 2 ** 21 + 2 ** 20 <= gb["split"] * 1e9 <= 2 ** 21 + 2 ** 20 + 1024
  assert gb["replicated"] * 1e9 >= gb["split"] * 1e9 + 2 ** 21  # the whole batch on each device


def test_a_compiler_supplies_the_executable_and_how_it_came():
  """With `compiler` (the warm start's), the step asks it once, under its name, for the executable of the jitted
  step and the arguments of the first call; the calls run that executable, and the step keeps the compiler's
  account (loaded, seconds)."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  rep = NamedSharding(mesh, P())
  asked = []

  class Kept:
    """The compiled step, answering {"ran": "kept"} for its metrics: what ran is this executable."""

    def __init__(self, exe):
      self.exe = exe

    def memory_analysis(self):
      return self.exe.memory_analysis()

    def __call__(self, s, b):
      return self.exe(s, b)[0], {"ran": "kept"}

  def compiler(name, jitted, args):
    asked.append(name)
    return SimpleNamespace(executable=Kept(jitted.lower(*args).compile()), loaded=True, lower_s=0.0,
                           compile_s=0.25, background_s=1.5)

  train = CompiledStep(lambda s, b: (s, {"ran": s["w"]}), {"w": rep}, {"x": rep}, contextlib.nullcontext,
                       metrics_sharding=rep, compiler=compiler, name="train_step")
  for _ in range(2):
    state, m = train({"w": jax.device_put(np.ones(2, np.float32), rep)}, {"x": np.ones(2, np.float32)})
    assert m == {"ran": "kept"}
  assert asked == ["train_step"]
  assert (train.loaded, train.lower_s, train.compile_s, train.background_s) == (True, 0.0, 0.25, 1.5)
