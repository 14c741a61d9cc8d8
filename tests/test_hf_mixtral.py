"""Hugging Face Mixtral (maxlm.hf): a tiny random MixtralForCausalLM written here (safetensors under HF's tensor
names and a MixtralConfig config.json), its logits against a float64 numpy Mixtral forward written in this file
from HF's modeling code's formulas (independent of maxlm), on both backends; a lossless round trip; the config
mapping. The `hf` test repeats the comparison live against transformers' MixtralForCausalLM when importable."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from maxlm import Model
from maxlm.config import ModelConfig, MoEConfig
from maxlm.hf.config import HFConfigError, from_hf, to_hf
from test_convert import bits  # {tensor: (dtype, raw bits)} of a safetensors directory

BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]
U32 = 2.0 ** -24  # float32 unit roundoff
CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
          "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu", "router_aux_loss_coef": 0.02,
          "router_jitter_noise": 0.0, "max_position_embeddings": 64, "initializer_range": 0.02,
          "torch_dtype": "float32"}


def random_mixtral(directory, dtype=np.float32, seed=0) -> dict[str, np.ndarray]:
  """A random Mixtral under HF's names: weights ~ N(0, 1/fan_in) (O(1) activations), the embedding N(0, 1),
  the router 3x wider so that routing decisions are far from ties. Returns the tensors written."""
  c, rng = CONFIG, np.random.default_rng(seed)
  d, f, e, dh = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
  h, kv, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]

  def w(rows, cols, scale=1.0):
    return (scale * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(dtype)
  t = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(dtype),
       "model.norm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(dtype), "lm_head.weight": w(v, d)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t |= {p + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(dtype),
          p + "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(dtype),
          p + "self_attn.q_proj.weight": w(h * dh, d), p + "self_attn.k_proj.weight": w(kv * dh, d),
          p + "self_attn.v_proj.weight": w(kv * dh, d), p + "self_attn.o_proj.weight": w(d, h * dh),
          p + "block_sparse_moe.gate.weight": w(e, d, 3.0)}
    for j in range(e):
      q = f"{p}block_sparse_moe.experts.{j}."
      t |= {q + "w1.weight": w(f, d), q + "w3.weight": w(f, d), q + "w2.weight": w(d, f)}
  directory.mkdir(parents=True, exist_ok=True)
  save_file(t, str(directory / "model.safetensors"))
  (directory / "config.json").write_text(json.dumps(CONFIG | {"torch_dtype": np.dtype(dtype).name}))
  return t


def numpy_mixtral(t: dict, c: dict, tokens: np.ndarray) -> tuple[np.ndarray, float]:
  """Logits [B, T, V] in float64 by Mixtral's published forward (HF modeling_mixtral): RMSNorm, rotate-half
  RoPE, causal GQA attention, a softmax router whose top k weights are renormalized, SwiGLU experts; and the
  least gap between the k-th and (k+1)-th router probability met (to keep routing decisions off ties)."""
  t = {k: np.asarray(x, np.float64) for k, x in t.items()}
  b, n = tokens.shape
  h, kv, dh, e, k = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["num_local_experts"],
                     c["num_experts_per_tok"])

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c["rms_norm_eps"]) * w

  def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)
  inv = 1.0 / c["rope_theta"] ** (np.arange(0, dh, 2) / dh)  # [Dh/2]
  ang = np.concatenate([np.arange(n)[:, None] * inv[None]] * 2, -1)[:, None]  # [T, 1, Dh]

  def rope(x):  # [B, T, heads, Dh]
    return x * np.cos(ang) + np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1) * np.sin(ang)
  x, gap = t["model.embed_tokens.weight"][tokens], np.inf  # [B, T, D]
  causal = np.tril(np.ones((n, n), bool))
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    y = rms(x, t[p + "input_layernorm.weight"])
    q = rope((y @ t[p + "self_attn.q_proj.weight"].T).reshape(b, n, h, dh))
    kk = np.repeat(rope((y @ t[p + "self_attn.k_proj.weight"].T).reshape(b, n, kv, dh)), h // kv, axis=2)
    vv = np.repeat((y @ t[p + "self_attn.v_proj.weight"].T).reshape(b, n, kv, dh), h // kv, axis=2)
    s = np.where(causal, np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(dh), -np.inf)
    x = x + np.einsum("bhqk,bkhd->bqhd", softmax(s), vv).reshape(b, n, h * dh) @ t[p + "self_attn.o_proj.weight"].T
    y = rms(x, t[p + "post_attention_layernorm.weight"])
    probs = softmax(y @ t[p + "block_sparse_moe.gate.weight"].T)  # [B, T, E]
    ranked = np.sort(probs, -1)[..., ::-1]
    gap = min(gap, float((ranked[..., k - 1] - ranked[..., k]).min()))
    top = np.argsort(-probs, -1)[..., :k]  # [B, T, k]
    weights = np.zeros_like(probs)
    np.put_along_axis(weights, top, np.take_along_axis(probs, top, -1), -1)
    weights /= weights.sum(-1, keepdims=True)  # the chosen k renormalized to 1, the others 0
    for j in range(e):
      q_ = f"{p}block_sparse_moe.experts.{j}."
      g, u = y @ t[q_ + "w1.weight"].T, y @ t[q_ + "w3.weight"].T
      x = x + weights[..., j:j + 1] * ((g / (1 + np.exp(-g))) * u) @ t[q_ + "w2.weight"].T
  return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T, gap


def tokens(b=2, n=16, seed=1):
  return np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], (b, n)).astype(np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_logits_match_a_numpy_mixtral(backend, tmp_path):
  t = random_mixtral(tmp_path / "m")
  toks = tokens()
  want, gap = numpy_mixtral(t, CONFIG, toks)
  assert gap > 1e-4  # no routing decision within float32's reach of a tie (else the top k could differ)
  got = Model.from_pretrained(tmp_path / "m", backend=backend).logits(toks)
  # float32 against float64: each block chains 6 contractions (q/k/v, scores, context, output projection, the
  # router and the experts' gate/up, their down projection), each of at most n = max(D, F, H Dh, T) = 48 terms;
  # a contraction's rounding is at most n u of its terms' magnitude (u = 2^-24), so over L blocks and the head
  # (6 L + 1) n u of the logits' scale bounds the error with room for gain through the residual stream
  # (seen: ~1e-6 of the scale). A wrong expert, weight or normalization moves the logits by O(0.1).
  tol = (6 * CONFIG["num_hidden_layers"] + 1) * 48 * U32 * np.abs(want).max()
  err = np.abs(got - want).max()
  assert err <= tol, f"{backend}: max |logits - numpy Mixtral| = {err:.3g} (bound {tol:.3g})"


def test_greedy_generation_with_the_kv_cache_matches_the_numpy_mixtral(tmp_path):
  """Model.generate (maxlm.generation's KV cache through the MoE blocks) against greedy decoding by the numpy
  forward, which recomputes the whole prefix at every step; each step's top two logits are kept apart by more
  than the fp32 bound of the logits test, so rounding cannot swap them."""
  t = random_mixtral(tmp_path / "m", seed=4)
  prompt = tokens(1, 6, seed=5)[0].tolist()
  seq = list(prompt)
  for _ in range(6):
    logits, _ = numpy_mixtral(t, CONFIG, np.asarray([seq]))
    top2 = np.sort(logits[0, -1])[-2:]
    assert top2[1] - top2[0] > (6 * CONFIG["num_hidden_layers"] + 1) * 48 * U32 * np.abs(logits).max()
    seq.append(int(np.argmax(logits[0, -1])))
  assert Model.from_pretrained(tmp_path / "m", backend="flax").generate([prompt], 6)[0] == seq[len(prompt):]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_round_trip_is_lossless(dtype, tmp_path):
  """Import then export: every tensor bit for bit in the files' dtype, the config.json as it was (the router,
  held in float32 whatever the files' dtype, rounds back exactly)."""
  random_mixtral(tmp_path / "m", dtype=dtype, seed=2)
  m = Model.from_pretrained(tmp_path / "m", backend="flax")
  assert m.config.model.moe == MoEConfig(experts=4, top_k=2, aux_loss_coef=0.02)
  assert m.params["layers"]["moe"]["router"].dtype == jnp.float32
  out = m.save_pretrained(tmp_path / "out")
  have, want = bits(out), bits(tmp_path / "m")
  assert have.keys() == want.keys()
  for k, (dt, raw) in want.items():
    assert have[k][0] == dt and np.array_equal(have[k][1], raw), k
  assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "m" / "config.json").read_text())


def test_config_mapping_and_refusals():
  m = from_hf(CONFIG)
  assert (m.moe.experts, m.moe.top_k, m.moe.every, m.moe.aux_loss_coef, m.sliding_window) == (4, 2, 1, 0.02, 0)
  assert from_hf(to_hf(m, "float32")) == m
  fresh = to_hf(ModelConfig(moe=MoEConfig(experts=8, top_k=2)), "bfloat16")
  assert fresh["architectures"] == ["MixtralForCausalLM"] and fresh["num_local_experts"] == 8
  assert from_hf(CONFIG | {"sliding_window": 16}).sliding_window == 16
  with pytest.raises(HFConfigError, match="router_jitter_noise: 0.01"):
    from_hf(CONFIG | {"router_jitter_noise": 0.01})
  with pytest.raises(HFConfigError, match="num_experts_per_tok"):
    from_hf(CONFIG | {"num_experts_per_tok": 5})
  with pytest.raises(HFConfigError, match="model.moe.every=2"):
    to_hf(ModelConfig(n_layers=4, scan_layers=False, moe=MoEConfig(experts=4, every=2)), "float32")


@pytest.mark.hf
def test_live_against_transformers_mixtral(tmp_path):
  """A random MixtralForCausalLM made by transformers here: fp32 logits and greedy tokens. Skipped when torch
  or transformers is not importable."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(7)
  cfg = transformers.MixtralConfig(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                   num_experts_per_tok=2, initializer_range=0.1, rope_theta=1e6,
                                   eos_token_id=None, pad_token_id=0)
  hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  hf.save_pretrained(tmp_path / "m")
  toks = np.random.default_rng(0).integers(1, 80, size=(2, 20))
  with torch.no_grad():
    want = hf(torch.tensor(toks)).logits.numpy()
    greedy = hf.generate(torch.tensor(toks[:1, :9]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, 9:].tolist()
  m = Model.from_pretrained(tmp_path / "m", backend="flax")
  err = np.abs(m.logits(toks) - want).max()
  print(f"mixtral: transformers {transformers.__version__}, max |logits - transformers| = {err:.3g}")
  assert err <= 1e-4  # as tests/test_hf.py's live test
  assert m.generate([toks[0, :9].tolist()], 8)[0] == greedy
