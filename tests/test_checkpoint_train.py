"""Checkpointing inside training, in-process (8 simulated CPU devices): `maxlm.train.main` with
train.nonfinite=skip|stop around checkpoints, and FP8 delayed-scaling state carried exactly."""

import json

import jax
import numpy as np
import pytest
from resume_launcher import compile_cache, poisoned_losses

from maxlm import step as step_lib
from maxlm.checkpoint import Checkpointer, abstract_like
from maxlm.config import load_config, to_dict
from maxlm.optim import make_optimizer
from maxlm.train import Trainer, main
from maxlm.train_state import abstract_state

SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
         "model.n_layers=1", "model.vocab_size=128", "model.remat=none", "data.type=synthetic",
         "data.seq_len=16", "data.global_batch_size=8", "optim.warmup_steps=0", "train.log_every=1",
         "checkpoint.enabled=true", "model.backend=flax"]


@pytest.fixture(scope="module", autouse=True)
def _shared_compilations(tmp_path_factory):
  """The runs below compile the same programs: compile each once."""
  with compile_cache(tmp_path_factory.mktemp("xla-cache")):
    yield


def _args(tmp_path, *extra):
  return SMALL + [f"output_dir={tmp_path}", "run_name=r", *extra]


def _leaves(state) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _rows(run_dir):
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _restore(run_dir, args):
  cfg = load_config(args)
  t = Trainer(cfg)
  with t.scope():  # TE layers need the mesh resource even to trace shapes
    target, _ = abstract_state(t.model, make_optimizer(cfg.optim, cfg.train.steps)[0], t.mesh,
                               cfg.data.global_batch_size, cfg.data.seq_len)
  ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
  try:
    return ckpt.restore_latest(target, to_dict(cfg))
  finally:
    ckpt.close()


def test_nonfinite_skip_counts_and_checkpoints_stay_finite(tmp_path, monkeypatch):
  args = _args(tmp_path, "train.steps=8", "checkpoint.every=2")
  monkeypatch.setattr(step_lib, "token_losses", poisoned_losses(load_config(args), [3]))
  assert main(args) == 0
  rows = _rows(tmp_path / "r")
  assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
  assert rows[2]["loss"] == "nan" and all(np.isfinite(r["loss"]) for i, r in enumerate(rows) if i != 2)
  assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["4", "6", "8"]  # keep=3
  r = _restore(tmp_path / "r", args)  # verifies every checksum
  assert r.step == 8 and int(r.state.nonfinite_steps) == 1


@pytest.mark.parametrize("log_every,where", [(1, "at step 3 (loss=nan"), (5, "between steps 3 and 4")])
def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys, log_every, where):
  args = _args(tmp_path, "train.steps=8", "checkpoint.every=2", "train.nonfinite=stop",
               f"train.log_every={log_every}")
  monkeypatch.setattr(step_lib, "token_losses", poisoned_losses(load_config(args), [3]))
  assert main(args) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and where in err[0], err
  assert f"the last good checkpoint is step 2 in {tmp_path / 'r' / 'checkpoints'}" in err[0]
  assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["2"]


@pytest.mark.te
def test_fp8_delayed_scaling_state_survives_a_checkpoint(tmp_path, fake_fp8_gpu):
  """Save after 3 steps, train 3 more; restore the checkpoint and train the same 3 batches again:
  losses and every array (params, Adam moments, amax histories, scales, RNG) are bit-identical."""
  cfg = load_config(_args(tmp_path, "model.backend=te", "model.precision=fp8_delayed",
                          "model.fp8_amax_history_len=4"))
  t = Trainer(cfg)
  t.build()
  batches = [t.to_device(next(t.train_data)) for _ in range(6)]
  for b in batches[:3]:
    t.state, _ = t.train_step(t.state, b)
  ckpt = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint)
  ckpt.save(3, t.state, t.train_data.get_state(), to_dict(cfg))
  target = abstract_like(t.state, t.state_shardings)
  losses = []
  for b in batches[3:]:
    t.state, m = t.train_step(t.state, b)
    losses.append(float(m["loss"]))
  want = _leaves(t.state)
  r = ckpt.restore_latest(target, to_dict(cfg))
  ckpt.close()
  metas = r.state.model_state["fp8_metas"]["layers"]["qkv"]
  hist = np.asarray(metas["x_amax_history"])  # [L, 4]: the amaxes of steps 1-3, newest last
  assert r.step == 3 and (hist != 0).sum() == 3 and np.all(np.asarray(metas["x_scale"]) != 1.0)
  state, again = r.state, []
  for b in batches[3:]:
    state, m = t.train_step(state, b)
    again.append(float(m["loss"]))
  assert again == losses
  got = _leaves(state)
  assert got.keys() == want.keys() and any("amax_history" in k for k in got)
  for k in want:
    assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
