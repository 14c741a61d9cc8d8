"""Independent references for the tests: a Llama/Mistral decoder forward pass and its loss.

Written from the published formulas (RMSNorm; RoPE in the rotate-half convention of Llama / HF with
Llama-3.1 frequency scaling; causal grouped-query attention with an optional sliding window and
packed documents; SwiGLU MLP) against maxlm's parameter *names and layouts* only. Nothing here
imports maxlm: a bug in the model code cannot leak into the reference.

`xp` is numpy (float64 forward passes) or jax.numpy (differentiable: `jax.grad` of `mean_loss`
gives reference gradients; call it under `jax.enable_x64(True)` with float64 params for exactness).
`cfg` is any object with ModelConfig's field names (vocab_size, d_model, n_layers, n_heads, ...).
"""

from __future__ import annotations

import math

import jax
import numpy as np

# Parameter layout (maxlm's tree; `layers` stacked on a leading L axis, or `layers_0`, `layers_1`, ...):
#   embed/embedding                [V, D]
#   <layer>/qkv/scale              [D]      RMSNorm before attention
#   <layer>/qkv/kernel             [D, KV, G+2, Dh]: per KV head its G query heads, then K, then V
#   <layer>/out/kernel             [H, Dh, D] with query head h = kv * G + g
#   <layer>/mlp/scale              [D]      RMSNorm before the MLP
#   <layer>/mlp/wi_kernel          [D, 2, F]: index 0 = gate (through SiLU), 1 = up
#   <layer>/mlp/wo_kernel          [F, D]
#   lm_head/{scale [D], kernel [D, V]}   or, tied: final_norm/scale [D] and logits = y @ embedding^T


def inv_frequencies(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                    low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                    original_max_position: int = 8192) -> np.ndarray:
  """RoPE inverse frequencies theta^(-2i/Dh), i < Dh/2, with Llama 3.1's `apply_scaling` (Meta's formula)."""
  if scaling not in ("none", "llama3"):
    raise ValueError(f"unknown RoPE scaling {scaling!r}")
  out = []
  for i in range(head_dim // 2):
    freq = theta ** (-2.0 * i / head_dim)
    wavelen = 2.0 * math.pi / freq
    if scaling == "none" or wavelen < original_max_position / high_freq_factor:
      out.append(freq)  # high frequencies (short wavelengths) are kept
    elif wavelen > original_max_position / low_freq_factor:
      out.append(freq / factor)  # low frequencies are divided by the factor
    else:  # in between: interpolate smoothly between the two
      smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1.0 - smooth) * freq / factor + smooth * freq)
  return np.array(out, np.float64)


def cfg_inv_frequencies(cfg) -> np.ndarray:
  return inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor,
                         cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_position)


def rope(x, positions, inv_freq, xp=np):
  """x [B, T, N, Dh] rotated by angle pos * f_i in the plane of dims (i, i + Dh/2) (rotate-half)."""
  angles = xp.asarray(positions).astype(x.dtype)[..., None] * xp.asarray(inv_freq, x.dtype)  # [B, T, Dh/2]
  cos = xp.concatenate([xp.cos(angles), xp.cos(angles)], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  sin = xp.concatenate([xp.sin(angles), xp.sin(angles)], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  half = x.shape[-1] // 2
  rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, T, N, Dh]
  return x * cos + rotated * sin


def rms_norm(x, scale, eps, xp=np):
  """x / sqrt(mean(x^2) + eps) * scale over the last axis."""
  return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def attention_keep(t: int, segment_ids=None, window: int = 0, xp=np):
  """Boolean [B|1, T, T]: query i sees key j iff j <= i, i - W < j (W > 0), same segment id > 0."""
  i = xp.arange(t)[:, None]
  j = xp.arange(t)[None, :]
  keep = j <= i
  if window:
    keep = keep & (j > i - window)
  keep = keep[None]  # [1, T, T]
  if segment_ids is not None:
    seg = segment_ids
    keep = keep & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)  # [B, T, T]
  return keep


def attention(q, k, v, keep, xp=np):
  """Softmax(q k^T / sqrt(Dh)) v; query head h reads KV head h // G. q [B, T, H, Dh], k/v [B, T, KV, Dh].

  A query that sees no key (padding) gets a uniform average instead of NaN; callers ignore it.
  """
  b, t, h, dh = q.shape
  g = h // k.shape[2]
  heads = []
  for head in range(h):
    kh, vh = k[:, :, head // g], v[:, :, head // g]  # [B, T, Dh]
    s = xp.einsum("bid,bjd->bij", q[:, :, head], kh) / math.sqrt(dh)  # [B, T, T]
    s = xp.where(keep, s, -1e30)
    s = s - xp.max(s, axis=-1, keepdims=True)
    p = xp.exp(s)
    p = p / xp.sum(p, axis=-1, keepdims=True)  # [B, T, T]
    heads.append(xp.einsum("bij,bjd->bid", p, vh))  # [B, T, Dh]
  return xp.stack(heads, axis=2)  # [B, T, H, Dh]


def layer_params(params, n_layers: int) -> list:
  """Per-layer parameter dicts from a scanned (`layers`, leading L axis) or unrolled tree."""
  if "layers" in params:
    def index(tree, i):
      return {k: index(v, i) if isinstance(v, dict) else v[i] for k, v in tree.items()}
    return [index(params["layers"], i) for i in range(n_layers)]
  return [params[f"layers_{i}"] for i in range(n_layers)]


def decoder_layer(p, x, positions, keep, cfg, inv_freq, xp=np):
  """x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(.)). x [B, T, D]."""
  b, t, _ = x.shape
  kv, h, dh = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
  g = h // kv
  w = p["qkv"]["kernel"]  # [D, KV, G+2, Dh]
  y = rms_norm(x, p["qkv"]["scale"], cfg.norm_eps, xp)  # [B, T, D]
  q = xp.einsum("btd,dkgh->btkgh", y, w[:, :, :g]).reshape(b, t, kv * g, dh)  # [B, T, H, Dh]
  k = xp.einsum("btd,dkh->btkh", y, w[:, :, g])  # [B, T, KV, Dh]
  v = xp.einsum("btd,dkh->btkh", y, w[:, :, g + 1])  # [B, T, KV, Dh]
  q, k = rope(q, positions, inv_freq, xp), rope(k, positions, inv_freq, xp)
  ctx = attention(q, k, v, keep, xp)  # [B, T, H, Dh]
  x = x + xp.einsum("bthe,hed->btd", ctx, p["out"]["kernel"])  # [B, T, D]
  y = rms_norm(x, p["mlp"]["scale"], cfg.norm_eps, xp)  # [B, T, D]
  wi = p["mlp"]["wi_kernel"]  # [D, 2, F]
  gate, up = y @ wi[:, 0], y @ wi[:, 1]  # [B, T, F]
  act = gate / (1.0 + xp.exp(-gate)) * up  # SiLU(gate) * up, [B, T, F]
  return x + act @ p["mlp"]["wo_kernel"]  # [B, T, D]


def forward(params, cfg, tokens, positions=None, segment_ids=None, xp=np):
  """Logits [B, T, V] of the decoder. `params` is the tree under "params"; no segment_ids = one document."""
  b, t = tokens.shape
  if positions is None:
    positions = xp.broadcast_to(xp.arange(t), (b, t))
  keep = attention_keep(t, segment_ids, cfg.sliding_window, xp)
  inv_freq = cfg_inv_frequencies(cfg)
  emb = params["embed"]["embedding"]  # [V, D]
  x = emb[tokens]  # [B, T, D]
  for p in layer_params(params, cfg.n_layers):
    x = decoder_layer(p, x, positions, keep, cfg, inv_freq, xp)
  if cfg.tie_embeddings:
    return rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps, xp) @ emb.T  # [B, T, V]
  head = params["lm_head"]
  return rms_norm(x, head["scale"], cfg.norm_eps, xp) @ head["kernel"]  # [B, T, V]


def token_nll(logits, targets, xp=np):
  """-log softmax(logits)[target] per position. logits [B, T, V], targets [B, T] -> [B, T]."""
  m = xp.max(logits, axis=-1, keepdims=True)
  lse = (m + xp.log(xp.sum(xp.exp(logits - m), axis=-1, keepdims=True)))[..., 0]  # [B, T]
  onehot = targets[..., None] == xp.arange(logits.shape[-1])  # [B, T, V]
  return lse - xp.sum(xp.where(onehot, logits, 0.0), axis=-1)


def loss_sum_and_count(params, cfg, batch, packed: bool, xp=np):
  """(summed NLL over positions with segment_ids > 0, their count) over a whole batch.

  packed: attention stays inside each segment (documents packed in a row); otherwise a row is one
  causal sequence and segment_ids only mark which positions count.
  """
  seg = batch["segment_ids"]
  logits = forward(params, cfg, batch["inputs"], batch["positions"], seg if packed else None, xp)
  valid = seg > 0
  nll = token_nll(logits, batch["targets"], xp)  # [B, T]
  return xp.sum(xp.where(valid, nll, 0.0)), xp.sum(valid)


def mean_loss(params, cfg, batch, packed: bool, xp=np):
  """The token-weighted mean NLL over the whole (global) batch: every valid token weighs the same."""
  total, count = loss_sum_and_count(params, cfg, batch, packed, xp)
  return total / count


def as_float64(tree):
  """The same tree as float64 numpy arrays."""
  return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def random_params(params, seed: int = 0, embed_std: float = 1.0):
  """float32 numpy values for a maxlm param tree (same structure and shapes), scaled so every
  contraction keeps O(1) activations: kernels ~ N(0, 1/fan_in), norm scales ~ U(0.5, 1.5), the
  embedding ~ N(0, embed_std^2). Attention is then far from uniform, unlike at a 0.02-std init."""
  rng = np.random.default_rng(seed)

  def fan_in(names, shape):
    if names[-2] == "qkv":
      return shape[-4]  # [.., D, KV, G+2, Dh]
    if names[-2] == "out":
      return shape[-3] * shape[-2]  # [.., H, Dh, D]
    if names[-1] == "wi_kernel":
      return shape[-3]  # [.., D, 2, F]
    return shape[-2]  # wo_kernel [.., F, D], lm_head [D, V]

  def draw(path, leaf):
    names = [getattr(k, "key", str(k)) for k in path]
    shape = np.shape(leaf)
    if names[-1] == "scale":
      value = rng.uniform(0.5, 1.5, shape)
    elif names[-1] == "embedding":
      value = rng.normal(0.0, embed_std, shape)
    else:
      value = rng.normal(0.0, 1.0, shape) / math.sqrt(fan_in(names, shape))
    return value.astype(np.float32)

  return jax.tree_util.tree_map_with_path(draw, params)
