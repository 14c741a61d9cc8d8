"""Train / eval steps against independent references (tests/reference.py, numpy AdamW written here):
the loss over every valid token, multi-step AdamW with its schedules, clipping and decay mask,
token-weighted gradient accumulation; non-finite skipping; FP8 delayed-scaling state."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import reference as R
from maxlm.config import MeshConfig, ModelConfig, OptimConfig
from maxlm.layers import FP8_COLLECTION, PrecisionError, check_precision, precision_scope
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer, cast_matmul_weights
from maxlm.optim import make_optimizer
from maxlm.step import (accumulated, averaged, chunked_token_losses, forward_params,
                        fp8_chunked_head, guarded_update, loss_and_grad, make_eval_step, make_train_step, pow2_scale,
                        quantize, token_losses, use_chunked_loss)
from maxlm.train_state import abstract_state, create_train_state

MODEL = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                    dtype="float32", remat="none", backend="flax")
U32 = 2.0 ** -24  # float32 unit roundoff
# Gradient error of the float32 model, per element, relative to its leaf's largest |gradient|. Each
# gradient is a sum over <= 32 tokens of products through a chain of ~11 contractions (LM head V=128,
# per block wo F=64, wi D=32, out H*Dh=32, attention T=8, qkv D=32); rounding errors of random sign
# grow like sqrt(n) * U32 per contraction (<= 11 ulps) and add in quadrature along the chain
# (sqrt(11) * 11 ~ 37 ulps). 64 ulps bounds that; measured here: <= 6 ulps.
GRAD_RTOL = 64 * U32
MESH = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])


def grad_norm_rtol(params):
  """||g|| in float32 vs exact: the elementwise gradient bound (in l2 at most GRAD_RTOL relative) and
  sqrt(n) ulps for summing n squares (random-sign rounding, halved by the square root)."""
  return GRAD_RTOL + math.sqrt(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))) * U32


def batch(b=4, t=8, seed=0, vocab=128):
  toks = np.random.default_rng(seed).integers(0, vocab, (b, t + 1), dtype=np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((b, t), np.int32),
          "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))}


def padded_batch(seed, b=4, t=8, packed=False):
  """Rows of the first half keep 1..t/2 valid tokens (random per row and step), the others all t:
  with grad_accum=2 the two micro-batches carry unequal token counts. packed: the last row holds
  two documents (positions restart at the boundary)."""
  bt = batch(b, t, seed)
  rng = np.random.default_rng(seed + 1000)
  for r in range(b // 2):
    bt["segment_ids"][r, int(rng.integers(1, t // 2 + 1)):] = 0
  if packed:
    cut = int(rng.integers(2, t - 1))
    bt["segment_ids"][-1, cut:] = 2
    bt["positions"][-1, cut:] = np.arange(t - cut)
  return bt


def setup(cfg=MODEL, precision="bf16", optim=OptimConfig(warmup_steps=0), grad_accum=1, b=4, t=8,
          total_steps=10, packed=False, optimizer=None):
  """(state, run, model): `run(state, batch)` is the jitted train step; `optimizer` overrides AdamW."""
  model = Transformer(cfg)
  opt, sched = make_optimizer(optim, total_steps)
  opt = optimizer or opt
  with jax.set_mesh(MESH), precision_scope(precision, cfg.backend, cfg.fp8_amax_history_len):
    state, _ = create_train_state(model, opt, MESH, 0, b // grad_accum, t)
  return state, stepper(model, cfg, precision, opt, sched, grad_accum, packed), model


def stepper(model, cfg, precision, opt, sched, grad_accum=1, packed=False):
  step = jax.jit(make_train_step(model, opt, sched, grad_accum=grad_accum, packed=packed))

  def run(state, bt):
    with jax.set_mesh(MESH), precision_scope(precision, cfg.backend, cfg.fp8_amax_history_len):
      return step(state, bt)
  return run


def named_leaves(tree):
  return [(tuple(getattr(k, "key", str(k)) for k in path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ---- the loss --------------------------------------------------------------------------------------

def test_token_losses_reference():
  logits = jnp.array([[[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]]])
  loss, n = token_losses(logits, jnp.array([[2, 0]]), jnp.array([[1, 0]]))
  assert float(n) == 1.0
  # float32 logsumexp of 3 terms and a subtraction: a few roundings
  np.testing.assert_allclose(float(loss), -np.log(np.exp(3) / np.exp([1, 2, 3]).sum()), rtol=8 * U32)


def test_token_losses_are_fp32_from_bf16_logits():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 4.0, (4, 8, 128)), jnp.bfloat16)  # [B, T, V]
  targets = rng.integers(0, 128, (4, 8))
  mask = rng.random((4, 8)) < 0.7
  loss, n = token_losses(logits, jnp.asarray(targets), jnp.asarray(mask))
  assert loss.dtype == jnp.float32 and float(n) == mask.sum()
  x = np.asarray(logits, np.float64)  # the very bf16 values, widened exactly
  nll = np.log(np.exp(x).sum(-1)) - np.take_along_axis(x, targets[..., None], -1)[..., 0]
  # fp32 bound: logsumexp over V=128 (<= 128 ulps of each lse) and a sum over <= 32 tokens; bf16
  # arithmetic anywhere would be off by ~2^-9 relative, 30x more.
  np.testing.assert_allclose(float(loss), nll[mask].sum(), rtol=(128 + 32) * U32)


def test_loss_counts_every_valid_token_including_the_last():
  state, run, model = setup(packed=True)
  bt = batch(seed=3)
  bt["segment_ids"][1, :-1] = 0  # row 1: only its last position is valid (a one-token document)
  bt["positions"][1, -1] = 0
  bt["segment_ids"][2, 5:] = 2  # row 2: two documents; every other row is valid to its end
  bt["positions"][2, 5:] = np.arange(3)
  ref_sum, ref_n = R.loss_sum_and_count(R.as_float64(state.params), MODEL, bt, packed=True)
  assert int(ref_n) == 3 * 8 + 1
  ev = jax.jit(make_eval_step(model, packed=True))(state, bt)
  _, m = run(state, bt)
  assert float(ev["tokens"]) == float(m["tokens"]) == int(ref_n)
  # fp32: logits carry a few ulps of their scale (~0.1 here); the NLL adds logsumexp over V=128 and
  # the sum over 25 tokens: (128 + 25) ulps of the total bounds it.
  rtol = (128 + 25) * U32
  np.testing.assert_allclose(float(ev["loss_sum"]), float(ref_sum), rtol=rtol)
  np.testing.assert_allclose(float(m["loss"]), float(ref_sum) / int(ref_n), rtol=rtol)


# ---- AdamW over several steps against a numpy reference --------------------------------------------

def ref_learning_rate(k, o: OptimConfig, total):
  """Learning rate of update k (0-based): linear warmup from 0 over W updates, then over D = total - W:
  cosine from peak to peak * r, or WSD (flat, then linear to peak * r over round(D * f) updates)."""
  peak, w, r = o.learning_rate, o.warmup_steps, o.min_lr_ratio
  if k < w:
    return peak * k / w
  d, s = total - w, k - w
  if o.schedule == "cosine":
    return peak * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * min(s, d) / d)))
  n_decay = max(1, round(d * o.wsd_decay_fraction))
  stable = d - n_decay
  return peak if s < stable else peak + (peak * r - peak) * min(s - stable, n_decay) / n_decay


def adam_update_bound(b1, b2, t):
  """max |m_hat| / sqrt(v_hat) after t updates for any gradients (Cauchy-Schwarz): sqrt(sum a_i^2 / c_i)."""
  i = np.arange(1, t + 1)
  a = (1 - b1) * b1 ** (t - i) / (1 - b1 ** t)
  c = (1 - b2) * b2 ** (t - i) / (1 - b2 ** t)
  return float(np.sqrt((a * a / c).sum()))


ADAMW_CASES = {
    # warmup + cosine; two micro-batches with unequal token counts; one row packs two documents
    "cosine": (OptimConfig(learning_rate=1e-2, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1,
                           weight_decay=0.1, clip_grad_norm=3.8), 7, 2, True),
    # warmup + WSD (flat, then decay over the last half); padded rows, no accumulation
    "wsd": (OptimConfig(learning_rate=1e-2, schedule="wsd", warmup_steps=1, wsd_decay_fraction=0.5,
                        min_lr_ratio=0.1, weight_decay=0.1, clip_grad_norm=3.8), 7, 1, False),
}


class ReferenceAdamW:
  """Optax-free AdamW in float64 numpy (Loshchilov & Hutter): global-norm clipping, Adam moments with
  bias correction, decoupled weight decay on matmul kernels only (not norms, not the embedding), the
  schedule above. `update` also bounds, per element, how far a float32 implementation that computes
  its own float32 gradient may land from the exact update."""

  def __init__(self, o: OptimConfig, total: int, names):
    self.o, self.total = o, total
    self.decay = [n[-1].endswith("kernel") for n in names]
    self.m, self.v = [0.0] * len(names), [0.0] * len(names)
    self.err = [0.0] * len(names)  # bound on |float32 - exact| of each clipped gradient so far

  def update(self, k, params, grads):
    """(new params, per-element tolerances, fraction of elements allowed > 1% of a step, clipped?)."""
    o, t = self.o, k + 1
    norm = math.sqrt(sum((g * g).sum() for g in grads))
    f = min(1.0, o.clip_grad_norm / norm)
    lr, u_max = ref_learning_rate(k, o, self.total), adam_update_bound(o.b1, o.b2, t)
    new, tols, loose = [], [], 0
    for j, (p, g) in enumerate(zip(params, grads)):
      g = f * g
      self.m[j] = o.b1 * self.m[j] + (1 - o.b1) * g
      self.v[j] = o.b2 * self.v[j] + (1 - o.b2) * g * g
      s = np.sqrt(self.v[j] / (1 - o.b2 ** t))
      u = self.m[j] / (1 - o.b1 ** t) / (s + o.eps)
      new.append(p - lr * (u + (o.weight_decay * p if self.decay[j] else 0.0)))
      # The float32 clipped gradient is within 2 * GRAD_RTOL * f * max|g| of this one (the gradient
      # and, through the norm, the clip factor), and exactly 0 where this one is (embedding rows of
      # absent tokens); err keeps the largest bound of the steps in the moments. sqrt(v_hat) being
      # 1-Lipschitz in such errors, m_hat / (s + eps) moves by at most 2 err (1 + |u|) / (s + eps)
      # while err <= (s + eps) / 2, and never by more than 2 u_max (any two Adam updates differ by
      # at most that). Then float32 arithmetic of the update (16 ulps) and of the new parameter.
      self.err[j] = np.maximum(self.err[j], np.where(g == 0, 0.0, 2 * GRAD_RTOL * np.abs(g).max()))
      e = self.err[j]
      du = np.where(e <= (s + o.eps) / 2, np.minimum(2 * e * (1 + np.abs(u)) / (s + o.eps), 2 * u_max),
                    2 * u_max)
      tols.append(lr * (du + 16 * U32 * (np.abs(u) + o.weight_decay * np.abs(p))) + 2 * U32 * np.abs(p))
      loose += int((du > 1e-2).sum())
    return new, tols, loose / sum(np.size(p) for p in params), f < 1.0, norm, lr


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_steps_match_numpy_reference(case):
  """Each step of the real train step against ReferenceAdamW applied to the same parameters, fed the
  gradient of the token-weighted mean loss over the whole global batch (jax.grad of
  tests/reference.py in float64)."""
  o, total, accum, packed = ADAMW_CASES[case]
  state, run, _ = setup(optim=o, grad_accum=accum, total_steps=total, packed=packed)
  state = state.replace(params=R.random_params(state.params, seed=1, embed_std=0.5))
  with jax.enable_x64(True):
    ref_grad = jax.jit(jax.value_and_grad(lambda p, b: R.mean_loss(p, MODEL, b, packed, jnp)))
  names = [n for n, _ in named_leaves(state.params)]
  adamw, norm_rtol = ReferenceAdamW(o, total, names), grad_norm_rtol(state.params)
  clipped, counts, loose = [], [], []
  for k in range(total):
    bt = padded_batch(seed=10 + k, packed=packed)
    counts.append(tuple(int((mb > 0).sum()) for mb in np.split(bt["segment_ids"], accum)))  # [B/A, T] each
    with jax.enable_x64(True):
      loss, grads = ref_grad(R.as_float64(state.params), bt)
    params = [np.asarray(p, np.float64) for _, p in named_leaves(state.params)]
    grads = [np.asarray(g) for _, g in named_leaves(grads)]
    expect, tols, frac, clip, norm, lr = adamw.update(k, params, grads)
    clipped.append(clip)
    loose.append(frac)
    state, metrics = run(state, bt)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=(128 + 32) * U32,
                               err_msg=f"step {k}")
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=norm_rtol, err_msg=f"step {k}")
    np.testing.assert_allclose(float(metrics["learning_rate"]), lr, rtol=16 * U32, atol=1e-12,
                               err_msg=f"step {k}")
    for name, (_, got), want, tol in zip(names, named_leaves(state.params), expect, tols):
      off = np.abs(np.asarray(got, np.float64) - want) - tol
      assert (off <= 0).all(), f"step {k} {'/'.join(name)}: {(off > 0).sum()} off, by up to {off.max():.3g}"
  # The premises: clipping triggered on some steps only; micro-batches carried unequal token counts;
  # the tolerance holds 95% of the elements to within 1% of a step (most to ~1e-4; seen: 99%): only
  # near-zero gradients, where float32 noise may flip Adam's sign, get more room.
  assert any(clipped) and not all(clipped), clipped
  if accum > 1:
    assert all(len(set(c)) > 1 for c in counts), counts
  assert np.mean(loose) < 0.05, loose


def test_gradient_accumulation_equals_full_batch():
  """Accumulating 4 micro-batches with unequal token counts gives the full batch's token-weighted
  gradient. Plain SGD (lr=1) makes the update the gradient itself, so no optimizer noise hides it."""
  bt = padded_batch(seed=5, b=8)
  bt["segment_ids"][4:6, 3:] = 0
  s1, run1, _ = setup(b=8, optimizer=optax.sgd(1.0))
  s4, run4, _ = setup(b=8, grad_accum=4, optimizer=optax.sgd(1.0))
  n1, m1 = run1(s1, bt)
  n4, m4 = run4(s4, bt)
  assert float(m4["tokens"]) == float(m1["tokens"]) == bt["segment_ids"].astype(bool).sum()
  # Both are float32 sums of the same per-token terms in a different order, each within GRAD_RTOL of
  # its leaf's largest gradient (and (V + N) ulps for the loss) of the exact value: twice that apart,
  # plus the rounding of the new parameter (<= U32 |p| each).
  np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=2 * (128 + 64) * U32)
  np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]),
                             rtol=2 * grad_norm_rtol(s1.params))
  for (name, p0), (_, a), (_, b) in zip(named_leaves(s1.params), named_leaves(n4.params),
                                        named_leaves(n1.params)):
    step = np.abs(np.asarray(b) - np.asarray(p0)).max()  # = max |gradient| of this leaf
    np.testing.assert_allclose(a, b, rtol=0, atol=2 * GRAD_RTOL * step + 2 * U32 * np.abs(b).max(),
                               err_msg="/".join(name))


# ---- non-finite updates ----------------------------------------------------------------------------

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


def test_the_guard_as_a_select_gives_the_conds_states_and_traces_no_cond():
  """make_train_step(guard="select") (the planner's what-if for jax 0.10's XLA:GPU, maxlm/plan/standins.py): the
  same new state as the run's cond (after a finite step within 4 ulp, after a non-finite one exactly); no cond
  traced."""
  state, _, model = setup()
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0), 10)
  steps = {g: make_train_step(model, opt, sched, guard=g) for g in ("cond", "select")}
  emb = state.params["embed"]["embedding"].at[3].set(jnp.nan)
  poisoned = state.replace(params={**state.params, "embed": {"embedding": emb}})
  bt = batch()
  bt["inputs"][0, 0] = 3  # reads the poisoned row
  for start, finite in ((state, True), (poisoned, False)):
    with jax.set_mesh(MESH), precision_scope("bf16", MODEL.backend, MODEL.fp8_amax_history_len):
      got = {g: jax.jit(f)(start, bt) for g, f in steps.items()}
      jaxprs = {g: str(jax.make_jaxpr(f)(start, bt)) for g, f in steps.items()}
    assert bool(got["cond"][1]["finite"]) is finite
    if finite:
      # the same update, but fused differently by XLA in the two programs: the few f32 operations of AdamW's
      # update (products, a square root, a division, a sum) each round by at most half an ulp, in either order,
      # so 4 ulp of each value (2**-21 relative), and 4 ulp of the leaf's largest value near zero
      jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(
          np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2.0**-21,
          atol=2.0**-21 * float(np.max(np.abs(np.asarray(b, np.float64))))), got["select"][0], got["cond"][0])
    else:  # the old state, exactly: select picks the skip branch's values
      jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                             got["select"][0], got["cond"][0])
    assert " cond[" in jaxprs["cond"] and " cond[" not in jaxprs["select"]


# ---- the step's parts, each alone ----------------------------------------------------------------------

def _parts_setup():
  state, _, model = setup(b=8)
  with jax.set_mesh(MESH), precision_scope("bf16", MODEL.backend, MODEL.fp8_amax_history_len):
    yield state, model


def test_loss_and_grad_scales_the_loss_and_keeps_the_master_dtypes():
  """A loss scale of 8 (a power of 2, as fp16's dynamic scale always is) multiplies every gradient by exactly 8
  and leaves the reported loss and token count alone; each gradient comes back in its master parameter's dtype."""
  for state, model in _parts_setup():
    fn = jax.jit(loss_and_grad(model, packed=False))
    bt = padded_batch(seed=3, b=8)
    (g1, _), (loss1, n1) = fn(state.params, state.model_state, bt, None, state.params)
    (g8, _), (loss8, n8) = fn(state.params, state.model_state, bt, jnp.float32(8.0), state.params)
    assert float(loss1) == float(loss8) and float(n1) == float(n8) == bt["segment_ids"].astype(bool).sum()
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a) * 8, np.asarray(b)), g1, g8)
    assert all(a.dtype == p.dtype for a, p in zip(jax.tree.leaves(g1), jax.tree.leaves(state.params)))


def test_accumulated_sums_what_a_loop_over_the_micro_batches_gives():
  """accumulated(fn, 4) against the same fn called on each quarter of the batch in a Python loop, summed here:
  the same float32 additions in the same order, so equal to the last bit; and the model's state threaded."""
  for state, model in _parts_setup():
    fn = loss_and_grad(model, packed=False)
    bt = padded_batch(seed=4, b=8)
    (got, _), (loss, n) = jax.jit(accumulated(fn, 4, host_params=False))(
        state.params, state.model_state, bt, None, state.params)
    want, loss_want, n_want = None, 0.0, 0.0
    for i in range(4):
      mb = {k: v[2 * i:2 * i + 2] for k, v in bt.items()}
      (g, _), (li, ni) = jax.jit(fn)(state.params, state.model_state, mb, None, state.params)
      want = g if want is None else jax.tree_util.tree_map(jnp.add, want, g)
      loss_want, n_want = loss_want + li, n_want + ni
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    assert float(loss) == float(loss_want) and float(n) == float(n_want)
    assert accumulated(fn, 1, host_params=False) is fn  # one micro-batch: the function itself


def test_averaged_by_hand():
  grads, loss, count = averaged({"w": jnp.array([3.0, -6.0], jnp.float32)}, jnp.float32(9.0), jnp.float32(3.0), None)
  assert grads["w"].tolist() == [1.0, -2.0] and float(loss) == 3.0 and float(count) == 3.0
  grads, loss, _ = averaged({"w": jnp.array([24.0], jnp.bfloat16)}, jnp.float32(9.0), jnp.float32(3.0),
                            jnp.float32(4.0))  # the scale undone from the gradients only: the loss is unscaled
  assert grads["w"].dtype == jnp.bfloat16 and grads["w"].tolist() == [2.0] and float(loss) == 3.0
  _, _, count = averaged({"w": jnp.zeros(1)}, jnp.float32(0.0), jnp.float32(0.0), None)
  assert float(count) == 1.0  # no valid token: divided by 1, not 0


@pytest.mark.parametrize("guard", ["cond", "select"])
def test_guarded_update_applies_a_finite_step_and_keeps_the_state_otherwise(guard):
  """guarded_update against optax's own update written here (SGD, lr 0.5: p - 0.5 g) and against the state as it
  was; the model's state taken from the step only where finite."""
  opt = optax.sgd(0.5)
  params = {"w": jnp.array([1.0, 2.0])}
  opt_state = opt.init(params)
  grads = {"w": jnp.array([0.5, -1.0])}
  update = jax.jit(guarded_update(opt, guard))
  new_p, _, ms = update(jnp.bool_(True), grads, params, opt_state, {"m": jnp.ones(1)}, {"m": jnp.zeros(1)})
  assert new_p["w"].tolist() == [0.75, 2.5] and ms["m"].tolist() == [1.0]
  old_p, _, ms = update(jnp.bool_(False), grads, params, opt_state, {"m": jnp.ones(1)}, {"m": jnp.zeros(1)})
  assert old_p["w"].tolist() == [1.0, 2.0] and ms["m"].tolist() == [0.0]
  with pytest.raises(ValueError, match="guard"):
    guarded_update(opt, "maybe")


# ---- FP8 -------------------------------------------------------------------------------------------

def test_fp8_refused_without_support():
  with pytest.raises(PrecisionError, match="needs model.backend=te"):
    check_precision("fp8_delayed", "flax")


@pytest.mark.te
def test_fp8_refused_on_cpu_without_fake_gpu():
  with pytest.raises(PrecisionError, match="not supported on this device"):
    check_precision("fp8_current", "te")


def moment_trees(opt_state, params):
  """The subtrees of an optimizer state shaped like the params (Adam's moments), wherever the chain
  keeps them."""
  target = jax.tree_util.tree_structure(params)
  like = lambda x: jax.tree_util.tree_structure(x) == target
  return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=like) if like(x)]


def qkv_input_amax(params, inputs):
  """max |RMSNorm(embedding[inputs]) * scale| of layer 0's fused QKV (what TE records as its x amax),
  in float64."""
  x = np.asarray(params["embed"]["embedding"], np.float64)[inputs]  # [B, T, D]
  scale = np.asarray(params["layers"]["qkv"]["scale"], np.float64)[0]  # [D]
  return np.abs(R.rms_norm(x, scale, MODEL.norm_eps)).max()


@pytest.mark.te
def test_fp8_current_scaling_keeps_no_state(fake_fp8_gpu):
  check_precision("fp8_current", "te")
  cfg = dataclasses.replace(MODEL, backend="te", precision="fp8_current", n_layers=1)
  state, run, _ = setup(cfg, "fp8_current")
  assert FP8_COLLECTION not in state.model_state
  s1, m = run(state, batch())
  assert np.isfinite(float(m["loss"])) and FP8_COLLECTION not in s1.model_state


@pytest.mark.te
def test_fp8_delayed_state_threads_through_steps(fake_fp8_gpu):
  check_precision("fp8_delayed", "te")
  cfg = dataclasses.replace(MODEL, backend="te", precision="fp8_delayed", fp8_amax_history_len=4, n_layers=1)
  state, run, model = setup(cfg, "fp8_delayed")
  hist = lambda s: np.asarray(s.model_state[FP8_COLLECTION]["layers"]["qkv"]["x_amax_history"])  # [L, 4]
  assert not hist(state).any()
  # The optimizer state holds Adam's two moment trees (mirroring the params) and scalar counters:
  # nothing of the FP8 state.
  moments = moment_trees(state.opt_state, state.params)
  n_params = len(jax.tree_util.tree_leaves(state.params))
  opt_leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  assert len(moments) == 2
  assert len(opt_leaves) == 2 * n_params + sum(np.ndim(x) == 0 for _, x in opt_leaves)
  assert not [p for p, _ in opt_leaves if "amax" in jax.tree_util.keystr(p) or FP8_COLLECTION in
              jax.tree_util.keystr(p)]
  b1, b2 = batch(seed=1), batch(seed=2)
  s1, m1 = run(state, b1)
  s2, m2 = run(s1, b2)
  h1, h2 = hist(s1), hist(s2)
  assert (h1 != 0).sum() == 1 and (h2 != 0).sum() == 2  # one new amax per step
  np.testing.assert_array_equal(h2[..., :-1], h1[..., 1:])  # the history shifts; old amaxes are kept
  # The new amax is max|x| of the QKV GEMM's input, the RMSNorm output (TE quantizes after its norm),
  # computed from the parameters the step started from. float32 RMSNorm over D=32: <= 64 ulps.
  np.testing.assert_allclose(h1[0, -1], qkv_input_amax(state.params, b1["inputs"]), rtol=64 * U32)
  np.testing.assert_allclose(h2[0, -1], qkv_input_amax(s1.params, b2["inputs"]), rtol=64 * U32)
  # Delayed scaling: scale = E4M3 max (448) / max(amax history), margin 0.
  scale = np.asarray(s2.model_state[FP8_COLLECTION]["layers"]["qkv"]["x_scale"])
  np.testing.assert_allclose(scale[0, 0], 448.0 / h2.max(), rtol=4 * U32)
  assert int(s2.step) == 2 and np.isfinite(float(m2["loss"]))

  # Updating the FP8 state is not an optimizer update: from the same state, an optimizer with huge
  # weight decay and tight clipping moves the params elsewhere but leaves the FP8 state as it was.
  other = OptimConfig(warmup_steps=0, weight_decay=10.0, clip_grad_norm=1e-3, learning_rate=0.5)
  opt_b, sched_b = make_optimizer(other, 10)
  run_b = stepper(model, cfg, "fp8_delayed", opt_b, sched_b)
  sb1, _ = run_b(state.replace(opt_state=opt_b.init(state.params)), b1)
  assert not np.allclose(sb1.params["lm_head"]["kernel"], s1.params["lm_head"]["kernel"])
  # Same forward/backward in two programs: XLA may fuse them differently (float32 RMSNorm / GEMM
  # rounding, <= 64 ulps); decay or clipping of this state would change it by O(1).
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=64 * U32, atol=0),
                         sb1.model_state, s1.model_state)


# ---- chunked LM head + cross-entropy ---------------------------------------------------------------

BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]


def sgd_gradient(old, new):
  """The gradient a plain-SGD (lr=1) step applied: old - new, per leaf (float64)."""
  return [np.asarray(a, np.float64) - np.asarray(b, np.float64)
          for (_, a), (_, b) in zip(named_leaves(old), named_leaves(new))]


# Both backends, each with tied and untied heads and packed and unpacked rows (pairwise, to keep the
# compiles few).
CHUNK_CASES = [pytest.param("flax", False, True, id="flax-untied-packed"),
               pytest.param("flax", True, False, id="flax-tied-alone"),
               pytest.param("te", False, False, id="te-untied-alone", marks=pytest.mark.te),
               pytest.param("te", True, True, id="te-tied-packed", marks=pytest.mark.te)]


@pytest.mark.parametrize("backend,tied,packed", CHUNK_CASES)
def test_chunked_loss_matches_reference_and_unchunked(backend, tied, packed):
  """model.loss_chunk=3 over T=8 (chunks of 3, 3 and 2 padded): the loss, the eval loss (no gradient:
  the plain chunked forward) and the gradient (read off a plain-SGD step) against the float64
  reference, and against the unchunked step."""
  cfg = dataclasses.replace(MODEL, backend=backend, tie_embeddings=tied, loss_chunk=3)
  bt = padded_batch(seed=7, packed=packed)
  out = {}
  # The unchunked step (tested against the reference above and in test_model.py) runs here too on the
  # flax backend, for the direct comparison; on TE the reference alone keeps the compiles few.
  for chunk in (3, 0) if backend == "flax" else (3,):
    c = dataclasses.replace(cfg, loss_chunk=chunk)
    state, run, model = setup(c, packed=packed, optimizer=optax.sgd(1.0))
    state = state.replace(params=R.random_params(state.params, seed=2, embed_std=0.5))
    new, m = run(state, bt)
    loss_sum = float(m["loss"]) * float(m["tokens"])
    if chunk:
      with jax.set_mesh(MESH), precision_scope("bf16", backend):
        loss_sum = float(jax.jit(make_eval_step(model, packed=packed))(state, bt)["loss_sum"])
    out[chunk] = (float(m["loss"]), loss_sum, sgd_gradient(state.params, new.params), new.params)
  with jax.enable_x64(True):
    ref_sum, ref_n = R.loss_sum_and_count(R.as_float64(state.params), cfg, bt, packed=packed)
    # jitted: one float64 program instead of ~200 op-by-op compiles (12 s of this test's 19 s, measured)
    ref_grads = jax.jit(jax.grad(lambda p, b: R.mean_loss(p, cfg, b, packed, jnp)))(R.as_float64(state.params), bt)
  ref_grads = [np.asarray(g) for _, g in named_leaves(ref_grads)]
  n = int(ref_n)
  names = ["/".join(name) for name, _ in named_leaves(state.params)]
  for chunk, (loss, loss_sum, grads, params) in out.items():
    # float32 logits carry a few ulps of their scale; logsumexp over V=128 and the sum over <= 32
    # tokens: (128 + 32) ulps of the total, as for the unchunked loss above.
    # (unchunked: the train step's mean times the count, one more rounding)
    np.testing.assert_allclose(loss_sum, float(ref_sum), rtol=(128 + 32 + 1) * U32, err_msg=f"chunk {chunk}")
    np.testing.assert_allclose(loss, float(ref_sum) / n, rtol=(128 + 32) * U32, err_msg=f"chunk {chunk}")
    # Each gradient within GRAD_RTOL of its leaf's largest (the derivation at the top: the chunked
    # head sums the same per-token products, chunk by chunk, in float32), plus the rounding of the
    # SGD step p - g (one ulp of |p|) that the difference old - new reads it through.
    for name, g, want, p in zip(names, grads, ref_grads, jax.tree_util.tree_leaves(params)):
      tol = GRAD_RTOL * np.abs(want).max() + U32 * np.abs(np.asarray(p)).max()
      np.testing.assert_allclose(g, want, rtol=0, atol=tol, err_msg=f"chunk {chunk} {name}")
  if backend != "flax":
    return
  # And chunked against unchunked directly: each within the bounds above of the reference, so twice
  # them apart.
  np.testing.assert_allclose(out[3][0], out[0][0], rtol=2 * (128 + 32) * U32)
  for name, a, b, p in zip(names, out[3][2], out[0][2], jax.tree_util.tree_leaves(out[0][3])):
    tol = 2 * (GRAD_RTOL * np.abs(b).max() + U32 * np.abs(np.asarray(p)).max())
    np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=name)


def compiled_temp_bytes(cfg, b, t):
  """XLA's compiled memory analysis of the jitted train step: temporary bytes (no run)."""
  model = Transformer(cfg)
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0), 10)
  with jax.set_mesh(MESH), precision_scope("bf16", cfg.backend):
    state, _ = abstract_state(model, opt, MESH, b, t)
    bt = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    compiled = jax.jit(make_train_step(model, opt, sched)).lower(state, bt).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # eight XLA compiles (~1 min of CPU)
def test_chunked_loss_memory_does_not_scale_with_t_times_v():
  """Temporary memory of the compiled step at T, 2T x V, 2V (bf16 compute). The mixed difference
  M(2T, 2V) - M(2T, V) - M(T, 2V) + M(T, V) cancels everything that grows with T alone (attention,
  activations) or V alone (embedding, head gradient, one chunk's logits) and leaves the buffers of
  B x T x V elements: each adds at least B*T*V*2 bytes (bf16). Unchunked, the bf16 logits and their
  fp32 copy are there (>= 6 bytes per element); chunked, not even half of one bf16 such buffer."""
  b, t, v = 2, 128, 4096
  mixed = {}
  for chunk in (0, 32):
    cfg = dataclasses.replace(MODEL, vocab_size=v, n_layers=1, dtype="bfloat16", loss_chunk=chunk)
    m = {(tt, vv): compiled_temp_bytes(dataclasses.replace(cfg, vocab_size=vv), b, tt)
         for tt in (t, 2 * t) for vv in (v, 2 * v)}
    mixed[chunk] = m[2 * t, 2 * v] - m[2 * t, v] - m[t, 2 * v] + m[t, v]
  assert mixed[0] >= b * t * v * 6, mixed
  assert mixed[32] < b * t * v * 2 / 2, mixed


# ---- matmul weights cast once per step -------------------------------------------------------------

@pytest.mark.parametrize("backend,tied,chunk", [pytest.param("flax", False, 3, id="flax-untied-chunked"),
                                                pytest.param("te", True, 0, id="te-tied", marks=pytest.mark.te)])
def test_cast_params_once_changes_nothing(backend, tied, chunk):
  """model.cast_params_once (bf16 compute): the model receives the very bf16 values each use would have
  cast, and every gradient returns to float32 through the same single rounding as the per-use cast's
  transpose (the tied embedding, whose two uses would add in bf16, is not pre-cast): the same
  operations on the same values, so the update is the same bit for bit."""
  bt = padded_batch(seed=3)
  out = []
  for once in (False, True):
    cfg = dataclasses.replace(MODEL, backend=backend, dtype="bfloat16", tie_embeddings=tied, loss_chunk=chunk,
                              cast_params_once=once)
    state, run, _ = setup(cfg, optimizer=optax.sgd(1.0))
    state = state.replace(params=R.random_params(state.params, seed=2, embed_std=0.5))
    new, m = run(state, bt)
    out.append((new.params, float(m["loss"]), float(m["grad_norm"])))
  (a, *ma), (b, *mb) = out
  assert ma == mb
  for (name, x), (_, y) in zip(named_leaves(a), named_leaves(b)):
    assert x.dtype == y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg="/".join(name))
  assert not np.array_equal(np.asarray(a["lm_head" if not tied else "final_norm"]["scale"]),
                            np.asarray(state.params["lm_head" if not tied else "final_norm"]["scale"]))


def test_cast_matmul_weights_leaves_norms_and_a_tied_embedding():
  params = {"embed": {"embedding": jnp.ones((4, 2))}, "layers": {"qkv": {"kernel": jnp.ones((2, 2)),
            "scale": jnp.ones(2)}, "mlp": {"wi_kernel": jnp.ones((2, 2, 2)), "wo_kernel": jnp.ones((2, 2))}}}
  dt = lambda t: {"/".join(n): x.dtype for n, x in named_leaves(t)}
  untied = dt(cast_matmul_weights(params, jnp.bfloat16, MODEL))
  tied = dt(cast_matmul_weights(params, jnp.bfloat16, dataclasses.replace(MODEL, tie_embeddings=True)))
  bf, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  assert untied == {"embed/embedding": bf, "layers/qkv/kernel": bf, "layers/qkv/scale": f32,
                    "layers/mlp/wi_kernel": bf, "layers/mlp/wo_kernel": bf}
  assert tied == {**untied, "embed/embedding": f32}


@pytest.mark.parametrize("precision", ["bf16", "fp8_delayed"])
def test_host_params_reach_the_forward_moved_then_cast_unless_quantized(precision):
  """optim.offload=host_params: the forward reads the parameters in device memory, the matmul weights in the
  compute dtype (bf16; the norms float32), as model.cast_params_once gives them; under FP8 (its GEMMs quantize the
  master weights) every leaf float32, as it was. The values: the host arrays', cast by round to nearest."""
  params = {"embed": {"embedding": jnp.linspace(-1, 1, 8).reshape(4, 2)},
            "layers": {"qkv": {"kernel": jnp.full((2, 2), 1 / 3), "scale": jnp.full(2, 1 / 3)}}}
  host = jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
  cfg = dataclasses.replace(MODEL, dtype="bfloat16", precision=precision)
  got = jax.jit(lambda p: forward_params(p, cfg, False, True))(host)
  bf16 = precision == "bf16"
  for (name, x), (_, y) in zip(named_leaves(got), named_leaves(params)):
    assert x.sharding.memory_kind == "device", name
    want = y.astype(jnp.bfloat16) if bf16 and name[-1] != "scale" else y
    assert x.dtype == want.dtype and np.array_equal(np.asarray(x), np.asarray(want)), name
  assert {x.dtype for x in jax.tree.leaves(got)} == ({jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)} if bf16
                                                    else {jnp.dtype(jnp.float32)})


@pytest.mark.te
@pytest.mark.parametrize("fp8_lm_head", [False, True], ids=["bf16-head", "fp8-head"])
def test_chunked_loss_under_fp8_delayed(fake_fp8_gpu, fp8_lm_head):
  """FP8 delayed scaling with model.loss_chunk: the layers' FP8 GEMMs (and their amax history) are the
  same as unchunked. With a float32 head the loss is too (the bound of the chunked test above, twice).
  With model.fp8_lm_head the chunked head quantizes by itself (current power-of-2 scales, no state;
  its loss is checked against a numpy reference below), while the unchunked one is TE's, with an
  FP8 state of its own."""
  cfg = dataclasses.replace(MODEL, backend="te", precision="fp8_delayed", fp8_amax_history_len=4, n_layers=1,
                            fp8_lm_head=fp8_lm_head)
  assert use_chunked_loss(dataclasses.replace(cfg, loss_chunk=3))
  assert fp8_chunked_head(dataclasses.replace(cfg, loss_chunk=3)) == fp8_lm_head
  assert not fp8_chunked_head(dataclasses.replace(cfg, loss_chunk=0))
  out = []
  for chunk in (3, 0):
    state, run, _ = setup(dataclasses.replace(cfg, loss_chunk=chunk), "fp8_delayed")
    s1, m = run(state, batch(seed=1))
    out.append((float(m["loss"]), s1.model_state[FP8_COLLECTION]))
  if not fp8_lm_head:
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=2 * (128 + 32) * U32)
  hist = lambda ms: np.asarray(ms["layers"]["qkv"]["x_amax_history"])  # [L, 4]
  np.testing.assert_array_equal(hist(out[0][1]), hist(out[1][1]))
  assert (hist(out[0][1]) != 0).sum() == 1
  assert "lm_head" not in out[0][1]  # chunked: no head state, quantized or not
  assert ("lm_head" in out[1][1]) == fp8_lm_head  # unchunked: TE's head state only when it is quantized


E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the largest finite values of OCP FP8 E4M3 (fn) and E5M2


def fp8_head_reference(y, kernel, targets, mask, vocab_axis, out_dtype):
  """The FP8 chunked head written from its definition, in float64 with ml_dtypes' FP8 rounding:
  per-tensor power-of-2 scales 2**ceil(log2(amax / max)) for y and the kernel (e4m3), logits rounded to
  the compute dtype, the logits' gradient (softmax - onehot) * mask in e5m2 at the fixed scale 2**-15.
  Returns (summed NLL, dy, dkernel, |y| |d| bound terms for the tolerances)."""
  def q(x, dtype, big, scale):
    return np.clip(x / scale, -big, big).astype(dtype).astype(np.float64) * scale

  def pow2(x, big):
    return 2.0 ** np.ceil(np.log2(np.abs(x).max() / big))
  y = np.asarray(y, np.float64)  # [B, T, D]
  w = np.asarray(kernel, np.float64)
  w = w if vocab_axis == 1 else w.T  # [D, V]
  yq, wq = q(y, ml_dtypes.float8_e4m3fn, E4M3_MAX, pow2(y, E4M3_MAX)), q(w, ml_dtypes.float8_e4m3fn, E4M3_MAX,
                                                                        pow2(w, E4M3_MAX))
  logits = (yq @ wq).astype(out_dtype).astype(np.float64)  # [B, T, V]
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)  # [B, T]
  tl = np.take_along_axis(logits, targets[..., None], -1)[..., 0]  # [B, T]
  m = np.asarray(mask, np.float64)
  nll = float(((lse - tl) * m).sum())
  d = (np.exp(logits - lse[..., None]) - np.eye(w.shape[1])[targets]) * m[..., None]  # [B, T, V]
  dq = q(d, ml_dtypes.float8_e5m2, E5M2_MAX, 2.0 ** -15)
  dy = dq @ wq.T  # [B, T, D]
  dw = np.einsum("btd,btv->dv", yq, dq)  # [D, V]
  absdw = np.einsum("btd,btv->dv", np.abs(yq), np.abs(dq))
  return nll, dy, (dw if vocab_axis == 1 else dw.T), (absdw if vocab_axis == 1 else absdw.T), d, yq


@pytest.mark.parametrize("vocab_axis", [1, 0], ids=["untied", "tied"])
def test_fp8_chunked_head_matches_a_quantized_reference(vocab_axis):
  """chunked_token_losses(fp8=True) against fp8_head_reference, loss and both gradients, over 3 chunks
  of 4 positions (the last padded) with masked positions. Tolerances: the code's logits and dy are bf16
  GEMM outputs and dW is rounded to bf16 once, so each may differ from the float64 reference by one bf16
  rounding, 2**-8 relative (a half ulp is 2**-9; 2**-8 also covers the fp32 accumulation moving a value
  across a rounding point), plus fp32 accumulation over D=16 or B*T=20 terms, 32 * 2**-24 of the
  sum of their magnitudes. A logit off by 2**-8 |logit| moves a token's NLL by at most twice that. The
  reference without any FP8 rounding must miss these bounds, or the test would not see quantization."""
  b, t, d, v = 2, 10, 16, 48
  rng = np.random.default_rng(7)
  y = jnp.asarray(rng.normal(0, 2.0, (b, t, d)), jnp.bfloat16)  # [B, T, D]
  kernel = jnp.asarray(rng.normal(0, 0.4, (d, v) if vocab_axis == 1 else (v, d)), jnp.float32)
  targets = rng.integers(0, v, (b, t)).astype(np.int32)  # [B, T]
  mask = np.ones((b, t), np.float32)
  mask[0, 7:] = 0  # [B, T]

  def loss(y, k):
    return chunked_token_losses(y, k, targets, mask, chunk=4, vocab_axis=vocab_axis, fp8=True)[0]
  got, (gy, gk) = jax.value_and_grad(loss, argnums=(0, 1))(y, kernel)
  nll, dy, dk, absdk, dref, yq = fp8_head_reference(np.asarray(y, np.float32), np.asarray(kernel), targets, mask,
                                                    vocab_axis, ml_dtypes.bfloat16)
  logits_max = np.abs(yq).sum(-1).max() * np.abs(np.asarray(kernel)).max() * 2  # a bound on |logit|
  loss_tol = 2 * 2.0 ** -8 * logits_max * mask.sum()
  assert abs(float(got) - nll) <= loss_tol
  k64 = np.asarray(kernel, np.float64)
  w = k64 if vocab_axis == 1 else k64.T
  absdy = np.abs(np.clip(dref, -1, 1)) @ np.abs(w).T  # [B, T, D]; |dq| <= |d| (1 + 2**-3)
  tol_y = 2.0 ** -8 * np.abs(dy) + 32 * 2.0 ** -24 * 1.125 * 2 * absdy
  tol_k = 2.0 ** -8 * np.abs(dk) + 32 * 2.0 ** -24 * absdk
  assert np.all(np.abs(np.asarray(gy, np.float64) - dy) <= tol_y)
  assert np.all(np.abs(np.asarray(gk, np.float64) - dk) <= tol_k)
  assert np.asarray(gk).dtype == np.float32 and np.asarray(gy).dtype == jnp.bfloat16
  # the bounds are tight enough to see FP8: the unquantized gradient of the same logits misses them
  exact_dk = np.einsum("btd,btv->dv", np.asarray(y, np.float64), dref)
  assert np.any(np.abs((exact_dk if vocab_axis == 1 else exact_dk.T) - np.asarray(gk, np.float64)) > tol_k)


def test_pow2_scale_and_quantize_saturate_at_the_fp8_maximum():
  """The scale is the smallest power of 2 that brings max|x| within range: 448 * 2**-3 = 56 fits 2**-3
  exactly, 57 needs 2**-2; quantize clips at the largest value instead of overflowing to NaN."""
  assert float(pow2_scale(jnp.array([56.0, -3.0]), jnp.float8_e4m3fn)) == 2.0 ** -3
  assert float(pow2_scale(jnp.array([-57.0, 3.0]), jnp.float8_e4m3fn)) == 2.0 ** -2
  assert float(pow2_scale(jnp.array([1.0]), jnp.float8_e5m2)) == 2.0 ** -15
  assert float(pow2_scale(jnp.array([448.0 * 2.0 ** 20]), jnp.float8_e4m3fn)) == 2.0 ** 20  # exact power: itself
  assert float(pow2_scale(jnp.zeros(3), jnp.float8_e4m3fn)) == 1.0
  # a tiny amax (2**-120 / 448 would be subnormal, and flush to zero on CPU): the smallest normal scale, 2**-126,
  # so the value survives quantization as 2**6
  tiny = jnp.array([2.0 ** -120])
  assert float(pow2_scale(tiny, jnp.float8_e4m3fn)) == 2.0 ** -126
  assert float(quantize(tiny, pow2_scale(tiny, jnp.float8_e4m3fn), jnp.float8_e4m3fn).astype(jnp.float32)[0]) == 64.0
  q = quantize(jnp.array([1e6, -1e6, 1.0]), jnp.float32(1.0), jnp.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(q, np.float32), [448.0, -448.0, 1.0])


@pytest.mark.te
def test_fp8_lm_head_runs_chunked_in_the_train_step(fake_fp8_gpu):
  """model.fp8_lm_head with model.loss_chunk under fp8_current: the train step's loss is the FP8 head's
  (fp8_head_reference on the model's own final hidden states), not the float32 head's. The model computes
  in float32 here, so the logits carry no bf16 rounding: each is off by at most fp32 accumulation over
  D=32 terms, 32 * 2**-24 * sum |y_q||w_q| (|y_q||w_q| <= 1.0625**2 |y||w| after e4m3 rounding); a
  token's NLL by twice that plus 8 ulps of its value (logsumexp), and the mean by 32 ulps more (the
  sum over 32 tokens)."""
  cfg = dataclasses.replace(MODEL, backend="te", precision="fp8_current", n_layers=1, fp8_lm_head=True,
                            loss_chunk=3)
  state, run, model = setup(cfg, "fp8_current")
  bt = batch(seed=3)
  _, m = run(state, bt)
  with jax.set_mesh(MESH), precision_scope("fp8_current", "te", cfg.fp8_amax_history_len):
    y, kernel = model.apply({"params": state.params, **state.model_state}, bt["inputs"], bt["positions"],
                            hidden=True)  # [B, T, D], [D, V]
  mask = np.ones(bt["targets"].shape, np.float32)
  nll = fp8_head_reference(np.asarray(y), np.asarray(kernel), bt["targets"], mask, 1, np.float32)[0]
  plain = float(token_losses(jnp.einsum("btd,dv->btv", y, kernel), bt["targets"], mask)[0]) / mask.sum()
  big = 1.0625 ** 2 * float((np.abs(np.asarray(y)) @ np.abs(np.asarray(kernel))).max())  # >= max |logit|
  mean = nll / mask.sum()
  loss_tol = 2 * 32 * U32 * big + 8 * U32 * (math.log(128) + 2 * big) + 32 * U32 * mean  # NLL <= log V + 2 max|logit|
  assert abs(float(m["loss"]) - mean) <= loss_tol
  assert abs(plain - mean) > loss_tol  # the unquantized head's loss is not within it


# ---- make_train_step: micro-batches, master-weight dtypes, the fp16 loss scale ----------------------

def test_gradient_accumulation_runs_the_model_on_micro_batches():
  """grad_accum=A: the model is applied to micro-batches of B/A rows (the activation memory of one), never
  to the whole batch at once; A=1 applies it to the batch."""
  cfg = dataclasses.replace(MODEL, n_layers=1)
  state, _, model = setup(cfg, b=8)
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0), 10)
  for accum in (None, 1, 2, 4):  # None: make_train_step's default, no accumulation
    seen = set()

    class Spy:  # the model as the step uses it: its config and apply()
      cfg = model.cfg

      def apply(self, variables, inputs, *args, **kw):
        seen.add(inputs.shape)
        return model.apply(variables, inputs, *args, **kw)
    kw = {} if accum is None else {"grad_accum": accum}
    step = make_train_step(Spy(), opt, sched, **kw)
    with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
      jax.eval_shape(step, state, batch(b=8))  # traced, not compiled
    assert seen == {(8 // (accum or 1), 8)}, accum


def test_a_pipelined_model_gets_the_whole_batch_and_cuts_its_micro_batches_itself():
  """model.stages > 1 (maxlm/parallel/pipelining.py): the micro-batches must be in flight together, so the step applies the
  model once to the whole batch, whatever grad_accum says; the model pipelines its `microbatches`."""
  cfg = dataclasses.replace(MODEL, n_layers=2)
  state, _, model = setup(cfg, b=8)
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0), 10)
  seen = []

  class Spy:
    cfg, stages = model.cfg, 2

    def apply(self, variables, inputs, *args, **kw):
      seen.append(inputs.shape)
      return model.apply(variables, inputs, *args, **kw)
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    jax.eval_shape(make_train_step(Spy(), opt, sched, grad_accum=4), state, batch(b=8))
  assert seen == [(8, 8)]


# This test found a bug (the bfloat16 gradients were promoted to float32 by the float32 token count); fixed
# in make_train_step.
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_bf16_master_weights_keep_their_dtype_through_a_step(grad_accum):
  """model.param_dtype is the dtype of the master weights, their gradients and Adam's moments: a step
  returns every parameter and optimizer leaf in the dtype it came in."""
  cfg = dataclasses.replace(MODEL, n_layers=1, param_dtype="bfloat16", dtype="bfloat16")
  state, _, model = setup(cfg, grad_accum=grad_accum)
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0), 10)
  step = make_train_step(model, opt, sched, grad_accum=grad_accum)
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    new, _ = jax.eval_shape(step, state, batch())
  dtypes = lambda tree: [x.dtype for x in jax.tree_util.tree_leaves(tree)]
  assert jnp.dtype(jnp.bfloat16) in dtypes(state.params)
  assert dtypes(new.params) == dtypes(state.params) and dtypes(new.opt_state) == dtypes(state.opt_state)


def test_fp16_gradients_are_unscaled_and_the_loss_scale_updated():
  """model.precision=fp16: the step differentiates loss * scale and divides the gradients by the scale, so
  the gradient norm does not depend on it; a clean step counts toward growth (interval 1 here: the scale
  doubles), an overflowing one is skipped, halves the scale and counts as an overflow, not as non-finite.
  The step's metrics report the new scale."""
  cfg = dataclasses.replace(MODEL, n_layers=1, precision="fp16", dtype="bfloat16", fp16_growth_interval=1)
  state, run, _ = setup(cfg, precision="fp16")
  bt = batch(seed=5)

  def at_scale(log2):
    return state.replace(loss_scale=state.loss_scale.replace(scale=jnp.asarray(2.0 ** log2, jnp.float32)))
  norms = []
  for log2 in (4, 10):
    new, m = run(at_scale(log2), bt)
    assert bool(m["finite"]) and float(m["loss_scale"]) == float(new.loss_scale.scale) == 2.0 ** (log2 + 1)
    assert (int(new.loss_scale.good_steps), int(m["overflow_steps"]), int(m["nonfinite_steps"])) == (0, 0, 0)
    norms.append(float(m["grad_norm"]))
  # Both scales are powers of 2, so the fp16 backward differs only where a value under/overflows; a
  # gradient left scaled (or scaled twice) would differ by 2**6 between the two.
  assert 0.5 < norms[0] / norms[1] < 2.0, norms
  new, m = run(at_scale(24), bt)  # 2**24 / 32 tokens on the logits' fp16 gradient overflows (> 65504)
  assert not bool(m["finite"]) and float(m["loss_scale"]) == float(new.loss_scale.scale) == 2.0 ** 23
  assert (int(m["overflow_steps"]), int(m["nonfinite_steps"])) == (1, 0)


@pytest.mark.parametrize("loss_chunk,chunked", [(0, False), (1, True), (3, True)])
def test_any_positive_loss_chunk_runs_the_head_chunked(loss_chunk, chunked):
  """model.loss_chunk > 0 (even 1 position at a time): the step asks the model for its hidden states and
  applies the head itself, chunk by chunk; 0 applies the model's own head (logits [B, T, V])."""
  cfg = dataclasses.replace(MODEL, n_layers=1, loss_chunk=loss_chunk)
  state, _, model = setup(cfg)
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0), 10)
  hidden = []

  class Spy:  # the model as the step uses it: its config and apply()
    cfg = model.cfg

    def apply(self, *args, **kw):
      hidden.append(kw.get("hidden", False))
      return model.apply(*args, **kw)
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    jax.eval_shape(make_train_step(Spy(), opt, sched), state, batch())  # traced, not compiled
  assert hidden == [chunked]


def test_packed_rows_keep_documents_apart_only_when_packed():
  """packed=True: a row's documents (segment ids) attend only within themselves; packed=False (the default
  of both steps) reads the row as one sequence whose segment ids mark padding only. References: the
  model's loss on the row with and without its segment ids (tests/test_model.py checks those against a
  float64 reference)."""
  cfg = dataclasses.replace(MODEL, n_layers=1)
  state, _, model = setup(cfg)
  bt = padded_batch(3, packed=True)  # the last row holds two documents
  variables = {"params": state.params, **state.model_state}
  mask = bt["segment_ids"] > 0
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    want = {packed: float(token_losses(model.apply(variables, bt["inputs"], bt["positions"],
                                                   bt["segment_ids"] if packed else None), bt["targets"], mask)[0])
            for packed in (False, True)}
    got = {False: float(jax.jit(make_eval_step(model))(state, bt)["loss_sum"]),  # the default
           True: float(jax.jit(make_eval_step(model, packed=True))(state, bt)["loss_sum"])}
    _, m = jax.jit(make_train_step(model, *make_optimizer(OptimConfig(warmup_steps=0), 10)))(state, bt)
  # The same float32 program as the reference up to XLA's fusion choices: within the loss's own rounding
  # (GRAD_RTOL relative, as for gradients: the loss is the first link of that chain).
  for packed in (False, True):
    assert abs(got[packed] - want[packed]) <= GRAD_RTOL * abs(want[packed]), packed
  assert abs(want[True] - want[False]) > 100 * GRAD_RTOL * abs(want[False])  # the two readings differ
  assert abs(float(m["loss"]) * float(m["tokens"]) - want[False]) <= 2 * GRAD_RTOL * abs(want[False])


def test_chunked_head_scales_the_fp16_gradient_before_rounding_it():
  """chunked_token_losses under fp16 loss scaling (grad_scale): the logits' gradient is multiplied by the
  scale before it is rounded to float16, as differentiating loss * scale through an unchunked head does,
  so small gradients keep their bits. A kernel of ~2**-20 puts dL/dy near 2**-22: a float16 subnormal (a
  few bits) unscaled, a normal number at scale 2**15 (the largest safe one: |dL/dlogit| <= 1)."""
  rng = np.random.default_rng(0)
  b, t, d, v = 2, 4, 8, 16
  y = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float16)  # [B, T, D]
  w = jnp.asarray(rng.standard_normal((d, v)) * 2.0 ** -20, jnp.float16)  # [D, V]
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = jnp.ones((b, t), jnp.float32)
  scale = jnp.float32(2.0 ** 15)

  def scaled_loss(y_):
    return chunked_token_losses(y_, w, targets, mask, chunk=2, vocab_axis=1, grad_scale=scale)[0] * scale
  dy = np.asarray(jax.grad(scaled_loss)(y), np.float64) / 2.0 ** 15  # [B, T, D]
  y64, w64 = np.asarray(y, np.float64), np.asarray(w, np.float64)
  logits = y64 @ w64  # [B, T, V]
  p = np.exp(logits - logits.max(-1, keepdims=True))
  g = p / p.sum(-1, keepdims=True) - np.eye(v)[np.asarray(targets)]  # dL/dlogits, [B, T, V]
  # the scaled gradient rounded to float16 (2**-11 relative), the GEMM's float16 result (2**-11), the
  # logits' own float16 rounding (absolute 2**-24 at most here, negligible in the softmax): twice 2 ulps
  tol = 4 * 2.0 ** -11 * (np.abs(g) @ np.abs(w64).T)
  assert (np.abs(dy - g @ w64.T) <= tol).all()
