"""Train step: fp32 loss, gradient accumulation, non-finite skipping, FP8 delayed-scaling state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.config import MeshConfig, ModelConfig, OptimConfig
from maxlm.layers import FP8_COLLECTION, PrecisionError, check_precision, precision_scope
from maxlm.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.optim import make_optimizer
from maxlm.step import make_eval_step, make_train_step, token_losses
from maxlm.train_state import create_train_state

MODEL = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                    dtype="float32", remat="none", backend="flax")


def batch(b=4, t=8, seed=0, vocab=128):
  toks = np.random.default_rng(seed).integers(0, vocab, (b, t + 1), dtype=np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((b, t), np.int32),
          "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))}


def setup(cfg=MODEL, precision="bf16", optim=OptimConfig(warmup_steps=0), grad_accum=1, b=4, t=8):
  model = Transformer(cfg)
  opt, sched = make_optimizer(optim, 10)
  mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
  backend = cfg.backend
  with jax.set_mesh(mesh), precision_scope(precision, backend, cfg.fp8_amax_history_len):
    state, _ = create_train_state(model, opt, mesh, 0, b // grad_accum, t)
  step = jax.jit(make_train_step(model, opt, sched, grad_accum=grad_accum))

  def run(state, bt):
    with jax.set_mesh(mesh), precision_scope(precision, backend, cfg.fp8_amax_history_len):
      return step(state, bt)
  return state, run, model


def test_token_losses_reference():
  logits = jnp.array([[[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]]])
  loss, n = token_losses(logits, jnp.array([[2, 0]]), jnp.array([[1, 0]]))
  assert float(n) == 1.0
  np.testing.assert_allclose(float(loss), -np.log(np.exp(3) / np.exp([1, 2, 3]).sum()), rtol=1e-6)


def test_loss_is_fp32_mean_over_masked_tokens():
  state, run, model = setup(dataclasses.replace(MODEL, dtype="bfloat16"))
  bt = batch()
  bt["segment_ids"][:, -3:] = 0  # padding: excluded from the loss
  _, m = run(state, bt)
  logits = jax.jit(model.apply)({"params": state.params}, bt["inputs"]).astype(jnp.float32)
  lp = jax.nn.log_softmax(logits)
  nll = -np.take_along_axis(np.asarray(lp), bt["targets"][..., None], -1)[..., 0]
  np.testing.assert_allclose(float(m["loss"]), nll[:, :-3].mean(), rtol=1e-5)
  assert float(m["tokens"]) == 4 * 5


def test_gradient_accumulation_equals_full_batch():
  bt = batch(b=8)
  s1, run1, _ = setup(b=8)
  s4, run4, _ = setup(b=8, grad_accum=4)
  n1, m1 = run1(s1, bt)
  n4, m4 = run4(s4, bt)
  np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
  # Adam (lr 3e-3) turns summation-order noise on near-zero gradients into up to one step of
  # difference, so parameters agree to 1% of a step rather than bitwise.
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=3e-5), n4.params, n1.params)


def test_nonfinite_update_is_skipped_and_counted():
  state, run, _ = setup()
  poisoned = jax.tree_util.tree_map(lambda x: x, state)
  emb = poisoned.params["embed"]["embedding"].at[3].set(jnp.nan)
  poisoned = poisoned.replace(params={**poisoned.params, "embed": {"embedding": emb}})
  bt = batch()
  bt["inputs"][0, 0] = 3
  new, m = run(poisoned, bt)
  assert not bool(m["finite"]) and int(m["nonfinite_steps"]) == 1
  assert int(new.step) == 1
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                         new.params, poisoned.params)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                         new.opt_state, poisoned.opt_state)


def test_eval_step_matches_train_loss():
  state, run, model = setup()
  bt = batch()
  ev = jax.jit(make_eval_step(model))(state, bt)
  _, m = run(state, bt)
  np.testing.assert_allclose(float(ev["loss_sum"] / ev["tokens"]), float(m["loss"]), rtol=1e-6)


def test_fp8_refused_without_support():
  with pytest.raises(PrecisionError, match="needs model.backend=te"):
    check_precision("fp8_delayed", "flax")


@pytest.mark.te
def test_fp8_refused_on_cpu_without_fake_gpu():
  with pytest.raises(PrecisionError, match="not supported on this device"):
    check_precision("fp8_current", "te")


@pytest.mark.te
@pytest.mark.parametrize("precision", ["fp8_delayed", "fp8_current"])
def test_fp8_state_threads_through_steps(fake_fp8_gpu, precision):
  check_precision(precision, "te")
  cfg = dataclasses.replace(MODEL, backend="te", precision=precision, fp8_amax_history_len=4, n_layers=1)
  state, run, _ = setup(cfg, precision)
  if precision == "fp8_current":  # current scaling keeps no state
    assert FP8_COLLECTION not in state.model_state
    _, m = run(state, batch())
    assert np.isfinite(float(m["loss"]))
    return
  metas = state.model_state[FP8_COLLECTION]
  hist0 = np.asarray(metas["layers"]["qkv"]["x_amax_history"])  # [L, history]
  assert not hist0.any()
  # The optimizer state mirrors params only (Adam mu/nu + two step counters): no FP8 metadata.
  adam = state.opt_state[1][0]
  assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(state.params)
  n_opt = len(jax.tree_util.tree_leaves(state.opt_state))
  assert n_opt == 2 + 2 * len(jax.tree_util.tree_leaves(state.params))
  s1, m1 = run(state, batch(seed=1))
  s2, m2 = run(s1, batch(seed=2))
  h1 = np.asarray(s1.model_state[FP8_COLLECTION]["layers"]["qkv"]["x_amax_history"])
  h2 = np.asarray(s2.model_state[FP8_COLLECTION]["layers"]["qkv"]["x_amax_history"])
  assert (h1 != 0).sum() == 1 and (h2 != 0).sum() == 2  # one new amax per step
  np.testing.assert_array_equal(h2[..., :-1], h1[..., 1:])  # the history shifts; old amaxes are kept
  scale = np.asarray(s2.model_state[FP8_COLLECTION]["layers"]["qkv"]["x_scale"])
  assert np.all(scale != 1.0) and np.all(np.isfinite(scale))
  # Updating the FP8 state is not an optimizer update: weight decay / clipping never see it.
  assert int(s2.step) == 2 and np.isfinite(float(m2["loss"]))
