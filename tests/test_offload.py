"""optim.offload=host on CPU, where JAX has the pinned_host memory kind: `place` puts the optimizer state
(and only it) in host memory; jitted train steps keep it there (in and out shardings, donation), skip a
non-finite step, and give the on-device run's parameters and moments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm import step as step_lib
from maxlm.config import MeshConfig, ModelConfig, OptimConfig
from maxlm.layers import precision_scope
from maxlm.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.offload import in_host_memory, place, to_device_memory, to_host_memory
from maxlm.optim import make_optimizer
from maxlm.sharding import batch_sharding, replicated
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


def _run(offload, moments, batches):
  """(final state as numpy, per-step finite flags, opt_state memory kinds after each step); `moments`: the
  optimizer's mu_dtype, nu_dtype and moment_rounding."""
  model = Transformer(MODEL)
  mu, nu, rounding = moments
  opt, sched = make_optimizer(OptimConfig(warmup_steps=0, learning_rate=1e-2, mu_dtype=mu, nu_dtype=nu,
                                          moment_rounding=rounding), 10)

  def scope():
    return jax.set_mesh(MESH)
  with scope(), precision_scope("bf16", "flax"):
    state, shardings = create_train_state(model, opt, MESH, 0, 4, 8, offload)
  bs = {k: batch_sharding(MESH) for k in KEYS}
  step = CompiledStep(make_train_step(model, opt, sched), shardings, bs, scope, metrics_sharding=replicated(MESH))
  finite, kinds = [], []
  for b in batches:
    with precision_scope("bf16", "flax"):
      state, m = step(state, {k: jax.device_put(v, bs[k]) for k, v in b.items()})
    finite.append(bool(m["finite"]))
    kinds.append(_kinds(state.opt_state))
  return jax.tree.map(np.asarray, state), finite, kinds


@pytest.mark.parametrize("moments", [("float32", "float32", "stochastic"), ("bfloat16", "bfloat16", "stochastic"),
                                     ("bfloat16", "float32", "nearest")], ids=["fp32", "bf16-sr", "bf16mu-nearest"])
def test_offloaded_steps_match_the_device_run(moments, monkeypatch):
  """Three jitted train steps (the second's loss poisoned: skipped) with the optimizer state in host memory,
  against the same steps with it on the device. Parameters, moments and counters are bit-identical: the
  streamed update rounds each parameter's moments with the same bits (stochastic rounding) as the whole-tree
  one."""
  batches = _batches(3)
  poison = int(batches[1]["targets"].sum())
  original = step_lib.token_losses

  def poisoned(logits, targets, mask):
    loss, n = original(logits, targets, mask)
    return loss + jnp.where(jnp.sum(targets) == poison, jnp.nan, 0.0), n
  monkeypatch.setattr(step_lib, "token_losses", poisoned)
  ref, ref_finite, ref_kinds = _run("none", moments, batches)
  got, finite, kinds = _run("host", moments, batches)
  assert ref_finite == finite == [True, False, True]
  assert ref_kinds == [{"device"}] * 3 and kinds == [{"pinned_host"}] * 3
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)
  (adam,) = [s for s in jax.tree_util.tree_leaves(got.opt_state, is_leaf=is_adam) if is_adam(s)]
  for tree, dtype in ((adam.mu, moments[0]), (adam.nu, moments[1])):
    assert {x.dtype for x in jax.tree_util.tree_leaves(tree)} == {jnp.dtype(dtype)}
  flat = jax.tree_util.tree_flatten_with_path(ref)[0]
  for (path, a), b in zip(flat, jax.tree_util.tree_leaves(got), strict=True):
    assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)
