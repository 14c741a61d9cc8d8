"""Step times measured for the planner (maxlm/plan/timing.py): the trainer's compiled step run on a fresh state
and a synthetic batch of the run's shape, here on the 8 CPU devices (the planner times only GPUs at hand; the
function is the same). No speed is asserted: only that it runs the step and what it returns."""

import jax
import numpy as np
import pytest

from maxlm.config import load_config
from maxlm.plan import timing
from maxlm.parallel.sharding import batch_sharding
from maxlm.parallel.mesh import make_mesh

TINY = ["model.backend=flax", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.ffn_dim=64", "model.n_layers=1", "model.vocab_size=128", "data.type=synthetic", "data.seq_len=16",
        "data.global_batch_size=8"]


def test_time_step_runs_the_step_and_returns_seconds_per_step(monkeypatch):
  cfg = load_config(TINY + ["optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16"])
  runs = []
  real = timing.compile_step

  def counting(c, devices=None):
    compiled, parts = real(c, devices)

    def run(state, batch):
      runs.append(int(state.step))
      return compiled(state, batch)
    return run, parts
  monkeypatch.setattr(timing, "compile_step", counting)
  s = timing.time_step(cfg, steps=2)
  assert isinstance(s, float) and s > 0
  assert runs == [0, 1, 2]  # one warm-up step, then the two timed ones, on the state each step returns


def test_the_synthetic_batch_has_the_runs_shape_and_sharding():
  cfg = load_config(TINY)
  sharding = batch_sharding(make_mesh(cfg.mesh))
  b = timing.synthetic_batch(cfg, sharding)
  assert set(b) == {"inputs", "targets", "segment_ids", "positions"}
  for v in b.values():
    assert v.shape == (8, 16) and v.dtype == np.int32 and v.sharding == sharding
  assert np.array_equal(np.asarray(b["inputs"])[:, 1:], np.asarray(b["targets"])[:, :-1])
  assert 0 <= int(np.asarray(b["inputs"]).min()) and int(np.asarray(b["inputs"]).max()) < 128


def test_a_step_out_of_device_memory_is_none_and_other_errors_stay(monkeypatch):
  cfg = load_config(TINY)

  def failing(message):
    def compile_step(c, devices=None):
      def run(state, batch):
        raise jax.errors.JaxRuntimeError(message)
      return run, {}
    return compile_step
  monkeypatch.setattr(timing, "compile_step", failing("RESOURCE_EXHAUSTED: Out of memory allocating 1GiB"))
  assert timing.time_step(cfg) is None
  monkeypatch.setattr(timing, "compile_step", failing("INTERNAL: something else"))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # not a memory error: its traceback stays
    timing.time_step(cfg)
