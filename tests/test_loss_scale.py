"""model.precision=fp16: the dynamic loss scale against a reference state machine written here; overflow
steps skipped (not counted as non-finite), the scale halving and growing back in the real train step;
fp16 tracking fp32 on both backends; the scale through checkpoints (resume, older checkpoints, refusal)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.checkpoint import CheckpointError, Checkpointer, start
from maxlm.config import OptimConfig, load_config, to_dict
from maxlm.loss_scale import MAX_SCALE, init_loss_scale, update_loss_scale
from maxlm.metrics import progress_line
from maxlm.trainer import Trainer
import reference as R
from test_step import MODEL, batch, setup


def _start(t, cfg):
  """maxlm.checkpoint.start for a Trainer, as the trainer takes it: the state into `t`; the Checkpointer."""
  r = start(t.state, t.state_shardings, t.train_data, cfg)
  t.state = r.state
  return r.checkpointer

FP16 = dataclasses.replace(MODEL, precision="fp16", dtype="bfloat16")


class RefScale:
  """The rule as documented, in plain Python: an overflow (finite loss, non-finite gradients) halves the
  scale (not below min) and restarts the count; a clean step counts, and the count reaching the interval
  doubles the scale (not above MAX_SCALE) and restarts it; a non-finite loss changes nothing."""

  def __init__(self, scale, interval, min_scale):
    self.scale, self.good, self.overflows, self.interval, self.min = scale, 0, 0, interval, min_scale

  def step(self, loss_finite, grads_finite):
    if loss_finite and not grads_finite:
      self.scale, self.good, self.overflows = max(self.scale / 2, self.min), 0, self.overflows + 1
    elif loss_finite:
      self.good += 1
      if self.good == self.interval:
        self.scale, self.good = min(self.scale * 2, MAX_SCALE), 0


def test_update_rule_matches_reference():
  rng = np.random.default_rng(0)
  # Random flags, then long clean runs (growth to the cap) and long overflow runs (down to the floor).
  flags = [tuple(bool(x) for x in rng.random(2) < 0.8) for _ in range(200)]
  flags += [(True, True)] * 80 + [(True, False)] * 40 + [(False, False), (False, True)] * 3
  cfg = dataclasses.replace(FP16, fp16_initial_scale=2.0 ** 16, fp16_growth_interval=3, fp16_min_scale=0.25)
  ls, ref = init_loss_scale(cfg), RefScale(2.0 ** 16, 3, 0.25)
  update = jax.jit(update_loss_scale)
  seen = set()
  for lf, gf in flags:
    ls = update(ls, jnp.asarray(lf), jnp.asarray(gf))
    ref.step(lf, gf)
    # powers of two and counters: exact
    assert (float(ls.scale), int(ls.good_steps), int(ls.overflow_steps)) == (ref.scale, ref.good, ref.overflows)
    seen.add(ref.scale)
  assert {MAX_SCALE, 0.25} <= seen  # both bounds were reached


def test_no_loss_scale_unless_fp16():
  assert init_loss_scale(MODEL) is None
  state, _, _ = setup(dataclasses.replace(MODEL, n_layers=1))
  assert state.loss_scale is None


def leaves_equal(a, b) -> bool:
  """Bit for bit (NaN equal to NaN: a poisoned state compared with itself)."""
  return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=jnp.issubdtype(x.dtype, jnp.inexact))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_overflow_skips_halve_the_scale_and_clean_steps_grow_it():
  """From a scale of 2^24 the scaled fp16 gradients overflow: those updates are skipped (parameters and
  Adam state untouched), the scale halves each time, and they are not non-finite steps. Once clean, the
  scale doubles after every 2 clean steps (and halves again when that overflows). A non-finite loss is
  a non-finite step and leaves the scale alone."""
  cfg = dataclasses.replace(FP16, fp16_initial_scale=2.0 ** 24, fp16_growth_interval=2)
  state, run, _ = setup(cfg)
  ref = RefScale(2.0 ** 24, 2, 1.0)
  applied, grew = [], False
  for k in range(24):
    new, m = run(state, batch(seed=k))
    loss_finite, finite = bool(np.isfinite(float(m["loss"]))), bool(m["finite"])
    assert loss_finite
    before = ref.scale
    ref.step(loss_finite, finite)
    grew |= ref.scale > before
    assert float(new.loss_scale.scale) == float(m["loss_scale"]) == ref.scale, k
    assert int(m["overflow_steps"]) == ref.overflows and int(m["nonfinite_steps"]) == 0
    assert leaves_equal(new.params, state.params) == (not finite), k
    assert leaves_equal(new.opt_state, state.opt_state) == (not finite), k
    applied.append(finite)
    state = new
  # The premises: it started with overflows, then updates were applied and the scale grew.
  assert not applied[0] and any(applied) and grew, applied

  # A non-finite loss (a NaN embedding row read by the batch) is a non-finite step; the scale stays.
  emb = state.params["embed"]["embedding"].at[3].set(jnp.nan)
  poisoned = state.replace(params={**state.params, "embed": {"embedding": emb}})
  bt = batch(seed=99)
  bt["inputs"][0, 0] = 3
  new, m = run(poisoned, bt)
  assert not np.isfinite(float(m["loss"])) and int(m["nonfinite_steps"]) == 1
  assert int(m["overflow_steps"]) == ref.overflows and float(m["loss_scale"]) == ref.scale
  assert leaves_equal(new.params, poisoned.params)


STEPS = 6


def losses(cfg, precision="bf16"):
  """(loss, grad norm, applied) of STEPS AdamW steps from the same initial parameters on one batch (random
  tokens: only memorizing it lowers the loss)."""
  state, run, _ = setup(cfg, precision=precision, optim=OptimConfig(warmup_steps=0, learning_rate=1e-2))
  state = state.replace(params=R.random_params(state.params, seed=2, embed_std=0.5))  # the same on both backends
  out = []
  for _ in range(STEPS):
    state, m = run(state, batch(seed=0))
    out.append((float(m["loss"]), float(m["grad_norm"]), bool(m["finite"])))
  return np.array(out)  # [STEPS, 3]


@pytest.fixture(scope="module")
def yardstick():
  """The float32 run and how far the bf16 run strays from it (flax backend)."""
  f32 = losses(dataclasses.replace(MODEL, dtype="float32"))
  bf16 = losses(dataclasses.replace(MODEL, dtype="bfloat16"))
  return f32, np.abs(bf16[:, :2] - f32[:, :2]).max(axis=0)  # [2]: loss, grad norm


@pytest.mark.parametrize("backend", [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)])
def test_fp16_tracks_fp32_at_least_as_closely_as_bf16(backend, yardstick):
  """Rounding errors are, to first order, proportional to the unit roundoff: fp16's (2^-11) is 8x
  smaller than bf16's (2^-8), so over a few steps fp16 stays at least as close to the float32 losses
  and gradient norms as bf16 does (with 8x to spare). The gradient norm also catches a scale that is
  not divided out again (Adam alone would hide it). From the same parameters TE float32 equals flax
  float32 to ~1e-6 (test_model.py), far inside that. No step overflows at a 2^10 scale on this model."""
  f32, bf16_err = yardstick
  fp16 = losses(dataclasses.replace(FP16, backend=backend, fp16_initial_scale=2.0 ** 10))
  assert fp16[:, 2].all()
  err = np.abs(fp16[:, :2] - f32[:, :2]).max(axis=0)
  assert (err <= bf16_err).all(), (err, bf16_err)
  assert bf16_err.min() > 0 and f32[-1, 0] < f32[0, 0]  # premises: bf16 differs; training moves


@pytest.mark.te
def test_te_fp16_computes_in_float16():
  from maxlm.layers import precision_scope
  from maxlm.model import Transformer
  cfg = dataclasses.replace(FP16, backend="te", n_layers=1)
  model = Transformer(cfg)
  tokens = jnp.zeros((1, 4), jnp.int32)
  with precision_scope("fp16", "te"):
    variables = model.init(jax.random.PRNGKey(0), tokens)
    logits = model.apply(variables, tokens)
  assert logits.dtype == jnp.float16
  assert {x.dtype for x in jax.tree_util.tree_leaves(variables["params"])} == {jnp.dtype(jnp.float32)}


# ---- checkpoints -----------------------------------------------------------------------------------

TINY = ["model.backend=flax", "model.n_layers=1", "model.d_model=64", "model.vocab_size=512", "model.remat=none",
        "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=8", "optim.warmup_steps=0",
        "checkpoint.enabled=true", "run_name=r"]


def trainer(tmp_path, *extra):
  cfg = load_config(TINY + [f"output_dir={tmp_path}"] + list(extra))
  t = Trainer(cfg)
  t.build()
  return cfg, t


def save(cfg, t, step=5):
  ckpt = Checkpointer(cfg.run_dir / "checkpoints", cfg.checkpoint)
  ckpt.save(step, t.state, t.train_data.get_state(), to_dict(cfg))
  ckpt.close()


def test_resume_keeps_the_loss_scale(tmp_path):
  cfg, t = trainer(tmp_path, "model.precision=fp16")
  t.state = t.state.replace(loss_scale=t.state.loss_scale.replace(
      scale=jnp.float32(256.0), good_steps=jnp.int32(7), overflow_steps=jnp.int32(3)))
  save(cfg, t)
  cfg, t = trainer(tmp_path, "model.precision=fp16")
  _start(t, cfg).close()
  ls = t.state.loss_scale
  assert (float(ls.scale), int(ls.good_steps), int(ls.overflow_steps)) == (256.0, 7, 3)


def test_checkpoint_without_loss_scale_restores_into_fp16(tmp_path, capsys):
  """A bf16 run's checkpoint (no loss scale, as before fp16 existed) resumes under fp16 with a fresh
  scale, saying so; everything else is restored."""
  cfg, t = trainer(tmp_path)
  assert t.state.loss_scale is None
  t.state = t.state.replace(nonfinite_steps=jnp.int32(2))
  save(cfg, t)
  cfg, t = trainer(tmp_path, "model.precision=fp16", "model.fp16_initial_scale=512")
  _start(t, cfg).close()
  assert float(t.state.loss_scale.scale) == 512.0 and int(t.state.loss_scale.overflow_steps) == 0
  assert int(t.state.nonfinite_steps) == 2
  assert "holds no fp16 loss scale" in capsys.readouterr().out


def test_fp16_checkpoint_into_bf16_is_refused_in_one_line(tmp_path):
  cfg, t = trainer(tmp_path, "model.precision=fp16")
  save(cfg, t)
  cfg, t = trainer(tmp_path)
  with pytest.raises(CheckpointError) as e:
    _start(t, cfg)
  msg = str(e.value)
  assert "\n" not in msg and ".loss_scale" in msg and "model.precision: 'fp16' -> 'bf16'" in msg


def test_progress_line_shows_the_scale_and_overflow_skips():
  row = {"loss": 2.0, "learning_rate": 1e-3, "grad_norm": 0.5, "loss_scale": 32768.0, "overflow_steps": 3}
  line = progress_line(10, 100, row, flops_known=False)
  assert "scale 32768, 3 overflow skips" in line and "skipped" not in line  # not non-finite steps
  assert "scale" not in progress_line(10, 100, {k: row[k] for k in ("loss", "learning_rate", "grad_norm")},
                                      flops_known=False)
