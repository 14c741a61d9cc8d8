"""The decoder against an independent float64 reference (tests/reference.py) on both backends;
parameter tree, causality, packing, remat; FLOP and parameter counts against hand counts."""

import collections
import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import reference as R
from maxlm.config import MeshConfig, ModelConfig, load_config
from maxlm.layers import precision_scope
from maxlm.parallel import context
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer, count_params, flops_per_step
from maxlm.parallel.sharding import TE_MESH_AXES, axis_rules

BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   dtype="float32", remat="none")
U32 = 2.0 ** -24  # float32 unit roundoff


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


# ---- against the reference -------------------------------------------------------------------------

T = 12
# Llama-3.1 scaling with an original context of 64 at Dh=16, theta=5e5: wavelengths 6.3 (kept),
# 33 (interpolated), 170 and up (divided by the factor), so positions up to ~30 tell them apart.
LLAMA3 = dict(rope_scaling="llama3", rope_factor=4.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_position=64)
REF_CASES = {
    "gqa": dict(),  # 4 query heads on 2 KV heads, RoPE theta 5e5
    "gqa_unrolled": dict(scan_layers=False),
    "llama3_rope": LLAMA3,
    "tied": dict(tie_embeddings=True),
    "window": dict(sliding_window=3),  # shorter than the sequence
    "packed": dict(),  # 3 documents and padding in one row
}


def ref_inputs(case):
  """(tokens, positions, segment_ids) [2, T]; positions / segments None where the model defaults them."""
  toks = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, T)).astype(np.int32)
  if case == "llama3_rope":  # per-token positions, the second row far from 0
    return toks, np.stack([np.arange(T), np.arange(T) + 19]).astype(np.int32), None
  if case == "packed":
    seg = np.array([[1] * 5 + [2] * 4 + [3] * 2 + [0], [1] * 7 + [2] * 3 + [0] * 2], np.int32)
    pos = np.array([list(range(5)) + list(range(4)) + list(range(2)) + [0],
                    list(range(7)) + list(range(3)) + [0, 0]], np.int32)
    return toks, pos, seg
  return toks, None, None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(REF_CASES))
def test_transformer_matches_reference(backend, case):
  cfg = cfg_for(backend, rope_theta=5e5, **REF_CASES[case])
  toks, pos, seg = ref_inputs(case)
  model = Transformer(cfg, max_segments=4)
  with precision_scope("bf16", backend):
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), toks))["params"]
    params = R.random_params(shapes, seed=2, embed_std=0.5)  # O(1) activations, non-uniform attention
    logits = np.asarray(jax.jit(model.apply)({"params": params}, toks, pos, seg))  # [B, T, V]
  ref = R.forward(R.as_float64(params), cfg, toks, pos, seg)  # [B, T, V]
  valid = np.ones((2, T), bool) if seg is None else seg > 0  # padding positions compute nothing
  # float32: each block's contractions (length <= F=128) carry ~sqrt(128) = 11 ulps of their output
  # scale from rounding of random sign; ~3 per block add in quadrature (~20 ulps), over 2 blocks and
  # the LM head ~60 ulps; RoPE angles pos * f (pos < 31) lose < 31 ulps of a radian. 64 ulps of the
  # logit scale per block + head bounds that (seen: <= 8 ulps).
  tol = 64 * (cfg.n_layers + 1) * U32 * np.abs(ref).max()
  err = np.abs(logits - ref)[valid].max()
  assert err <= tol, f"max |logits - reference| = {err:.3g} > {tol:.3g}"


# ---- structural properties -------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_param_count_matches_tree(tie):
  cfg = cfg_for("flax", tie_embeddings=tie)
  params = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), tokens())
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  assert n == count_params(cfg)["total"]
  assert count_params(cfg)["embedding"] == cfg.vocab_size * cfg.d_model  # the [V, D] table


@pytest.mark.parametrize("backend", BACKENDS)
def test_te_and_flax_share_one_parameter_tree(backend):
  _, p_flax = init_apply(cfg_for("flax"), tokens())
  logits, p = init_apply(cfg_for(backend), tokens(), params=None)
  assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(p_flax)
  assert jax.tree_util.tree_map(jnp.shape, p) == jax.tree_util.tree_map(jnp.shape, p_flax)
  assert logits.shape == (2, 12, TINY.vocab_size)


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
    # The same float32 arithmetic over a longer (masked) row: only the summation order differs,
    # which the reference test bounds by 64 ulps of the logit scale per block + head.
    tol = 64 * (cfg.n_layers + 1) * U32 * float(np.abs(alone).max())
    np.testing.assert_allclose(packed[:, start:start + n], alone, rtol=0, atol=tol)
    start += n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp", [2, 4])
def test_packed_row_equals_documents_run_alone_with_the_sequence_split(backend, cp):
  """The packed-vs-alone parity with context parallelism: the packed row's sequence split over cp devices (in
  the load-balanced order, context.apply_balanced, restored after) against each document run alone, unsplit."""
  cfg = cfg_for(backend)
  docs = [tokens(1, 5, 1), tokens(1, 4, 2), tokens(1, 2, 3)]
  row = jnp.concatenate(docs + [jnp.zeros((1, 5), jnp.int32)], axis=1)  # [1, 16] incl. 5 pads
  seg = jnp.array([[1] * 5 + [2] * 4 + [3] * 2 + [0] * 5])
  pos = jnp.array([list(range(5)) + list(range(4)) + list(range(2)) + [0] * 5])
  _, params = init_apply(cfg, row, positions=pos, segment_ids=seg)
  model = Transformer(cfg, max_segments=4)
  mesh = make_mesh(MeshConfig(fsdp=1, context=cp), jax.devices()[:cp])
  with jax.set_mesh(mesh), axis_rules(), precision_scope("bf16", cfg.backend, mesh_axes=TE_MESH_AXES):
    assert context.axis() == ("context", cp)
    packed = jax.jit(lambda p, *a: context.apply_balanced(lambda *b: model.apply(p, *b), *a, strategy="auto",
                                                          window=0))(params, row, pos, seg)  # [1, 16, V]
  start = 0
  for d in docs:
    alone, _ = init_apply(cfg, d, params=params)
    n = d.shape[1]
    tol = 64 * (cfg.n_layers + 1) * U32 * float(np.abs(alone).max())  # as in the unsplit test above
    np.testing.assert_allclose(packed[:, start:start + n], alone, rtol=0, atol=tol)
    start += n


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_policies_give_the_same_gradients(backend):
  x = tokens()
  _, params = init_apply(cfg_for(backend), x)

  policies = ("none", "full", "save_dots", "save_dots_attn", "save_attn", "save_qkv_attn")
  policies += ("recompute_norm_act",) if backend == "te" else ()

  def grad_of(remat):
    model = Transformer(cfg_for(backend, remat=remat))
    return jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))

  with precision_scope("bf16", backend):  # every policy's gradient in one program: one compile, not six
    ref, *others = jax.jit(lambda p: [grad_of(r)(p) for r in policies])(params)
  for got in others:
    # Recomputation repeats the same float32 ops; only XLA's fusion (summation order) may differ:
    # 64 ulps of each leaf's largest gradient (the gradient bound of tests/test_step.py).
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=64 * U32 * float(np.abs(b).max())), got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_policies_keep_the_named_activations_they_promise(backend):
  # What each policy keeps for the backward, as JAX itself lists it (unrolled layers, so that the names
  # show per layer): save_attn keeps each layer's attention output, save_qkv_attn also its QKV projection,
  # full keeps no named activation. The TE backend once kept no attention output under either policy.
  x = tokens()
  cfg = cfg_for(backend, scan_layers=False)
  _, params = init_apply(cfg, x)

  def named(remat):
    model = Transformer(dataclasses.replace(cfg, remat=remat))
    buf = io.StringIO()
    with precision_scope("bf16", backend), contextlib.redirect_stdout(buf):
      jax.ad_checkpoint.print_saved_residuals(lambda p: jnp.mean(model.apply(p, x) ** 2), params)
    return collections.Counter(re.findall(r"named '(\w+)'", buf.getvalue()))

  layers = cfg.n_layers
  assert named("full") == {}
  assert named("save_attn") == {"context": layers}
  assert named("save_qkv_attn") == {"context": layers, "qkv_proj": layers}
  assert named("save_dots_attn")["context"] == layers


# ---- FLOPs and parameter counts --------------------------------------------------------------------

def hand_flops(m, batch, seq):
  """Training FLOPs counted matmul by matmul from the shapes: 2 FLOPs per multiply-add, x3 for the
  forward and backward passes; causal attention over the (query, key) pairs actually attended."""
  d, h, kv, dh, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim, m.vocab_size
  per_token = m.n_layers * (d * (h + 2 * kv) * dh  # fused QKV projection
                            + h * dh * d  # attention output projection
                            + d * f + d * f  # SwiGLU gate and up
                            + f * d)  # down
  per_token += d * v  # LM head (a GEMM also when tied to the embedding)
  w = m.sliding_window if m.sliding_window else seq
  pairs = sum(min(i + 1, w) for i in range(seq))  # keys seen by query i: itself and min(i, w-1) before
  attention = m.n_layers * h * (dh + dh) * pairs  # QK^T and PV, per head per pair
  return 3 * 2 * batch * (per_token * seq + attention)


@pytest.mark.parametrize("config,seq", [("llama8b.yml", 4096), ("mistral7b.yml", 8192),
                                        ("mistral7b.yml", 2048), ("llama3.2-1b.yml", 8192)])
def test_flops_per_step_counted_by_hand(config, seq):
  m = load_config([f"config={config}"]).model
  batch = 4
  hand = hand_flops(m, batch, seq)
  # MaxText's convention counts the attended pairs as the area under the mask (S^2 / 2, or
  # S W - W^2 / 2 with a window W < S): the integer count minus half the diagonal, min(S, W) / 2.
  w = min(m.sliding_window or seq, seq)
  convention = hand - 3 * 2 * batch * m.n_layers * m.n_heads * 2 * m.head_dim * (w / 2)
  assert flops_per_step(m, batch, seq) == pytest.approx(convention, rel=1e-12)


def test_param_counts_match_published_totals():
  # Llama 3 8B: 8,030,261,248; Mistral 7B v0.1: 7,241,732,096; Llama 3.2 1B (tied): 1,235,814,400.
  for config, total in (("llama8b.yml", 8_030_261_248), ("mistral7b.yml", 7_241_732_096),
                        ("llama3.2-1b.yml", 1_235_814_400)):
    assert count_params(load_config([f"config={config}"]).model)["total"] == total, config
