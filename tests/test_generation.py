"""KV-cache generation (maxlm/generation.py, maxlm/layers/kv_cache.py) against recomputing the whole
sequence with the training model, hand-written sampling references, and Hugging Face's greedy tokens."""

import dataclasses
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from maxlm import generation as G
from maxlm.config import ModelConfig
from maxlm.layers import precision_scope
from maxlm.model import Transformer

GOLDEN_HF = Path(__file__).resolve().parent / "golden" / "hf"
# fp32 compute so the cached and the full computation differ by rounding only; init_std large enough
# that logits are far from uniform (greedy has no near-ties).
TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                   dtype="float32", backend="flax", remat="none", init_std=0.2)
PROMPTS = [[1, 5, 9, 3, 7, 2, 11, 4, 8, 6], [3, 4], [7, 7, 7, 7, 1]]
U32 = 2.0 ** -24  # fp32 unit roundoff


def _init(cfg):
  with precision_scope("bf16", cfg.backend):
    return nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]


_FORWARDS = {}


def _full_logits(cfg, params, seq, width=32):
  """The training model's logits [T, V] over the whole sequence (no cache), padded to one width so
  every call compiles once (causal attention keeps the padding after a token out of its logits)."""
  if cfg not in _FORWARDS:
    model = Transformer(cfg)
    _FORWARDS[cfg] = jax.jit(lambda p, t: model.apply({"params": p}, t))
  padded = np.zeros((1, width), np.int32)  # [1, W]
  padded[0, :len(seq)] = seq
  with precision_scope("bf16", cfg.backend):
    return np.asarray(_FORWARDS[cfg](params, padded))[0, :len(seq)]  # [T, V]


def _tolerance(cfg, max_logit, keys):
  """Bound on |cached - full| logits in fp32: both are the same math with different reduction orders.

  A dot product of length K carries at most gamma_K = K*u/(1-K*u) relative error (Higham, Thm 3.1);
  a logit passes through 8 sequential reductions per layer (2 norms, qkv, scores, weights x values,
  out, MLP in, MLP out) plus the final norm and the head, each of length <= K = max(d_model, ffn_dim,
  attended keys). Both paths err, hence 2x, scaled by the largest logit (O(1) Lipschitz blocks at this
  init). A wrong position or mask changes logits by O(1), far above this. On a GPU, float32 matmuls
  round their inputs to TF32 (u = 2^-11; XLA's default precision, TE's GEMMs): each product then carries
  up to 2 * 2^-11 more relative error (seen there: 3e-3 to 8e-3 against fp32-only bounds near 5e-4).
  """
  k = max(cfg.d_model, cfg.ffn_dim, keys)
  tf32_inputs = 2 * 2.0 ** -11 if jax.default_backend() == "gpu" else 0.0
  gamma = k * U32 / (1 - k * U32) + tf32_inputs
  return 2 * (8 * cfg.n_layers + 2) * gamma * max_logit


@pytest.fixture(scope="module")
def params():
  return _init(TINY)


@pytest.mark.parametrize("window,scan", [(0, True), (3, False)])
def test_cached_logits_match_full_recompute(params, window, scan):
  """Every decoded token's logits equal the training model's over the whole sequence; the window
  (3) is shorter than the first prompt (10) and than prompt + new tokens, so the rolling cache wraps."""
  cfg = dataclasses.replace(TINY, sliding_window=window, scan_layers=scan)
  params = params if scan else _init(cfg)  # unrolled layers have their own parameter tree
  out = G.generate(cfg, params, PROMPTS, 12, return_logits=True)
  for i, p in enumerate(PROMPTS):
    gen = out.tokens[i]
    assert len(gen) == 12 and out.finish_reasons[i] == "length"
    full = _full_logits(cfg, params, p + gen)[len(p) - 1:len(p) + len(gen) - 1]  # [N, V]
    got = out.logits[i, :len(gen)]
    tol = _tolerance(cfg, np.abs(full).max(), G.bucket(len(p)) + G.bucket(12))
    np.testing.assert_allclose(got, full, rtol=0, atol=tol)
    assert gen == np.argmax(full, axis=-1).tolist()  # greedy picks the argmax of the true logits


def test_rolling_cache_holds_only_the_window(params):
  """With a window, the cache has `window` slots; without one, prompt bucket + new-token bucket."""
  from maxlm.layers.kv_cache import update_positions
  pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 7]], jnp.int32)  # [1, 8]
  valid = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 0]], bool)  # 6 valid tokens
  got = np.asarray(update_positions(jnp.full((1, 4), -1, jnp.int32), pos, valid))
  assert got.tolist() == [[4, 5, 2, 3]]  # slot p % 4 holds the newest of positions 0..5
  got = np.asarray(update_positions(jnp.asarray(got), jnp.asarray([[6]]), jnp.asarray([[True]])))
  assert got.tolist() == [[4, 5, 6, 3]]


def test_compiled_once_per_bucket(params):
  """Other prompt lengths and max_new_tokens inside the same buckets (batch 1, prompt <= 16, new <= 16)
  reuse both programs; every token of a call is decoded by the one while_loop (no trace per token)."""
  G.generate(TINY, params, [[1, 2, 3]], 5, return_logits=True)
  before = G.trace_counts()
  assert before["prefill"] >= 1 and before["decode"] >= 1  # the counter sees traces
  a = G.generate(TINY, params, [[4, 5, 6, 7, 8, 9, 10]], 16, return_logits=True)
  b = G.generate(TINY, params, [[2]], 3, return_logits=True)
  assert G.trace_counts() == before
  assert len(a.tokens[0]) == 16 and len(b.tokens[0]) == 3
  assert [G.bucket(n) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]


def test_batch_of_unequal_prompts_equals_each_alone(params):
  # Sampled: row r draws from fold_in(seed, r), so the first prompt alone (row 0) repeats row 0.
  batch = G.generate(TINY, params, PROMPTS, 8, return_logits=True, temperature=0.8, seed=3)
  alone = G.generate(TINY, params, PROMPTS[:1], 8, return_logits=True, temperature=0.8, seed=3)
  assert alone.tokens[0] == batch.tokens[0]
  greedy_b = G.generate(TINY, params, PROMPTS, 8, return_logits=True)
  for i, p in enumerate(PROMPTS):
    greedy_a = G.generate(TINY, params, [p], 8, return_logits=True)
    assert greedy_a.tokens[0] == greedy_b.tokens[i]
    tol = _tolerance(TINY, np.abs(greedy_a.logits).max(), 16 + 16)
    np.testing.assert_allclose(greedy_a.logits[0], greedy_b.logits[i], rtol=0, atol=tol)


def test_seeds_reproduce_and_top_k_1_is_greedy(params):
  kw = dict(return_logits=True, temperature=1.0)
  a = G.generate(TINY, params, PROMPTS, 12, seed=7, **kw)
  b = G.generate(TINY, params, PROMPTS, 12, seed=7, **kw)
  c = G.generate(TINY, params, PROMPTS, 12, seed=8, **kw)
  assert a.tokens == b.tokens
  assert a.tokens != c.tokens  # 36 draws at temperature 1 from ~64 tokens: equal only by a ~0 chance
  greedy = G.generate(TINY, params, PROMPTS, 12, return_logits=True)
  top1 = G.generate(TINY, params, PROMPTS, 12, seed=7, top_k=1, **kw)
  assert top1.tokens == greedy.tokens


def test_stop_tokens_and_sequences_per_row(params):
  free = G.generate(TINY, params, PROMPTS, 12, return_logits=True)
  row0 = free.tokens[0]
  stop = row0[4]
  first = row0.index(stop)
  out = G.generate(TINY, params, PROMPTS, 12, return_logits=True, stop_tokens=[stop])
  assert out.tokens[0] == row0[:first + 1] and out.finish_reasons[0] == "stop"
  for i in (1, 2):  # the other rows run on as before unless they emit the stop token themselves
    want = free.tokens[i][:free.tokens[i].index(stop) + 1] if stop in free.tokens[i] else free.tokens[i]
    assert out.tokens[i] == want
  seq = row0[6:8]  # a two-token stop sequence ends row 0 right after it first appears
  end = next(j for j in range(1, 12) if row0[j - 1:j + 1] == seq) + 1
  out = G.generate(TINY, params, PROMPTS[:1], 12, return_logits=True, stop_sequences=[seq])
  assert out.tokens[0] == row0[:end] and out.finish_reasons[0] == "stop"


def _ref_top_k(logits, k):
  """Hand reference: keep entries >= the k-th largest value of the row."""
  out = []
  for row in logits:
    kth = sorted(row, reverse=True)[k - 1]
    out.append([x if x >= kth else -math.inf for x in row])
  return np.array(out)


def _ref_top_p(logits, p):
  """Hand reference: walk tokens from most to least likely, keep them until the kept mass reaches p."""
  out = []
  for row in logits:
    probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    keep, mass = set(), 0.0
    for j in sorted(range(len(row)), key=lambda j: -row[j]):
      keep.add(j)
      mass += probs[j]
      if mass >= p:
        break
    out.append([x if j in keep else -math.inf for j, x in enumerate(row)])
  return np.array(out)


def test_top_k_and_top_p_filters_against_hand_references():
  # probabilities 0.5, 0.25, 0.15, 0.1 (shuffled): cumulative 0.5, 0.75, 0.90, 1.0
  probs = np.array([[0.15, 0.5, 0.1, 0.25], [0.25, 0.1, 0.5, 0.15]])
  logits = np.log(probs).astype(np.float32)
  for k in (1, 2, 3, 4):
    np.testing.assert_array_equal(np.asarray(G.top_k_filter(jnp.asarray(logits), k)), _ref_top_k(logits, k))
  np.testing.assert_array_equal(np.asarray(G.top_k_filter(jnp.asarray(logits), 0)), logits)
  for p in (0.3, 0.6, 0.8, 0.95, 1.0):  # away from the cumulative sums, so rounding cannot flip a token
    np.testing.assert_array_equal(np.asarray(G.top_p_filter(jnp.asarray(logits), p)), _ref_top_p(logits, p))


def test_top_p_restricts_the_support_of_samples():
  probs = np.array([0.4, 0.05, 0.3, 0.05, 0.15, 0.05])
  logits = jnp.asarray(np.log(probs)[None].repeat(512, 0), jnp.float32)  # [512, 6]
  keys = jax.random.split(jax.random.key(0), 512)
  draw = jax.jit(lambda lg, k, p: G.sample(lg, k, jnp.float32(1.0), jnp.int32(0), p))
  got = set(np.asarray(draw(logits, keys, jnp.float32(0.8))).tolist())
  assert got == {0, 2, 4}  # 0.4 + 0.3 + 0.15 = 0.85 >= 0.8; each kept token has >= 0.15/0.85 per draw
  got = set(np.asarray(draw(logits, keys, jnp.float32(1.0))).tolist())
  assert got == set(range(6))  # no filter: all six appear in 512 draws (P(miss one) < 6 * 0.95^512)


def test_bad_arguments_raise_one_line_errors(params):
  cases = [(dict(prompts=[[]]), "prompt 0 is empty"), (dict(prompts=[[64]]), "outside [0, 64)"),
           (dict(max_new_tokens=0), "max_new_tokens must be >= 1"), (dict(temperature=-1), "temperature"),
           (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
           (dict(max_length=12), "exceeds the model's max length 12")]
  for kw, msg in cases:
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=10) | kw
    with pytest.raises(G.GenerationError, match=re.escape(msg)):
      G.generate(TINY, params, args.pop("prompts"), args.pop("max_new_tokens"), **args)


@pytest.mark.te
@pytest.mark.slow  # ~16 s CPU: its own init and compilations; the cache attention is the flax path's
def test_te_backend_decodes_like_its_full_forward():
  cfg = dataclasses.replace(TINY, backend="te", sliding_window=4)
  p = _init(cfg)
  out = G.generate(cfg, p, PROMPTS, 6, return_logits=True)
  for i, prompt in enumerate(PROMPTS):
    full = _full_logits(cfg, p, prompt + out.tokens[i])[len(prompt) - 1:-1]
    tol = _tolerance(cfg, np.abs(full).max(), 16 + 16)
    np.testing.assert_allclose(out.logits[i], full, rtol=0, atol=tol)


def _hf_goldens():
  return sorted(p.parent.name for p in GOLDEN_HF.glob("*/golden.npz"))


@pytest.mark.slow  # ~8 s CPU each: an HF import and a compilation per golden
@pytest.mark.parametrize("name", ["llama3", "llama_tied"])
def test_greedy_tokens_equal_hugging_face(name):
  """transformers' greedy `generate` of each prompt alone (tests/golden/hf, made by
  tests/golden/make_hf_goldens.py: Llama 3 with llama3 RoPE scaling, a tied-embedding Llama) equals ours
  with all three prompts of unequal length in one batch (fp32). The Mistral golden (window 8 < prompt +
  new tokens: the rolling cache wraps) runs the same comparison in tests/test_hf.py."""
  from maxlm.api import Model
  g = np.load(GOLDEN_HF / name / "golden.npz")
  prompts = [[int(t) for t in row if t >= 0] for row in g["prompts"]]
  model = Model.from_pretrained(GOLDEN_HF / name, backend="flax", dtype="float32")
  out = G.generate(model.config.model, model.params, prompts, int(g["max_new_tokens"]), mesh=model.mesh)
  assert out.tokens == g["generated"].tolist()


def test_hf_goldens_are_present():
  assert _hf_goldens() == ["llama3", "llama_tied", "mistral"]


@pytest.mark.gpu
@pytest.mark.te
def test_gpu_te_bf16_decode_matches_fused_full_forward():
  """On the GPU: the TE model's full forward (cuDNN fused attention) against its KV-cache decode (XLA
  attention over the cache) in bf16, with a window shorter than the sequence. Tolerance: bf16's unit
  roundoff is 2^-8 = 3.9e-3; two independently rounded bf16 computations of the same logits differ by a
  few units in relative (Frobenius) norm, as tests/test_gpu.py's fused-vs-flax check: < 1e-2."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  cfg = ModelConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64,
                    ffn_dim=512, dtype="bfloat16", backend="te", remat="none", sliding_window=24)
  params = _init(cfg)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 1024, size=n).tolist() for n in (40, 7, 29)]
  out = G.generate(cfg, params, prompts, 20, return_logits=True)
  before = G.trace_counts()
  # same buckets (batch 3 -> 4, longest prompt 35 -> 64, 17 new -> 32): nothing is traced again
  G.generate(cfg, params, [p[:35] for p in prompts], 17, return_logits=True)
  assert G.trace_counts() == before
  for i, p in enumerate(prompts):
    seq = p + out.tokens[i]
    full = _full_logits(cfg, params, seq, width=64)[len(p) - 1:len(seq) - 1].astype(np.float32)
    got = out.logits[i, :len(out.tokens[i])]
    assert np.linalg.norm(got - full) / np.linalg.norm(full) < 1e-2, i


def ref_causal_attention(q, k, v, window):
  """float64 causal GQA attention over the whole sequence: [B, T, H, Dh] from q [B, T, H, Dh], k/v [B, T, KV, Dh]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  t, rep = q.shape[1], q.shape[2] // k.shape[2]
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  qi, ki = np.arange(t)[:, None], np.arange(t)[None]
  keep = (ki <= qi) & ((qi - ki < window) if window else True)  # [T, T]
  logits = np.where(keep, np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]), -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


# float32 against float64: logits within (Dh + 2) ulps of sum |q k| / sqrt(Dh) (<= 8 here: |q|, |k| of 8
# normal entries), each probability within 2x that relative, the output within that times max |v| (< 5),
# plus T ulps for the weighted sum: (2 * 10 * 8 + 2 * 9 + 8) * 5 * 2**-24 < 1e-4. bfloat16 (inputs rounded
# to bfloat16 first, the reference computed from those): the logits, probabilities and output each rounded
# to 8 bits (2**-9 relative): a logit of <= 8 off by 8 * 2**-9, a probability by twice that relative plus
# 2**-9, the output by that times max |v| (< 5) plus its own rounding: (32 * 2**-9 + 2**-9) * 5 + 5 * 2**-9 < 0.4
# (loose: seen 8e-3; the float32 cases check the values tightly, this one a bfloat16 cache and decode).
CHUNK_ATOL = {jnp.float32: 1e-4, jnp.bfloat16: 0.4}


@pytest.mark.parametrize("window,slots,dtype", [(0, 12, jnp.float32), (3, 3, jnp.float32), (3, 3, jnp.bfloat16)])
def test_attention_with_cache_over_uneven_chunks_equals_full_attention(window, slots, dtype):
  """kv_cache.attention_with_cache fed the sequence in chunks of 3, 2, 1, 2, 1 tokens (a prefill, then
  multi-token and one-token steps), its cache of `slots` rows (a rolling cache of the window's size, or
  room for everything): each chunk's output equals full causal attention. In the chunk of positions 6-7,
  row 1's second token is padding with garbage keys: they never enter the cache, and row 1's next step
  is position 7 again, with its real key (row 0 moves on to 8)."""
  from maxlm.layers.kv_cache import attention_with_cache, update_positions
  rng = np.random.default_rng(0)
  b, t, h, kv, dh = 2, 9, 4, 2, 8
  q = np.asarray(jnp.asarray(rng.standard_normal((b, t, h, dh)), dtype))  # exactly representable in dtype
  k, v = (np.asarray(jnp.asarray(rng.standard_normal((b, t, kv, dh)), dtype)) for _ in range(2))
  cache_k, cache_v = jnp.zeros((b, slots, kv, dh), dtype), jnp.zeros((b, slots, kv, dh), dtype)  # [B, S, KV, Dh]
  cache_pos = jnp.full((b, slots), -1, jnp.int32)  # [B, S]: no position yet
  ref = ref_causal_attention(q, k, v, window)  # [B, T, H, Dh]
  step = jax.jit(attention_with_cache, static_argnames="window")
  starts = np.zeros(b, np.int64)
  for n in (3, 2, 1, 2, 1):
    pos = (starts[:, None] + np.arange(n)).astype(np.int32)  # [B, n]
    valid = np.ones((b, n), bool)
    pick = lambda a: np.stack([a[r, pos[r]] for r in range(b)])
    qc, kc, vc = pick(q), pick(k), pick(v)
    if n == 2 and starts[1] == 6:
      valid[1, 1], kc[1, 1], vc[1, 1] = False, 1e3, 1e3
    ctx, cache_k, cache_v = step(qc, kc, vc, cache_k, cache_v, cache_pos, pos, valid, window=window)
    cache_pos = update_positions(cache_pos, pos, valid)
    if not valid.all():  # the pad token left no trace in the cache
      assert 7 not in np.asarray(cache_pos[1]) and np.abs(np.asarray(cache_k[1])).max() < 1e3
    mask = valid[:, :, None, None]
    assert ctx.dtype == cache_k.dtype == cache_v.dtype == dtype  # the cache keeps its dtype (and size)
    np.testing.assert_allclose(np.where(mask, np.asarray(ctx, np.float64), 0), np.where(mask, pick(ref), 0),
                               rtol=0, atol=CHUNK_ATOL[dtype])  # see CHUNK_ATOL
    starts += valid.sum(1)
  assert list(starts) == [9, 8]
