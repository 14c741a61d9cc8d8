"""Checkpoints across the optimizer-state levers (optim.mu_dtype, optim.nu_dtype, optim.moment_rounding,
optim.offload; maxlm/optim.py and maxlm/offload.py): a checkpoint written under each moment setting (float32
moments on the device; MaxText's bfloat16 mu with a float32 nu; bfloat16 moments, stochastically rounded, in
host memory; a bfloat16 mu with the float32 parameters and the moments in host memory, optim.offload=host_params)
resumes under each of the others. The layout is the same (leaf paths and shapes); the moments are
read as saved, their checksums verified, then cast (float32 -> bfloat16 rounds to nearest even, bfloat16 ->
float32 is exact) into the memory the resuming run keeps them in (the parameters too: host_params); the next
step runs."""

import shutil

import jax
import numpy as np
import pytest
from resume_launcher import compile_cache

from maxlm.checkpoint import start
from maxlm.cli.train import main
from maxlm.config import load_config
from maxlm.trainer import Trainer


def _start(t, cfg):
  """maxlm.checkpoint.start for a Trainer, as the trainer takes it: the state into `t`; the Checkpointer."""
  r = start(t.state, t.state_shardings, t.train_data, cfg)
  t.state = r.state
  return r.checkpointer

SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
         "model.n_layers=1", "model.vocab_size=128", "model.remat=none", "data.type=synthetic",
         "data.seq_len=16", "data.global_batch_size=8", "optim.warmup_steps=0", "train.log_every=1",
         "train.eval_every=0", "checkpoint.enabled=true", "model.backend=flax", "run_name=r"]
SETTINGS = {
    "fp32": ["optim.mu_dtype=float32", "optim.nu_dtype=float32", "optim.offload=none"],
    "bf16mu": ["optim.mu_dtype=bfloat16", "optim.nu_dtype=float32", "optim.moment_rounding=nearest",
               "optim.offload=none"],
    "bf16-sr-host": ["optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16", "optim.moment_rounding=stochastic",
                     "optim.offload=host"],
    "bf16mu-host-params": ["optim.mu_dtype=bfloat16", "optim.nu_dtype=float32", "optim.moment_rounding=nearest",
                           "optim.offload=host_params"],
}
BF16 = np.dtype(jax.numpy.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def _shared_compilations(tmp_path_factory):
  with compile_cache(tmp_path_factory.mktemp("xla-cache")):
    yield


def _round_bf16(x: np.ndarray) -> np.ndarray:
  """float32 -> the nearest bfloat16 (ties to even), as float32: the top 16 bits after adding 0x7FFF plus the
  lowest kept bit (finite inputs)."""
  u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
  return u.astype(np.uint32).view(np.float32)


def _resumed(args):
  """A Trainer built from `args`, resumed from its run's checkpoint."""
  cfg = load_config(args)
  t = Trainer(cfg)
  t.build()
  _start(t, cfg).close()
  return t


def _leaves(state) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): x for p, x in flat}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """{setting: (its run's output_dir after 2 steps, the state its checkpoint restores to under the setting
  that wrote it, as numpy)}: the reference, every array as saved, checksums verified (tests/test_checkpoint*.py)."""
  out = {}
  for name, levers in SETTINGS.items():
    root = tmp_path_factory.mktemp(name)
    args = SMALL + [f"output_dir={root}"] + levers
    assert main(args + ["train.steps=2"]) == 0
    out[name] = (root, {k: np.asarray(x) for k, x in _leaves(_resumed(args + ["train.steps=3"]).state).items()})
  return out


PAIRS = [(a, b) for a in SETTINGS for b in SETTINGS if a != b]


@pytest.mark.parametrize("saved_with,resumed_with", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_checkpoint_resumes_across_moment_dtypes_and_offload(tmp_path, saved, saved_with, resumed_with):
  root, reference = saved[saved_with]
  shutil.copytree(root, tmp_path / "out")
  levers = SETTINGS[resumed_with]
  t = _resumed(SMALL + [f"output_dir={tmp_path / 'out'}"] + levers + ["train.steps=3"])
  got = _leaves(t.state)
  assert got.keys() == reference.keys()
  dtypes = {".mu[": "optim.mu_dtype=bfloat16" in levers, ".nu[": "optim.nu_dtype=bfloat16" in levers}
  host_params = "optim.offload=host_params" in levers
  host = host_params or "optim.offload=host" in levers
  moments = [k for k in got if ".mu[" in k or ".nu[" in k]
  params = [k for k in got if k.startswith(".params")]
  assert moments and params and int(got[".step"]) == 2
  for k, x in got.items():
    want = reference[k]
    assert x.shape == want.shape, k
    if k in params:
      assert x.sharding.memory_kind == ("pinned_host" if host_params else "device"), k
    if k in moments:
      bf16 = dtypes[".mu[" if ".mu[" in k else ".nu["]
      assert x.dtype == (BF16 if bf16 else np.float32), k
      assert x.sharding.memory_kind == ("pinned_host" if host else "device"), k
      want = _round_bf16(want) if bf16 else want.astype(np.float32)  # bf16 -> f32 is exact
    assert np.array_equal(np.asarray(x, np.float32) if k in moments else np.asarray(x), want), k
  t.state, m = t.train_step(t.state, t.to_device(next(t.train_data)))
  assert bool(m["finite"]) and int(t.state.step) == 3
