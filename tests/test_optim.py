"""Learning-rate schedules, the weight-decay mask, clipping and Adam's hyperparameters."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm.config import OptimConfig
from maxlm.optim import LAG, decay_mask, learning_rate_schedule, make_optimizer, warmup_warning

U32 = 2.0 ** -24  # float32 unit roundoff: optax evaluates schedules and updates in float32


def test_warmup_then_cosine():
  s = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
  # a few float32 roundings (step / W, the cosine's argument and value, the blend): <= 16 ulps
  rel = 16 * U32
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5, rel=rel)
  assert float(s(10)) == pytest.approx(1.0, rel=rel)
  assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=rel)  # half-way through the cosine
  assert float(s(110)) == pytest.approx(0.1, rel=rel)


def test_a_run_that_ends_inside_its_warmup_is_warned():
  """llama8b.yml's 2000 warmup steps cut to a 30-step trial: step 30 applies the rate of count 29, 3e-4 * 29 /
  2000 = 4.35e-06, 1.45% of the peak. A warmup that ends within the run (or none) gives no warning."""
  o = OptimConfig(learning_rate=3e-4, warmup_steps=2000)
  w = warmup_warning(o, 30)
  assert w.startswith("optim.warmup_steps=2000 is not below train.steps=30: the learning rate ends at 4.35e-06, ")
  assert w.endswith(" of optim.learning_rate=0.0003 (a shorter warmup: optim.warmup_steps=N)")
  assert warmup_warning(o, 2000) is not None and warmup_warning(o, 2001) is None
  assert warmup_warning(OptimConfig(warmup_steps=0), 1) is None
  assert warmup_warning(OptimConfig(learning_rate=0.0, warmup_steps=10), 5) is None  # nothing to reach


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


def _f32(x) -> np.ndarray:
  return np.asarray(x, np.float32)


def _round_bf16(x: np.ndarray) -> np.ndarray:
  """float32 -> the nearest bfloat16 (ties to even), returned as float32: the top 16 bits of the word after
  adding 0x7FFF plus the lowest kept bit (finite inputs)."""
  u = _f32(x).view(np.uint32).astype(np.uint64)
  u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
  return u.astype(np.uint32).view(np.float32)


def _moments(state):
  """(mu, nu) of the Adam state inside make_optimizer's state (clipping off: chain(adamw)); flat kernels."""
  adam = state[0][0]
  return adam.mu["k"]["kernel"], adam.nu["k"]["kernel"]


STEP = dict(learning_rate=0.01, warmup_steps=0, schedule="constant", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def test_float32_state_is_plain_optax_adamw_bit_for_bit():
  """optim.state_dtype=float32 (the default) is what it was before the option: the state and the updates of
  optax's own clip + adamw chain, exactly, over four steps (masked decay, clipping active)."""
  o = OptimConfig(**STEP, clip_grad_norm=0.5)
  assert o.state_dtype == "float32"
  opt, sched = make_optimizer(o, 10)
  ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
      sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=lambda p: decay_mask(p, False)))
  rng = np.random.default_rng(0)
  params = {"k": {"kernel": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)}, "n": {"scale": jnp.ones(5)}}
  s, r = opt.init(params), ref.init(params)
  for _ in range(4):
    g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    (u, s), (ur, r) = opt.update(g, s, params), ref.update(g, r, params)
    assert jax.tree.structure(s) == jax.tree.structure(r)
    for a, b in zip(jax.tree.leaves((u, s)), jax.tree.leaves((ur, r)), strict=True):
      assert a.dtype == b.dtype and np.array_equal(a, b)
    params = optax.apply_updates(params, u)


def _bf16_run(grads, p0, **kw):
  """make_optimizer with bfloat16 moments, no clipping, on one [n] kernel: the updates and states."""
  opt, _ = make_optimizer(OptimConfig(**{**STEP, **kw}, clip_grad_norm=0.0, state_dtype="bfloat16"), 10)
  p = {"k": {"kernel": jnp.asarray(p0, jnp.float32)}}
  state, out = opt.init(p), []
  for g in grads:
    u, state = opt.update({"k": {"kernel": jnp.asarray(g, jnp.float32)}}, state, p)
    out.append((u["k"]["kernel"], state))
  return out


def _adamw_bf16_moments(grads, p, lr, b1, b2, eps, wd):
  """AdamW in float32 numpy whose moments are stored rounded to bfloat16 between steps: per step the
  updates (the float32 moments just computed, bias-corrected) and the stored moments."""
  m = v = np.zeros_like(_f32(p))
  out = []
  for t, g in enumerate(grads, start=1):
    g = _f32(g)
    m32 = np.float32(1 - b1) * g + np.float32(b1) * m
    v32 = np.float32(1 - b2) * (g * g) + np.float32(b2) * v
    mhat, vhat = m32 / np.float32(1 - b1 ** t), v32 / np.float32(1 - b2 ** t)
    u = -np.float32(lr) * (mhat / (np.sqrt(vhat) + np.float32(eps)) + np.float32(wd) * _f32(p))
    m, v = _round_bf16(m32), _round_bf16(v32)
    out.append((u, m, v))
  return out


def test_bfloat16_state_stores_bf16_moments_and_updates_in_float32():
  """optim.state_dtype=bfloat16 against float32 numpy AdamW on bf16-stored moments, three steps: the stored
  moments are bfloat16 and equal the reference's round-to-nearest-even of its float32 moments; the updates
  are float32 and agree to float32 rounding. Gradients of mixed sizes make moments that bf16 cannot hold."""
  rng = np.random.default_rng(1)
  p0 = rng.normal(size=64).astype(np.float32)
  grads = [rng.normal(size=64).astype(np.float32) * 10.0 ** rng.uniform(-3, 1, 64) for _ in range(3)]
  got = _bf16_run(grads, p0)
  want = _adamw_bf16_moments(grads, p0, **{k: STEP[k] for k in ("b1", "b2", "eps")}, lr=0.01, wd=0.1)
  for (u, state), (wu, wm, wv) in zip(got, want, strict=True):
    mu, nu = _moments(state)
    assert mu.dtype == nu.dtype == jnp.bfloat16 and u.dtype == jnp.float32
    # The float32 moments are the same few roundings here and there (multiply, multiply, add), rounded once to
    # bf16: equal, except where XLA contracts to an FMA and the float32 value sits within an ulp of a bf16 tie.
    assert np.array_equal(_f32(mu), wm) and np.array_equal(_f32(nu), wv)
    # ~12 float32 roundings (moments, bias corrections, root, +eps, division, decay, lr): 16 ulps of lr * (|m/v| + wd|p|)
    np.testing.assert_allclose(u, wu, rtol=16 * U32, atol=16 * U32 * 0.01 * 0.1 * np.abs(p0).max())


def test_bfloat16_state_update_is_not_bf16_math():
  """The update is computed from the float32 moments before they are rounded: with a gradient of 1 + 2**-12,
  the new first moment 0.1 * (1 + 2**-12) (step 1) has no bf16 value, and a step that used the rounded
  moments (or bf16 arithmetic) moves by ~5e-4 relative, hundreds of times the float32 tolerance. Step 2
  reads the rounded moments back and again forms its update from float32 values."""
  g = np.float32(1 + 2 ** -12) * np.ones(4, np.float32)
  grads = [g, g * np.float32(0.75)]
  kw = dict(b1=0.9, b2=0.95, eps=1e-3, weight_decay=0.0)  # eps near |g|: the update depends on mu and nu apart
  got = _bf16_run(grads, np.zeros(4, np.float32), **kw)
  want = _adamw_bf16_moments(grads, np.zeros(4), lr=0.01, b1=0.9, b2=0.95, eps=1e-3, wd=0.0)
  # the same computation with the moments rounded to bf16 before they are used (bf16 storage, bf16 update)
  rounded = []
  m = v = np.zeros(4, np.float32)
  for t, gi in enumerate(grads, start=1):
    m = _round_bf16(np.float32(0.1) * gi + np.float32(0.9) * m)
    v = _round_bf16(np.float32(0.05) * gi * gi + np.float32(0.95) * v)
    rounded.append(-0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.95 ** t)) + 1e-3))
  for (u, _), (wu, _, _), ru in zip(got, want, rounded, strict=True):
    tol = 16 * U32 * np.abs(wu)  # float32 rounding, as above
    assert np.all(np.abs(_f32(u) - wu) <= tol)
    assert np.all(np.abs(ru - wu) > 100 * tol), (ru, wu)  # what bf16 math would give is far outside it


def _host(tree):
  """`tree` placed in pinned host memory of the first device (JAX has the memory kind on CPU too)."""
  s = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  return jax.device_put(tree, s)


def test_streamed_update_orders_the_transfers():
  """The program of the host-memory update: parameter i's moments enter device memory only through an
  optimization barrier that holds an element of every gradient (i < LAG) or parameter i - LAG's new moments
  already sent to host memory, so at most LAG parameters' moments are on the device at once and none before the backward
  pass is done. Read off the jaxpr: each move to the device takes a barrier's output, and that barrier's
  operands are the ones named."""
  opt, _ = make_optimizer(OptimConfig(**STEP, clip_grad_norm=0.0), 10)
  params = {f"p{i}": {"kernel": jnp.ones((2, 3))} for i in range(5)}
  grads = jax.tree.map(lambda p: p * 0.5, params)
  jaxpr = jax.make_jaxpr(opt.update)(grads, _host(opt.init(params)), params).jaxpr
  eqns = jaxpr.eqns
  space = lambda e: e.params["devices"][0]
  to_host = [e for e in eqns if e.primitive.name == "device_put" and space(e) == jax.memory.Space.Host]
  to_dev = [e for e in eqns if e.primitive.name == "device_put" and space(e) == jax.memory.Space.Device]
  barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
  assert len(barriers) == 5 and LAG == 2
  sent = [set(e.outvars) for e in to_host]  # in order: mu_0 nu_0 (moments of p0), mu_1 nu_1, ..., counts
  made_by = {v: e for e in eqns for v in e.outvars}
  grad_vars = set(jaxpr.invars[:5])

  def sources(v, depth=3):  # the program's inputs that v is computed from, a few equations back
    e = made_by.get(v)
    if e is None or depth == 0:
      return {v}
    return set().union(*(sources(u, depth - 1) for u in e.invars if not hasattr(u, "val")))
  for i, b in enumerate(barriers):
    ins = set(b.invars)
    if i < LAG:  # an element of every gradient (not the gradients themselves: they would all be held)
      assert grad_vars <= set().union(*(sources(v) for v in ins)) and not grad_vars & ins, i
    else:
      assert sent[2 * (i - LAG)] | sent[2 * (i - LAG) + 1] <= ins, i
    # the moments of parameter i move to the device from this barrier's outputs, not from the inputs
    moved = [e for e in to_dev if any(made_by.get(v) is b for v in e.invars)]
    assert moved, i
  assert all(any(made_by.get(v) in barriers for v in e.invars) for e in to_dev if e.invars[0].aval.ndim)
