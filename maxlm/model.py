"""Llama/Mistral decoder built from the layer backend's few names.

token embedding -> N x [RMSNorm -> GQA attention (RoPE, causal / sliding window, packed documents)
-> residual -> RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm -> LM head (tied or untied).
The model knows logical axis names only; `maxlm.sharding` maps them onto the mesh.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from maxlm.config import ModelConfig
from maxlm.layers import get_backend, remat_policy, resolve_backend
from maxlm.layers.rope import apply_rope, rope_frequencies

BTD = ("activation_batch", "activation_length", "activation_embed")
BTHD = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
BTV = ("activation_batch", "activation_length", "activation_vocab")


def _dtype(name: str):
  return jnp.dtype(name)


class Block(nn.Module):
  """One pre-norm decoder block; returns (x, None) so it can be scanned."""
  cfg: ModelConfig
  backend: str
  max_segments: int = 1

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    m, be = self.cfg, get_backend(self.backend)
    pdt = _dtype(m.param_dtype)
    init = nn.initializers.normal(m.init_std)
    kv, g, dh = m.n_kv_heads, m.n_heads // m.n_kv_heads, m.head_dim
    b, t, _ = x.shape
    # Fused QKV in grouped layout: per KV head, its G query heads then K then V. Sharding the
    # kv_heads axis over `tensor` keeps every split local to a shard.
    qkv = be.norm_dense(x, features=(kv, g + 2, dh), kernel_axes=("embed", "kv_heads", "qkv", "head_dim"),
                        eps=m.norm_eps, param_dtype=pdt, kernel_init=init, name="qkv")  # [B, T, KV, G+2, Dh]
    qkv = checkpoint_name(qkv, "qkv_proj")
    q = qkv[:, :, :, :g].reshape(b, t, kv * g, dh)  # [B, T, H, Dh]
    k = qkv[:, :, :, g]  # [B, T, KV, Dh]
    v = qkv[:, :, :, g + 1]  # [B, T, KV, Dh]
    inv_freq = rope_frequencies(dh, m.rope_theta, m.rope_scaling, m.rope_factor, m.rope_low_freq_factor,
                                m.rope_high_freq_factor, m.rope_original_max_position)
    q = nn.with_logical_constraint(apply_rope(q, positions, inv_freq), BTHD)  # [B, T, H, Dh]
    k = apply_rope(k, positions, inv_freq)  # [B, T, KV, Dh]
    ctx = be.attention(q, k, v, segment_ids=segment_ids, positions=positions, window=m.sliding_window,
                       max_segments=self.max_segments, name="attention")  # [B, T, H, Dh]
    ctx = nn.with_logical_constraint(ctx, BTHD)
    out = be.dense(ctx, features=(m.d_model,), axis=(-2, -1), kernel_axes=("heads", "head_dim", "embed"),
                   param_dtype=pdt, kernel_init=init, name="out")  # [B, T, D]
    x = nn.with_logical_constraint(x + checkpoint_name(out, "out_proj"), BTD)  # [B, T, D]
    mlp = be.norm_mlp(x, ffn_dim=m.ffn_dim, eps=m.norm_eps, param_dtype=pdt, kernel_init=init,
                      name="mlp")  # [B, T, D]
    x = nn.with_logical_constraint(x + mlp, BTD)  # [B, T, D]
    return x, None


class Transformer(nn.Module):
  """Decoder-only LM. `__call__(tokens, positions, segment_ids) -> logits [B, T, V]` (compute dtype)."""
  cfg: ModelConfig
  max_segments: int = 1

  @nn.compact
  def __call__(self, tokens, positions=None, segment_ids=None):
    m = self.cfg
    backend = resolve_backend(m.backend)
    be = get_backend(backend)
    pdt, cdt = _dtype(m.param_dtype), _dtype(m.dtype)
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    embed = nn.Embed(m.vocab_size, m.d_model, dtype=cdt, param_dtype=pdt, name="embed",
                     embedding_init=nn.with_logical_partitioning(nn.initializers.normal(m.init_std),
                                                                 ("vocab", "embed")))
    x = nn.with_logical_constraint(embed(tokens), BTD)  # [B, T, D]

    block = Block
    policy = remat_policy(m.remat, backend)
    if m.remat != "none":
      block = nn.remat(Block, policy=policy, prevent_cse=not m.scan_layers)
    if m.scan_layers:
      stack = nn.scan(block, variable_axes={"params": 0, "fp8_metas": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=m.n_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(m, backend, self.max_segments, name="layers")(x, positions, segment_ids)  # [B, T, D]
    else:
      for i in range(m.n_layers):
        x, _ = block(m, backend, self.max_segments, name=f"layers_{i}")(x, positions, segment_ids)

    init = nn.initializers.normal(m.init_std)
    if m.tie_embeddings:
      y = be.rms_norm(x, eps=m.norm_eps, param_dtype=pdt, name="final_norm")  # [B, T, D]
      logits = embed.attend(y)  # [B, T, V]
    else:
      logits = be.norm_dense(x, features=(m.vocab_size,), kernel_axes=("embed", "vocab"), eps=m.norm_eps,
                             param_dtype=pdt, kernel_init=init, name="lm_head",
                             quantize=m.fp8_lm_head)  # [B, T, V]
    return nn.with_logical_constraint(logits, BTV)


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts by the MFU convention: `matmul` counts every GEMM weight incl. the LM head."""
  d, f, h, kv, dh, v, n = (cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.vocab_size, cfg.n_layers)
  per_layer = d * (h + 2 * kv) * dh + h * dh * d + 3 * d * f
  matmul = n * per_layer + d * v  # the LM head is a GEMM also when tied
  norms = (2 * n + 1) * d
  embed = v * d
  total = n * per_layer + norms + embed + (0 if cfg.tie_embeddings else d * v)
  return {"matmul": matmul, "embedding": embed, "total": total}


def flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
  """Training FLOPs of one step: 6*N*tokens + causal attention 6*B*S^2*(H*Dh)*layers (MaxText)."""
  n = count_params(cfg)["matmul"]
  w = cfg.sliding_window if cfg.sliding_window and cfg.sliding_window < seq_len else seq_len
  pairs = seq_len * w - w * w / 2.0  # attended (query, key) pairs per row; S^2/2 when causal
  attn = 12.0 * batch * pairs * cfg.n_heads * cfg.head_dim * cfg.n_layers
  return 6.0 * n * batch * seq_len + attn
