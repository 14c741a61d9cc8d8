"""compile.warm_start (maxlm/runtime/warm_start.py): a restart of the same run loads the executables an earlier start
kept (and the planner's decision), runs exactly them, and misses whenever anything that decides the program
changed.

The end-to-end runs are fresh processes on CPU, as restarts are, each with its own cache directory. The
reference for "runs exactly them" is the first start's own losses (and a start with compile.warm_start=false):
bit-identical per step, which CPU XLA gives for one program on one machine.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from maxlm.plan import decision as plan_decision
from maxlm.plan import levers as plan_levers
from maxlm.config import load_config
from maxlm.runtime import warm_start

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.backend=flax", "model.vocab_size=128", "data.type=synthetic",
        "data.seq_len=16", "data.global_batch_size=4", "train.steps=3", "train.log_every=1",
        "train.eval_every=0", "checkpoint.enabled=false"]
LOADED = "maxlm: compilation cache: the train step's executable, kept by an earlier start of this run, loaded in"


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp}",
                         f"compile.cache_dir={tmp / 'cache'}", *TINY, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def _rows(run_dir: Path) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
  return [r["loss"] for r in _rows(run_dir)]


def _entries(tmp: Path, kind: str) -> list[Path]:
  return sorted((tmp / "cache" / warm_start.SUBDIR).glob(f"{kind}-*.pkl"))


def test_a_restart_runs_the_kept_executables_and_a_changed_config_compiles_again(tmp_path):
  first = _train(tmp_path, "run_name=a")
  assert first.returncode == 0, first.stderr
  assert LOADED not in first.stdout
  assert len(_entries(tmp_path, "init")) == 1 and len(_entries(tmp_path, "train_step")) == 1
  second = _train(tmp_path, "run_name=b")  # another name and directory: the same program
  assert second.returncode == 0, second.stderr
  assert LOADED in second.stdout, second.stdout
  cold, warm = _rows(tmp_path / "a")[0], _rows(tmp_path / "b")[0]
  assert warm["warm_start"] and not cold["warm_start"]
  assert warm["lower_s"] == 0.0 and cold["lower_s"] > 0
  off = _train(tmp_path, "run_name=off", "compile.warm_start=false")
  assert off.returncode == 0, off.stderr
  assert LOADED not in off.stdout
  assert _losses(tmp_path / "b") == _losses(tmp_path / "a") == _losses(tmp_path / "off")
  # a key that misses: another learning rate is another program (the schedule is compiled in)
  other = _train(tmp_path, "run_name=c", "optim.learning_rate=0.01")
  assert other.returncode == 0, other.stderr
  assert LOADED not in other.stdout
  assert len(_entries(tmp_path, "train_step")) == 2
  assert _losses(tmp_path / "c")[1:] != _losses(tmp_path / "a")[1:]


def test_a_damaged_entry_is_a_miss_and_is_written_again(tmp_path):
  # compile.min_compile_s=1000: JAX's cache keeps nothing, so the restart compiles (an executable from JAX's
  # cache is never kept: the next test)
  keep_out_of_jax = "compile.min_compile_s=1000"
  assert _train(tmp_path, "run_name=a", keep_out_of_jax).returncode == 0
  (entry,) = _entries(tmp_path, "train_step")
  whole = entry.read_bytes()
  entry.write_bytes(whole[: len(whole) // 2])  # a writer killed mid-write (maxlm writes atomically; others may not)
  again = _train(tmp_path, "run_name=b", keep_out_of_jax)
  assert again.returncode == 0, again.stderr
  assert LOADED not in again.stdout
  assert entry.read_bytes() != whole[: len(whole) // 2]
  assert _losses(tmp_path / "b") == _losses(tmp_path / "a")
  assert LOADED in _train(tmp_path, "run_name=c", keep_out_of_jax).stdout


def test_an_executable_from_jax_cache_is_not_kept(tmp_path):
  """On XLA:CPU an executable that JAX's persistent cache loaded serializes without its kernels (the entry
  fails when run: NOT_FOUND ... not found). A start whose train step is a JAX-cache hit keeps no entry for it,
  and the next start runs."""
  every = "compile.min_compile_s=0"  # JAX keeps every program
  assert _train(tmp_path, "run_name=a", every, "compile.warm_start=false").returncode == 0
  b = _train(tmp_path, "run_name=b", every)
  assert b.returncode == 0, b.stderr
  assert "the train step came from the cache (hit" in b.stdout, b.stdout
  assert not _entries(tmp_path, "train_step")
  c = _train(tmp_path, "run_name=c", every)
  assert c.returncode == 0, c.stderr
  assert _losses(tmp_path / "c") == _losses(tmp_path / "a")


def test_compile_only_leaves_the_train_step_for_the_run(tmp_path):
  ahead = _train(tmp_path, "run_name=r", "--compile-only")
  assert ahead.returncode == 0, ahead.stderr
  assert not (tmp_path / "r").exists()
  run = _train(tmp_path, "run_name=r")
  assert run.returncode == 0, run.stderr
  assert LOADED in run.stdout, run.stdout


def test_the_key_holds_the_config_less_names_paths_and_logging():
  base = load_config(TINY)
  same = load_config(TINY + ["run_name=other", "output_dir=/elsewhere", "train.log_every=7", "checkpoint.every=3",
                             "compile.cache_dir=/x"])
  assert warm_start.run_signature(same) == warm_start.run_signature(base)
  for change in ("optim.learning_rate=0.5", "data.seq_len=32", "model.remat=none", "train.steps=9", "train.seed=4"):
    other = warm_start.run_signature(load_config(TINY + [change]))
    assert other != warm_start.run_signature(base), change
    assert warm_start.key("train_step", other) != warm_start.key("train_step", warm_start.run_signature(base))


def test_the_key_holds_the_environment_xla_reads(monkeypatch):
  parts = warm_start.run_signature(load_config(TINY))
  before = warm_start.key("train_step", parts)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
  assert warm_start.key("train_step", parts) != before
  monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
  monkeypatch.delenv("XLA_FLAGS")
  assert warm_start.key("train_step", parts) != before


def test_several_processes_keep_only_process_0s_decisions_and_nothing_when_off(tmp_path, monkeypatch):
  """Executables are kept in a run of one process only (they hold its device assignment); the planner's decision
  also by process 0 of several, which decides for all of them (maxlm/plan/__init__.py for_run); never when off."""
  Entry = warm_start.Entry
  warm_start.configure(tmp_path, True)
  try:
    Entry("plan", ["x"]).save(1)
    Entry("train_step", ["x"]).save(2)
    assert Entry("plan", ["x"]).load() == 1 and Entry("train_step", ["x"]).load() == 2
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not warm_start.active() and warm_start.active("plan")
    assert Entry("train_step", ["x"]).load() is None and Entry("plan", ["x"]).load() == 1
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert not warm_start.active("plan") and Entry("plan", ["x"]).load() is None
    monkeypatch.undo()
    warm_start.configure(tmp_path, False)
    assert Entry("plan", ["x"]).load() is None and Entry("train_step", ["x"]).load() is None
  finally:
    warm_start.configure(None, False)


def test_the_planners_decision_is_kept_and_reused(tmp_path, monkeypatch):
  """plan_decision.resolve_kept: the first start measures (resolve), a restart of the same run takes the decision it
  kept and says so; a changed config measures again."""
  calls = []

  def fake_resolve(cfg, *a, **k):
    calls.append(cfg)
    os.environ["NVTE_SET_BY_AN_IMPORT"] = "1"  # as importing TE does, inside the planner's first measurement
    return plan_levers.apply(cfg, {"model.remat": "full"}), "plan: chose model.remat=full"

  monkeypatch.setattr(plan_decision, "resolve", fake_resolve)
  monkeypatch.delenv("NVTE_SET_BY_AN_IMPORT", raising=False)
  warm_start.configure(tmp_path, True)
  try:
    cfg = load_config(TINY + ["plan.mode=auto"])
    out, line = plan_decision.resolve_kept(cfg)
    assert len(calls) == 1 and out.model.remat == "full" and line == "plan: chose model.remat=full"
    monkeypatch.delenv("NVTE_SET_BY_AN_IMPORT")  # a restart starts without it again
    again, line2 = plan_decision.resolve_kept(dataclasses.replace(cfg, run_name="restart"))
    assert len(calls) == 1 and again.model.remat == "full"
    assert line2 == "plan: chose model.remat=full (kept from an earlier start of this shape on these GPUs)"
    # another user's run of the same shape (another directory, learning rate, length, seeds, data files): no planning
    other = load_config(TINY + ["plan.mode=auto", "run_name=theirs", f"output_dir={tmp_path / 'o'}", "train.steps=7",
                                "optim.learning_rate=1e-4", "optim.warmup_steps=1", "data.seed=3", "train.seed=5"])
    assert plan_decision.resolve_kept(other)[0].model.remat == "full" and len(calls) == 1
    # what shapes the step is in the key: another micro-batch count, moment dtype or decay plans again
    for word in ("train.grad_accum=2", "optim.mu_dtype=bfloat16", "optim.b2=0.999"):
      plan_decision.resolve_kept(load_config(TINY + ["plan.mode=auto", word]))
    assert len(calls) == 4
    plan_decision.resolve_kept(load_config(TINY + ["plan.mode=auto", "data.seq_len=32"]))
    assert len(calls) == 5
    # the memory the planner counts as usable is in the key too (another xla.mem_fraction, another GPU)
    from maxlm.plan import target as plan_target
    monkeypatch.setattr(plan_target, "_local_memory", lambda dev: 2 ** 30)
    plan_decision.resolve_kept(cfg)
    assert len(calls) == 6
  finally:
    warm_start.configure(None, False)


@pytest.mark.parametrize("mode", ["off"])
def test_plan_mode_off_keeps_nothing(tmp_path, mode):
  warm_start.configure(tmp_path, True)
  try:
    cfg = load_config(TINY + [f"plan.mode={mode}"])
    assert plan_decision.resolve_kept(cfg) == (cfg, None)
    assert not list(Path(tmp_path, warm_start.SUBDIR).glob("plan-*"))
  finally:
    warm_start.configure(None, False)


def test_the_planners_compile_is_the_runs_train_step(tmp_path):
  """plan.mode=fit measures the configured step on the GPUs at hand by compiling it: that executable is kept
  under the trainer's key, so the run's start loads it instead of tracing and compiling the step again."""
  from maxlm.plan.measure import compile_step
  from maxlm.trainer import Trainer

  cfg = load_config([*TINY, "plan.mode=off", f"output_dir={tmp_path}", "data.global_batch_size=8"])  # 8 CPU devices
  warm_start.configure(tmp_path, True)
  try:
    compile_step(cfg)
    assert len(list((tmp_path / warm_start.SUBDIR).glob("train_step-*.pkl"))) == 1
    trainer = Trainer(cfg)
    trainer.build()
    trainer.compile_train_step()
    assert trainer.jitted_train_step.loaded and trainer.jitted_train_step.lower_s == 0.0
  finally:
    warm_start.configure(None, False)


def _warm_pair(tmp_path, monkeypatch, ffn_dim, edit_manifest=None):
  """A first start (compiles and keeps), then a restart in this process after `configure` (as a new process
  would start); the restart may not trace the model's init. Returns (cold, warm) trainers and each one's
  first-step metrics on one batch. `ffn_dim`: a model no other test of this process compiles (XLA:CPU, jax
  0.10.2: an executable this process compiled already comes from JAX's in-memory cache, and serializes
  without its kernels, "NOT_FOUND: Function ... not found", as one from the persistent cache does)."""
  import numpy as np

  from maxlm import train_state
  from maxlm.trainer import Trainer

  cfg = load_config([*TINY, "plan.mode=off", f"output_dir={tmp_path}", "data.global_batch_size=8",  # 8 devices
                     f"model.ffn_dim={ffn_dim}"])
  warm_start.configure(tmp_path, True)
  try:
    cold = Trainer(cfg)
    cold.build()
    cold.compile_train_step()
    built = jax.tree.map(lambda x: np.array(x, copy=True), cold.state)  # a copy: the step donates the state
    batch = next(iter(cold.train_data))
    cold.state, cold_metrics = cold.train_step(cold.state, cold.to_device(batch))
    if edit_manifest is not None:
      (manifest,) = (tmp_path / warm_start.SUBDIR).glob("run-*.pkl")
      edit_manifest(manifest)
    warm_start.configure(tmp_path, True)  # a new start: nothing loaded ahead yet
    monkeypatch.setattr(train_state, "abstract_state", lambda *a, **k: pytest.fail("the init was traced"))
    warm = Trainer(cfg)
    warm.build()
    monkeypatch.undo()
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a == b, cold.state_shardings, warm.state_shardings)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(warm.state),
                                                     strict=True))
    warm.compile_train_step()
    warm.state, warm_metrics = warm.train_step(warm.state, warm.to_device(batch))
    return cold, warm, jax.device_get(cold_metrics), jax.device_get(warm_metrics)
  finally:
    warm_start.configure(None, False)


def test_a_restart_loads_its_executables_ahead_and_traces_nothing(tmp_path, monkeypatch):
  """The run's manifest names the entries its last start used: a restart loads them in background threads
  from the moment its config is final. The init's executable gives the state and its shardings (the model's
  init is not traced for them); the train step is the one loaded ahead; both equal the first start's."""
  cold, warm, cold_m, warm_m = _warm_pair(tmp_path, monkeypatch, ffn_dim=80)
  assert not cold.jitted_train_step.loaded and cold.jitted_train_step.background_s is None
  step = warm.jitted_train_step
  assert step.loaded and step.lower_s == 0.0 and step.background_s is not None and step.background_s > 0
  assert {k: float(v) for k, v in warm_m.items()} == {k: float(v) for k, v in cold_m.items()}


def test_a_manifest_that_names_another_entry_is_not_trusted(tmp_path, monkeypatch):
  """The manifest is a hint: an executable loaded ahead is taken only when it is the file this start's own key
  names (here the manifest points the train step at the init's file). The step is then loaded the usual way."""
  import pickle

  def swap(path):
    kept = pickle.loads(path.read_bytes())
    kept["train_step"] = (kept["init"][0], kept["train_step"][1])
    path.write_bytes(pickle.dumps(kept))

  _, warm, cold_m, warm_m = _warm_pair(tmp_path, monkeypatch, ffn_dim=96, edit_manifest=swap)
  step = warm.jitted_train_step
  assert step.loaded and step.background_s is None  # from the store, not from the (wrong) file loaded ahead
  assert {k: float(v) for k, v in warm_m.items()} == {k: float(v) for k, v in cold_m.items()}
