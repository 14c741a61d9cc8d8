"""Decoder-level properties: parameter tree, scan vs loop, causality, packing, remat, FLOP counting."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from maxlm.config import ModelConfig
from maxlm.layers import precision_scope
from maxlm.model import Transformer, count_params, flops_per_step

BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   dtype="float32", remat="none")


def cfg_for(backend, **kw):
  return dataclasses.replace(TINY, backend=backend, **kw)


def init_apply(cfg, tokens, params=None, positions=None, segment_ids=None, max_segments=4):
  model = Transformer(cfg, max_segments=max_segments)
  with precision_scope("bf16", cfg.backend):
    if params is None:
      params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), tokens))
    return jax.jit(model.apply)(params, tokens, positions, segment_ids), params


def tokens(b=2, t=12, seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, TINY.vocab_size)


@pytest.mark.parametrize("tie", [False, True])
def test_param_count_matches_tree(tie):
  cfg = cfg_for("flax", tie_embeddings=tie)
  params = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), tokens())
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  assert n == count_params(cfg)["total"]


def test_llama8b_flops_convention():
  from maxlm.config import load_config
  m = load_config(["config=llama8b.yml", "model.n_layers=4"]).model
  # MaxText convention: 6 * N(matmul incl. LM head) * tokens + causal attention 6*B*S^2*(H*Dh)*L.
  n = 4 * (4096 * (32 + 16) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336) + 4096 * 128256
  expect = 6 * n * 4 * 4096 + 6 * 4 * 4096 ** 2 * 4096 * 4
  assert flops_per_step(m, 4, 4096) == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_te_and_flax_share_one_parameter_tree(backend):
  _, p_flax = init_apply(cfg_for("flax"), tokens())
  logits, p = init_apply(cfg_for(backend), tokens(), params=None)
  assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(p_flax)
  assert jax.tree_util.tree_map(jnp.shape, p) == jax.tree_util.tree_map(jnp.shape, p_flax)
  assert logits.shape == (2, 12, TINY.vocab_size)


@pytest.mark.te
def test_te_model_equals_flax_model_on_flax_params():
  x = tokens()
  ref, params = init_apply(cfg_for("flax"), x)
  out, _ = init_apply(cfg_for("te"), x, params=params)
  np.testing.assert_allclose(out, ref, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_equals_unrolled_layers(backend):
  x = tokens()
  scanned, params = init_apply(cfg_for(backend, scan_layers=True), x)
  layers = params["params"]["layers"]
  unrolled = {k: v for k, v in params["params"].items() if k != "layers"}
  for i in range(TINY.n_layers):
    unrolled[f"layers_{i}"] = jax.tree_util.tree_map(lambda a: a[i], layers)
  out, _ = init_apply(cfg_for(backend, scan_layers=False), x, params={"params": unrolled})
  np.testing.assert_allclose(out, scanned, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [0, 4])
def test_causality(backend, window):
  cfg = cfg_for(backend, sliding_window=window)
  x = tokens(t=10)
  base, params = init_apply(cfg, x)
  t = 6
  changed = x.at[:, t + 1].set((x[:, t + 1] + 7) % TINY.vocab_size)
  out, _ = init_apply(cfg, changed, params=params)
  np.testing.assert_array_equal(np.asarray(out[:, : t + 1]), np.asarray(base[:, : t + 1]))
  assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_row_equals_documents_run_alone(backend):
  cfg = cfg_for(backend)
  docs = [tokens(1, 5, 1), tokens(1, 4, 2), tokens(1, 2, 3)]
  row = jnp.concatenate(docs + [jnp.zeros((1, 1), jnp.int32)], axis=1)  # [1, 12] incl. one pad
  seg = jnp.array([[1] * 5 + [2] * 4 + [3] * 2 + [0]])
  pos = jnp.array([list(range(5)) + list(range(4)) + list(range(2)) + [0]])
  packed, params = init_apply(cfg, row, positions=pos, segment_ids=seg)
  start = 0
  for d in docs:
    alone, _ = init_apply(cfg, d, params=params)
    n = d.shape[1]
    np.testing.assert_allclose(packed[:, start:start + n], alone, atol=2e-5)
    start += n


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_policies_give_the_same_gradients(backend):
  x = tokens()
  _, params = init_apply(cfg_for(backend), x)

  def grads(remat):
    model = Transformer(cfg_for(backend, remat=remat))
    def loss(p):
      return jnp.mean(model.apply(p, x) ** 2)
    with precision_scope("bf16", backend):
      return jax.jit(jax.grad(loss))(params)

  ref = grads("none")
  for policy in ("full", "save_dots", "save_attn", "save_qkv_attn"):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads(policy), ref)
