"""Learning-rate schedules and the weight-decay mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.config import OptimConfig
from maxlm.optim import decay_mask, learning_rate_schedule, make_optimizer


def test_warmup_then_cosine():
  s = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5) and float(s(10)) == pytest.approx(1.0)
  assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # half-way through the cosine
  assert float(s(110)) == pytest.approx(0.1, rel=1e-5)


def test_wsd_is_flat_then_decays_linearly():
  s = learning_rate_schedule(OptimConfig(learning_rate=2.0, schedule="wsd", warmup_steps=0, min_lr_ratio=0.0,
                                         wsd_decay_fraction=0.2), 100)
  assert float(s(0)) == pytest.approx(2.0) and float(s(79)) == pytest.approx(2.0)
  assert float(s(90)) == pytest.approx(1.0, rel=1e-5) and float(s(100)) == pytest.approx(0.0, abs=1e-6)


def test_decay_mask_excludes_norms_and_embeddings_unless_asked():
  params = {"embed": {"embedding": 0}, "layers": {"qkv": {"kernel": 0, "scale": 0}}, "lm_head": {"kernel": 0}}
  m = decay_mask(params, False)
  assert m == {"embed": {"embedding": False}, "layers": {"qkv": {"kernel": True, "scale": False}},
               "lm_head": {"kernel": True}}
  assert all(np.ravel(list(decay_mask(params, True)["layers"]["qkv"].values())))


def test_decoupled_weight_decay_follows_the_mask():
  opt, _ = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5,
                                      clip_grad_norm=1.0), 10)
  params = {"k": {"kernel": jnp.ones(4)}, "n": {"scale": jnp.ones(4)}}
  grads = {"k": {"kernel": jnp.zeros(4)}, "n": {"scale": jnp.zeros(4)}}
  updates, _ = opt.update(grads, opt.init(params), params)
  np.testing.assert_allclose(updates["k"]["kernel"], -0.1 * 0.5 * np.ones(4), rtol=1e-6)  # decoupled decay
  np.testing.assert_allclose(updates["n"]["scale"], 0.0)  # no decay on norms
