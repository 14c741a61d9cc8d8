"""Learning-rate schedules, the weight-decay mask, clipping and Adam's hyperparameters."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.config import OptimConfig
from maxlm.optim import decay_mask, learning_rate_schedule, make_optimizer

U32 = 2.0 ** -24  # float32 unit roundoff: optax evaluates schedules and updates in float32


def test_warmup_then_cosine():
  s = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
  # a few float32 roundings (step / W, the cosine's argument and value, the blend): <= 16 ulps
  rel = 16 * U32
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5, rel=rel)
  assert float(s(10)) == pytest.approx(1.0, rel=rel)
  assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=rel)  # half-way through the cosine
  assert float(s(110)) == pytest.approx(0.1, rel=rel)


def test_wsd_is_flat_then_decays_linearly():
  s = learning_rate_schedule(OptimConfig(learning_rate=2.0, schedule="wsd", warmup_steps=0, min_lr_ratio=0.0,
                                         wsd_decay_fraction=0.2), 100)
  rel = 16 * U32  # a few float32 roundings of the linear interpolation
  assert float(s(0)) == pytest.approx(2.0, rel=rel) and float(s(79)) == pytest.approx(2.0, rel=rel)
  assert float(s(90)) == pytest.approx(1.0, rel=rel) and float(s(100)) == pytest.approx(0.0, abs=2.0 * rel)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_decay_ends_at_the_last_step_also_when_it_is_one_step_long(schedule):
  """Warmup 2, 3 steps: the single decay update lands on peak * min_lr_ratio at step 3. WSD over 10 steps
  with a tenth decaying is flat through step 9 and decays in one update."""
  o = OptimConfig(learning_rate=1.0, schedule=schedule, warmup_steps=2, min_lr_ratio=0.1, wsd_decay_fraction=0.1)
  s = learning_rate_schedule(o, 3)
  rel = 16 * U32  # a few float32 roundings
  assert float(s(1)) == pytest.approx(0.5, rel=rel) and float(s(2)) == pytest.approx(1.0, rel=rel)
  assert float(s(3)) == pytest.approx(0.1, rel=rel)
  if schedule == "wsd":
    s = learning_rate_schedule(dataclasses.replace(o, warmup_steps=0), 10)
    assert [float(s(k)) for k in (8, 9)] == pytest.approx([1.0, 1.0], rel=rel)
    assert float(s(10)) == pytest.approx(0.1, rel=rel)


def test_one_warmup_step_starts_from_zero():
  s = learning_rate_schedule(OptimConfig(learning_rate=2.0, schedule="constant", warmup_steps=1), 10)
  assert float(s(0)) == 0.0 and float(s(1)) == 2.0 and float(s(9)) == 2.0


def test_unknown_schedule_is_named():
  with pytest.raises(ValueError, match="'linear'"):
    learning_rate_schedule(OptimConfig(schedule="linear"), 10)


def test_decay_mask_excludes_norms_and_embeddings_unless_asked():
  params = {"embed": {"embedding": 0}, "layers": {"qkv": {"kernel": 0, "scale": 0}}, "lm_head": {"kernel": 0}}
  m = decay_mask(params, False)
  assert m == {"embed": {"embedding": False}, "layers": {"qkv": {"kernel": True, "scale": False}},
               "lm_head": {"kernel": True}}
  assert all(np.ravel(list(decay_mask(params, True)["layers"]["qkv"].values())))
  # list nodes (keys without a dict key: an index) are walked through, their leaves judged by name
  assert decay_mask({"blocks": [{"kernel": 0, "scale": 0}]}, False) == {"blocks": [{"kernel": True, "scale": False}]}


def test_decoupled_weight_decay_follows_the_mask():
  opt, _ = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant",
                                      weight_decay=0.5, clip_grad_norm=1.0), 10)
  params = {"k": {"kernel": jnp.ones(4)}, "n": {"scale": jnp.ones(4)}}
  grads = {"k": {"kernel": jnp.zeros(4)}, "n": {"scale": jnp.zeros(4)}}
  updates, _ = opt.update(grads, opt.init(params), params)
  # decoupled decay: -lr * wd * p, two float32 products
  np.testing.assert_allclose(updates["k"]["kernel"], -0.1 * 0.5 * np.ones(4), rtol=4 * U32)
  np.testing.assert_allclose(updates["n"]["scale"], 0.0)  # no decay on norms
  opt, _ = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5,
                                      clip_grad_norm=1.0, decay_norms_and_embeddings=True), 10)
  updates, _ = opt.update(grads, opt.init(params), params)  # asked for: norms decay too
  np.testing.assert_allclose(updates["n"]["scale"], -0.1 * 0.5 * np.ones(4), rtol=4 * U32)


def test_clipping_is_by_global_norm():
  """g = (3, 4) has norm 5; clipped to norm 1 it is (0.6, 0.8). With eps=1 (and b1=b2=0) Adam's first
  update g / (|g| + 1) shows the gradient's scale: element-wise clipping to 1 or none differ."""
  opt, _ = make_optimizer(OptimConfig(learning_rate=1.0, warmup_steps=0, schedule="constant",
                                      weight_decay=0.0, clip_grad_norm=1.0, b1=0.0, b2=0.0, eps=1.0), 10)
  params = {"k": {"kernel": jnp.zeros(2)}}
  updates, _ = opt.update({"k": {"kernel": jnp.array([3.0, 4.0])}}, opt.init(params), params)
  # float32: the norm, the scaling and Adam's few operations, <= 16 ulps
  np.testing.assert_allclose(updates["k"]["kernel"], [-0.6 / 1.6, -0.8 / 1.8], rtol=16 * U32)


def test_clip_grad_norm_zero_disables_clipping():
  """The same (3, 4) gradient with clipping off: Adam's first update is g / (|g| + 1) unscaled."""
  opt, _ = make_optimizer(OptimConfig(learning_rate=1.0, warmup_steps=0, schedule="constant",
                                      weight_decay=0.0, clip_grad_norm=0.0, b1=0.0, b2=0.0, eps=1.0), 10)
  params = {"k": {"kernel": jnp.zeros(2)}}
  updates, _ = opt.update({"k": {"kernel": jnp.array([3.0, 4.0])}}, opt.init(params), params)
  np.testing.assert_allclose(updates["k"]["kernel"], [-3.0 / 4.0, -4.0 / 5.0], rtol=16 * U32)


def test_adam_moments_use_the_configured_b1_b2_eps():
  """Three Adam updates against the textbook recurrences (Kingma & Ba, bias-corrected), in float64.
  b1=0.5, b2=0.8 and eps=0.1 are far from their defaults; the first update alone cannot show b1 (bias
  correction cancels it), the second and third do."""
  b1, b2, eps, lr = 0.5, 0.8, 0.1, 0.01
  opt, _ = make_optimizer(OptimConfig(learning_rate=lr, warmup_steps=0, schedule="constant", weight_decay=0.0,
                                      clip_grad_norm=0.0, b1=b1, b2=b2, eps=eps), 10)
  grads = [np.array([3.0, -1.0]), np.array([-1.0, 2.0]), np.array([0.5, 0.25])]
  p = {"k": {"kernel": jnp.zeros(2)}}
  state = opt.init(p)
  m = v = np.zeros(2)
  want = np.zeros(2)
  for t, g in enumerate(grads, start=1):
    updates, state = opt.update({"k": {"kernel": jnp.asarray(g, jnp.float32)}}, state, p)
    p = {"k": {"kernel": p["k"]["kernel"] + updates["k"]["kernel"]}}
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    want = want - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
  # float32: ~10 roundings per update (moments, bias corrections, root, division, lr), each of relative
  # size U32; three updates of size <= lr add up: 3 * 16 ulps of lr bounds it.
  np.testing.assert_allclose(p["k"]["kernel"], want, rtol=0, atol=3 * 16 * U32 * lr)
