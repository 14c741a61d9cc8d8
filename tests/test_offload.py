"""optim.offload=host and host_params on CPU, where JAX has the pinned_host memory kind: `place` puts the optimizer
state (host), and the parameters with it (host_params), in host memory; jitted train steps keep them there (in
and out shardings, donation), skip a non-finite step, and give the on-device run's parameters and moments, bit
for bit (host_params: also in bfloat16 compute, with gradient accumulation, scanned or unrolled layers)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm import step as step_lib
from maxlm.config import MeshConfig, ModelConfig, OptimConfig
from maxlm.layers import precision_scope
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.offload import in_host_memory, place, to_device_memory, to_host_memory
from maxlm.optim import make_optimizer
from maxlm.parallel.sharding import batch_sharding, replicated
from maxlm.build import CompiledStep
from maxlm.step import make_train_step
from maxlm.train_state import abstract_state, create_train_state

MODEL = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                    dtype="float32", remat="none", backend="flax")
# The moments sharded over two devices (the simulated CPU devices); on one GPU (`-m gpu` collects this module too)
# one device, so that collection does not fail there.
MESH = make_mesh(MeshConfig(fsdp=min(2, jax.device_count())), jax.devices()[:2])
KEYS = ("inputs", "targets", "segment_ids", "positions")


def _kinds(tree) -> set:
  """The memory kinds of a tree of arrays or of shardings."""
  return {getattr(x, "sharding", x).memory_kind for x in jax.tree_util.tree_leaves(tree)}


def test_place_puts_only_the_optimizer_state_in_host_memory():
  model = Transformer(MODEL)
  opt, _ = make_optimizer(OptimConfig(), 10)
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    structs, shardings = abstract_state(model, opt, MESH, 4, 8, "host")
    plain = abstract_state(model, opt, MESH, 4, 8)[1]
  assert _kinds(shardings.opt_state) == {"pinned_host"} and len(jax.tree_util.tree_leaves(shardings.opt_state)) > 4
  rest = shardings.replace(opt_state=None)
  assert _kinds(rest) == _kinds(plain.replace(opt_state=None)) and "pinned_host" not in _kinds(rest)
  assert jax.tree.map(lambda s: s.spec, shardings) == jax.tree.map(lambda s: s.spec, plain)  # same layout
  assert _kinds(structs.opt_state) == {"pinned_host"}
  assert place(plain, "none") is plain
  with pytest.raises(ValueError, match="'disk'"):
    place(plain, "disk")
  both = place(plain, "host_params")
  assert _kinds(both.opt_state) == _kinds(both.params) == {"pinned_host"}
  rest = both.replace(opt_state=None, params=None)
  assert "pinned_host" not in _kinds(rest) and len(jax.tree_util.tree_leaves(rest)) > 0
  assert jax.tree.map(lambda s: s.spec, both) == jax.tree.map(lambda s: s.spec, plain)


def test_memory_moves_inside_jit():
  """to_device_memory / to_host_memory change only the leaves in the other memory; in_host_memory reads the
  traced values' memory space."""
  host = jax.device_put(jnp.arange(4.0), jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
  dev = jnp.arange(4.0)

  def f(h, d):
    assert in_host_memory((h, d)) and not in_host_memory(d)
    moved = to_device_memory((h, d))
    assert not in_host_memory(moved)
    back = to_host_memory(moved)
    assert all(jax.typeof(x).memory_space == jax.memory.Space.Host for x in back)
    return moved[0] + moved[1], back
  s, (h2, d2) = jax.jit(f)(host, dev)
  assert s.sharding.memory_kind == "device" and h2.sharding.memory_kind == d2.sharding.memory_kind == "pinned_host"
  np.testing.assert_array_equal(s, 2 * np.arange(4.0))


def _batches(n):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    toks = rng.integers(0, 128, (4, 9), dtype=np.int32)  # [B, T + 1]
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((4, 8), np.int32),
                "positions": np.tile(np.arange(8, dtype=np.int32), (4, 1))})
  return out


def _run(offload, moments, batches, model_cfg=MODEL, grad_accum=1, out=None, split_layers=True, guard="cond"):
  """(final state as numpy, per-step finite flags, opt_state memory kinds after each step); `moments`: the
  optimizer's mu_dtype, nu_dtype and moment_rounding. `out`, a dict, also gets the initial params ("initial"),
  each step's loss ("losses"), the params' memory kinds after each step ("param_kinds"), the eval step's loss
  sums on the batches after the last step ("eval") and the compiled step ("compiled"). split_layers: an
  offloaded state streams the scanned stack a layer at a time (maxlm/optim.py). guard: the step's non-finite
  guard (maxlm/step.py)."""
  model = Transformer(model_cfg)
  mu, nu, rounding = moments
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0, learning_rate=1e-2, mu_dtype=mu, nu_dtype=nu,
                                          moment_rounding=rounding), 10, split_layers=split_layers)

  def scope():
    return jax.set_mesh(MESH)
  with scope(), precision_scope("bf16", "flax"):
    state, shardings = create_train_state(model, opt, MESH, 0, 4 // grad_accum, 8, offload)
  bs = {k: batch_sharding(MESH) for k in KEYS}
  step = CompiledStep(make_train_step(model, opt, sched, grad_accum=grad_accum, guard=guard), shardings, bs, scope,
                      metrics_sharding=replicated(MESH))
  finite, kinds, out = [], [], {} if out is None else out
  out["initial"] = jax.tree.map(np.asarray, state.params)
  for b in batches:
    with precision_scope("bf16", "flax"):
      state, m = step(state, {k: jax.device_put(v, bs[k]) for k, v in b.items()})
    finite.append(bool(m["finite"]))
    kinds.append(_kinds(state.opt_state))
    out.setdefault("losses", []).append(np.asarray(m["loss"]))
    out.setdefault("param_kinds", []).append(_kinds(state.params))
  evaluate = CompiledStep(step_lib.make_eval_step(model), shardings, bs, scope, donate=False,
                          metrics_sharding=replicated(MESH), name="eval_step")
  with precision_scope("bf16", "flax"):
    out["eval"] = [np.asarray(evaluate(state, {k: jax.device_put(v, bs[k]) for k, v in b.items()})["loss_sum"])
                   for b in batches]
  out["compiled"] = step.executable
  return jax.tree.map(np.asarray, state), finite, kinds


@pytest.mark.parametrize("moments,split", [(("float32", "float32", "stochastic"), True),
                                           (("bfloat16", "bfloat16", "stochastic"), True),
                                           (("bfloat16", "bfloat16", "stochastic"), False),
                                           (("bfloat16", "float32", "nearest"), True)],
                         ids=["fp32", "bf16-sr", "bf16-sr-whole-stack", "bf16mu-nearest"])
def test_offloaded_steps_match_the_device_run(moments, split, monkeypatch):
  """Three jitted train steps (the second's loss poisoned: skipped) with the optimizer state in host memory,
  against the same steps with it on the device. Parameters, moments and counters are bit-identical: the
  streamed update rounds each parameter's moments with the same bits (stochastic rounding) as the whole-tree
  one, the scanned stack's a layer at a time (split) or whole."""
  batches = _batches(3)
  poison = int(batches[1]["targets"].sum())
  original = step_lib.token_losses

  def poisoned(logits, targets, mask):
    loss, n = original(logits, targets, mask)
    return loss + jnp.where(jnp.sum(targets) == poison, jnp.nan, 0.0), n
  monkeypatch.setattr(step_lib, "token_losses", poisoned)
  ref, ref_finite, ref_kinds = _run("none", moments, batches)
  got, finite, kinds = _run("host", moments, batches, split_layers=split)
  assert ref_finite == finite == [True, False, True]
  assert ref_kinds == [{"device"}] * 3 and kinds == [{"pinned_host"}] * 3
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)
  (adam,) = [s for s in jax.tree_util.tree_leaves(got.opt_state, is_leaf=is_adam) if is_adam(s)]
  for tree, dtype in ((adam.mu, moments[0]), (adam.nu, moments[1])):
    assert {x.dtype for x in jax.tree_util.tree_leaves(tree)} == {jnp.dtype(dtype)}
  _assert_bits_equal(ref, got)


def _assert_bits_equal(ref, got):
  flat = jax.tree_util.tree_flatten_with_path(ref)[0]
  for (path, a), b in zip(flat, jax.tree_util.tree_leaves(got), strict=True):
    assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)


def _poison(monkeypatch, batch, rows):
  """The loss of `batch`'s first `rows` rows (a micro-batch, recognized by its targets' sum) made NaN: its step is
  skipped."""
  poison = int(batch["targets"][:rows].sum())
  original = step_lib.token_losses

  def poisoned(logits, targets, mask):
    loss, n = original(logits, targets, mask)
    return loss + jnp.where(jnp.sum(targets) == poison, jnp.nan, 0.0), n
  monkeypatch.setattr(step_lib, "token_losses", poisoned)


BF16_MODEL = dataclasses.replace(MODEL, dtype="bfloat16")


@pytest.mark.parametrize("model_cfg,grad_accum,moments,split,guard", [
    (BF16_MODEL, 1, ("float32", "float32", "stochastic"), True, "cond"),
    (dataclasses.replace(BF16_MODEL, scan_layers=False), 2, ("bfloat16", "bfloat16", "stochastic"), True, "cond"),
    (BF16_MODEL, 2, ("bfloat16", "bfloat16", "stochastic"), True, "cond"),
    (BF16_MODEL, 2, ("bfloat16", "float32", "nearest"), False, "cond"),
    (BF16_MODEL, 1, ("bfloat16", "bfloat16", "stochastic"), True, "select"),
], ids=["bf16-scanned", "bf16-unrolled-accum2-bf16moments", "bf16-scanned-accum2-bf16moments",
        "bf16-scanned-whole-stack-accum2-bf16mu", "bf16-scanned-guard-select"])
def test_host_params_steps_match_the_device_run(model_cfg, grad_accum, moments, split, guard, monkeypatch):
  """optim.offload=host_params: four jitted train steps (the third's loss poisoned: skipped) with the float32
  master parameters and the optimizer state in host memory, against the same steps with both on the device, in
  bfloat16 compute (the step holds the parameters' bfloat16 copy: moved to the device, then cast; the device run
  casts them at each use, model.cast_params_once=false), with and without gradient accumulation, scanned (the
  stack streamed a layer at a time, or whole) and unrolled layers, the non-finite guard a cond or a select (the
  planner's what-if: host leaves selected on the device). Each step's loss, the parameters, moments and
  counters after them, and the eval step's losses are bit-identical; both parameters and optimizer state are in
  pinned host memory after every step."""
  batches = _batches(4)
  _poison(monkeypatch, batches[2], 4 // grad_accum)
  ref_out, got_out = {}, {}
  ref, ref_finite, _ = _run("none", moments, batches, model_cfg, grad_accum, ref_out, guard=guard)
  got, finite, kinds = _run("host_params", moments, batches, model_cfg, grad_accum, got_out, split_layers=split,
                            guard=guard)
  assert ref_finite == finite == [True, True, False, True]
  assert kinds == got_out["param_kinds"] == [{"pinned_host"}] * 4
  assert ref_out["param_kinds"] == [{"device"}] * 4
  assert all(np.isfinite(x) for i, x in enumerate(ref_out["losses"]) if i != 2)
  np.testing.assert_array_equal(np.array(got_out["losses"]), np.array(ref_out["losses"]))
  np.testing.assert_array_equal(np.array(got_out["eval"]), np.array(ref_out["eval"]))
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(ref_out["initial"]), strict=True):
    assert not np.array_equal(a, b)  # every parameter was updated
  _assert_bits_equal(ref, got)
