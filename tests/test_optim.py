"""Learning-rate schedules and the weight-decay mask."""

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


def test_decay_mask_excludes_norms_and_embeddings_unless_asked():
  params = {"embed": {"embedding": 0}, "layers": {"qkv": {"kernel": 0, "scale": 0}}, "lm_head": {"kernel": 0}}
  m = decay_mask(params, False)
  assert m == {"embed": {"embedding": False}, "layers": {"qkv": {"kernel": True, "scale": False}},
               "lm_head": {"kernel": True}}
  assert all(np.ravel(list(decay_mask(params, True)["layers"]["qkv"].values())))


def test_decoupled_weight_decay_follows_the_mask():
  opt, _ = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant",
                                      weight_decay=0.5, clip_grad_norm=1.0), 10)
  params = {"k": {"kernel": jnp.ones(4)}, "n": {"scale": jnp.ones(4)}}
  grads = {"k": {"kernel": jnp.zeros(4)}, "n": {"scale": jnp.zeros(4)}}
  updates, _ = opt.update(grads, opt.init(params), params)
  # decoupled decay: -lr * wd * p, two float32 products
  np.testing.assert_allclose(updates["k"]["kernel"], -0.1 * 0.5 * np.ones(4), rtol=4 * U32)
  np.testing.assert_allclose(updates["n"]["scale"], 0.0)  # no decay on norms


def test_clipping_is_by_global_norm():
  """g = (3, 4) has norm 5; clipped to norm 1 it is (0.6, 0.8). With eps=1 (and b1=b2=0) Adam's first
  update g / (|g| + 1) shows the gradient's scale: element-wise clipping to 1 or none differ."""
  opt, _ = make_optimizer(OptimConfig(learning_rate=1.0, warmup_steps=0, schedule="constant",
                                      weight_decay=0.0, clip_grad_norm=1.0, b1=0.0, b2=0.0, eps=1.0), 10)
  params = {"k": {"kernel": jnp.zeros(2)}}
  updates, _ = opt.update({"k": {"kernel": jnp.array([3.0, 4.0])}}, opt.init(params), params)
  # float32: the norm, the scaling and Adam's few operations, <= 16 ulps
  np.testing.assert_allclose(updates["k"]["kernel"], [-0.6 / 1.6, -0.8 / 1.8], rtol=16 * U32)
