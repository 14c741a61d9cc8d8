"""The mixture of experts in the decoder and the train step: the `model.moe` keys and their refusals, the parameter
tree (both backends, scanned and unrolled, every N-th block), parameter and FLOP counts by hand, the auxiliary
losses in the differentiated loss with their coefficients (against the objective written out here), the
metrics, and a CPU training run of configs/tiny_moe.yml."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from maxlm.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, load_config
from maxlm.layers import moe, precision_scope
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer, count_params, flops_per_step
from maxlm.step import loss_and_grad, make_train_step
from maxlm.train_state import create_train_state

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]
MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=24,
                  dtype="float32", remat="none", backend="flax",
                  moe=MoEConfig(experts=4, top_k=2, aux_loss_coef=0.3, z_loss_coef=0.05))
U32 = 2.0 ** -24
MESH = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])


def toks(b=2, t=8, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, MOE.vocab_size, (b, t)), jnp.int32)


def shapes(cfg):
  with precision_scope("bf16", cfg.backend):
    return jax.tree.map(lambda a: a.shape, nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0),
                                                                   toks()))["params"])


@pytest.mark.parametrize("args,words", [
    (["model.moe.experts=2", "model.moe.top_k=3"], "'model.moe.top_k' (3) must be at most model.moe.experts (2)"),
    (["model.moe.experts=-1"], "'model.moe.experts' must be in [0, 2**31-1]"),
    (["model.moe.experts=4", "model.moe.top_k=0"], "'model.moe.top_k' must be in [1, 2**31-1]"),
    (["model.moe.experts=4", "model.moe.every=2"], "'model.moe.every' (2) > 1 needs model.scan_layers=false"),
    (["model.moe.experts=4", "model.moe.every=3", "model.scan_layers=false"], "'model.moe.every' (3) must be at most"),
    (["model.moe.capacity_factor=-0.5"], "'model.moe.capacity_factor' must be in [0, inf)"),
    (["model.moe.aux_loss_coef=-1"], "'model.moe.aux_loss_coef' must be in [0, inf)"),
    (["model.moe.kernel=megablox"], "'model.moe.kernel' must be one of grouped, dense"),
    (["model.moe.experts=4", "mesh.pipeline=2"], "'model.moe.experts' > 0 does not run with pipeline stages"),
])
def test_bad_moe_keys_are_named(args, words):
  with pytest.raises(ConfigError) as e:
    load_config(args)
  assert words in str(e.value) and "\n" not in str(e.value)


def test_a_bad_moe_key_stops_the_cli_with_one_line_and_exit_2(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp_path}", "model.moe.experts=2",
                      "model.moe.top_k=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "maxlm: error: config key 'model.moe.top_k' (3) must be at most model.moe.experts (2)"], r.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_parameter_tree_on_both_backends_counted_by_hand(backend):
  cfg = dataclasses.replace(MOE, backend=backend)
  tree = shapes(cfg)
  e, d, f = 4, 32, 24
  assert tree["layers"]["moe"] == {"router": (2, d, e), "w1": (2, e, d, f), "w3": (2, e, d, f), "w2": (2, e, f, d)}
  assert tree["layers"]["moe_norm"] == {"scale": (2, d)} and "mlp" not in tree["layers"]
  assert tree == shapes(dataclasses.replace(MOE, backend="flax"))
  n = sum(int(np.prod(s)) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))
  assert n == count_params(cfg)["total"]


def test_every_nth_block_unrolled():
  cfg = dataclasses.replace(MOE, n_layers=4, scan_layers=False, moe=dataclasses.replace(MOE.moe, every=2))
  tree = shapes(cfg)
  assert [("moe" in tree[f"layers_{i}"], "mlp" in tree[f"layers_{i}"]) for i in range(4)] == [
      (False, True), (True, False), (False, True), (True, False)]  # blocks 1 and 3 (HF's and MaxText's choice)
  n = sum(int(np.prod(s)) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))
  assert n == count_params(cfg)["total"]


def test_active_parameters_and_flops_by_hand():
  """MFU's convention (docs/models.md): the GEMM weights a token passes through, the router and k of E
  experts of an MoE block; FLOPs 6 x those x tokens + attention (as for the dense model)."""
  cfg = dataclasses.replace(MOE, n_layers=4, scan_layers=False, moe=dataclasses.replace(MOE.moe, every=2))
  d, f, e, k, v = 32, 24, 4, 2, 64
  attn = d * (4 + 2 * 2) * 8 + 4 * 8 * d  # q, k, v and the output projection
  active = 4 * attn + 2 * 3 * d * f + 2 * (d * e + k * 3 * d * f) + d * v  # 2 dense, 2 MoE blocks, the head
  c = count_params(cfg)
  assert c["active"] == active and c["matmul"] == active + 2 * (e - k) * 3 * d * f
  dense = dataclasses.replace(cfg, moe=MoEConfig())
  attention = flops_per_step(dense, 2, 16) - 6 * count_params(dense)["matmul"] * 2 * 16
  assert flops_per_step(cfg, 2, 16) == pytest.approx(6 * active * 2 * 16 + attention, rel=1e-12)


def test_scanned_and_unrolled_give_the_same_logits_and_statistics():
  model = Transformer(MOE)
  params = nn.unbox(model.init(jax.random.PRNGKey(1), toks()))["params"]
  unrolled = Transformer(dataclasses.replace(MOE, scan_layers=False))
  per_layer = {k: v for k, v in params.items() if k != "layers"}
  for i in range(2):
    per_layer[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
  a, sa = model.apply({"params": params}, toks(), mutable=[moe.COLLECTION])
  b, sb = unrolled.apply({"params": per_layer}, toks(), mutable=[moe.COLLECTION])
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # the same float32 operations, in another program
  for key, x in moe.sown_stats(sa[moe.COLLECTION]).items():
    np.testing.assert_allclose(x, moe.sown_stats(sb[moe.COLLECTION])[key], rtol=1e-6, err_msg=key)
  assert moe.sown_stats(sa[moe.COLLECTION])["tokens_per_expert"].sum(-1).tolist() == [2 * 8 * 2] * 2


def _objective(model, params, batch):
  """The training objective written out: mean NLL over the valid tokens + aux coef x the load-balancing loss
  + z coef x the z-loss, each the mean over the MoE layers (docs/models.md); times the valid tokens."""
  logits, sown = model.apply({"params": params}, batch["inputs"], mutable=[moe.COLLECTION])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  mask = (batch["segment_ids"] > 0).astype(jnp.float32)
  n = mask.sum()
  stats = moe.sown_stats(sown[moe.COLLECTION])
  aux, z = jnp.mean(stats["load_balancing"]), jnp.mean(stats["z_loss"])
  mean = (nll * mask).sum() / n + model.cfg.moe.aux_loss_coef * aux + model.cfg.moe.z_loss_coef * z
  return mean * n, ((nll * mask).sum() / n, aux, z, stats["tokens_per_expert"])


def _batch(b=4, t=8, seed=3):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, MOE.vocab_size, (b, t + 1)).astype(np.int32)
  seg = np.ones((b, t), np.int32)
  seg[0, 5:] = 0  # unequal valid tokens per row
  return {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": seg,
          "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))}


def test_the_gradient_includes_the_weighted_auxiliary_losses():
  model = Transformer(MOE)
  params = nn.unbox(model.init(jax.random.PRNGKey(2), toks()))["params"]
  bt = _batch()
  (g, _), (loss, n, sums) = jax.jit(loss_and_grad(model, packed=False))(params, {}, bt, None, params)
  want, (nll, aux, z, _) = jax.grad(_objective, argnums=1, has_aux=True)(model, params, bt)
  # the same float32 operations in another order: a few ulps of each leaf's largest gradient
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=64 * U32 * np.abs(b).max()), g, want)
  assert float(loss) / float(n) == pytest.approx(float(nll), rel=1e-6)  # the reported loss: the NLL alone
  assert float(sums["load_balancing"]) / float(n) == pytest.approx(float(aux), rel=1e-6)
  assert float(sums["z_loss"]) / float(n) == pytest.approx(float(z), rel=1e-6)
  plain = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, aux_loss_coef=0.0, z_loss_coef=0.0))
  (g0, _), _ = jax.jit(loss_and_grad(Transformer(plain), packed=False))(params, {}, bt, None, params)
  router = ("layers", "moe", "router")
  assert not np.allclose(g0["layers"]["moe"]["router"], g["layers"]["moe"]["router"], atol=1e-3), router


def test_the_train_step_reports_the_losses_and_the_load_over_micro_batches():
  """grad_accum=2: the losses token-weighted over the micro-batches, the tokens per expert summed."""
  model = Transformer(MOE)
  opt = optax.sgd(0.0)
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    state, _ = create_train_state(model, opt, MESH, 0, 2, 8)
    _, metrics = jax.jit(make_train_step(model, opt, optax.constant_schedule(0.0), grad_accum=2))(state, _batch())
  params, bt = state.params, _batch()
  halves = [{k: v[2 * i:2 * i + 2] for k, v in bt.items()} for i in range(2)]
  outs = [_objective(model, params, h)[1] for h in halves]
  counts = [float((h["segment_ids"] > 0).sum()) for h in halves]
  weighted = [sum(c * float(o[j]) for c, o in zip(counts, outs)) / sum(counts) for j in (0, 1, 2)]
  assert float(metrics["loss"]) == pytest.approx(weighted[0], rel=1e-6)
  assert float(metrics["moe_aux_loss"]) == pytest.approx(weighted[1], rel=1e-6)
  assert float(metrics["moe_z_loss"]) == pytest.approx(weighted[2], rel=1e-6)
  tpe = np.asarray(outs[0][3] + outs[1][3])  # [layers, E]
  for i in range(2):
    assert float(metrics[f"moe_tokens_min/layer_{i}"]) == tpe[i].min()
    assert float(metrics[f"moe_tokens_max/layer_{i}"]) == tpe[i].max()
  assert "moe_dropped" not in metrics  # dropless


def test_capacity_mode_reports_its_drop_rate():
  cfg = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, capacity_factor=1.0))  # drops what overflows
  model = Transformer(cfg)
  opt = optax.sgd(0.0)
  with jax.set_mesh(MESH), precision_scope("bf16", "flax"):
    state, _ = create_train_state(model, opt, MESH, 0, 4, 8)
    router = jax.random.normal(jax.random.PRNGKey(9), state.params["layers"]["moe"]["router"].shape)  # O(1) logits:
    params = {**state.params, "layers": {**state.params["layers"],  # routing imbalanced, differently per layer
                                         "moe": {**state.params["layers"]["moe"], "router": router}}}
    state = state.replace(params=params)
    _, metrics = jax.jit(make_train_step(model, opt, optax.constant_schedule(0.0)))(state, _batch())
  _, sown = model.apply({"params": state.params}, _batch()["inputs"], mutable=[moe.COLLECTION])
  dropped = np.asarray(moe.sown_stats(sown[moe.COLLECTION])["dropped"])  # [layers]
  assert dropped.min() > 0 and dropped[0] != dropped[1]  # something dropped, unequally: the mean is its own number
  assert float(metrics["moe_dropped"]) == pytest.approx(dropped.mean(), rel=1e-6)
  for i in range(2):
    assert float(metrics[f"moe_dropped/layer_{i}"]) == pytest.approx(dropped[i], rel=1e-6)


def test_tiny_moe_config_trains_from_the_command_line(tmp_path):
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0",
         "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-m", "maxlm.train", "config=tiny_moe.yml", f"output_dir={tmp_path}",
                      "run_name=m", "train.steps=3", "train.log_every=1", "train.eval_every=0", "model.backend=flax",
                      "checkpoint.enabled=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [1, 2, 3]
  for row in rows:
    assert np.isfinite(row["loss"]) and np.isfinite(row["moe_aux_loss"]) and row["moe_aux_loss"] > 0
    assert all(row[f"moe_tokens_min/layer_{i}"] <= row[f"moe_tokens_max/layer_{i}"] for i in range(4))
  assert "tiny-moe" in r.stdout and "moe aux" in r.stdout
