"""Llama/Mistral/Mixtral decoder built from the layer backend's few names.

token embedding -> N x [RMSNorm -> GQA attention (RoPE, causal / sliding window, packed documents)
-> residual -> RMSNorm -> SwiGLU MLP (or a mixture of SwiGLU experts) -> residual] -> final RMSNorm -> LM head
(tied or untied). The model knows logical axis names only; `maxlm.parallel.sharding` maps them onto the mesh.

Mixture of experts (`model.moe`, maxlm/layers/moe.py): an MoE block has `moe_norm/scale` and `moe/{router, w1,
w2, w3}` in place of `mlp/*`, the same on both backends (the experts are pure JAX). Applied with the `moe`
collection mutable (`moe.COLLECTION`), each MoE block sows its routing statistics there (per layer: the
auxiliary losses, tokens per expert, the drop rate); maxlm/step.py adds the losses to the training loss.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from maxlm.config import ModelConfig
from maxlm.layers import get_backend, remat_policy, resolve_backend
from maxlm.layers import moe
from maxlm.layers.kv_cache import attention_with_cache, update_positions
from maxlm.layers.rope import apply_rope, rope_frequencies
from maxlm.parallel.onefoneb import pipeline_loss
from maxlm.parallel.pipelining import pipeline_stack
from maxlm.tables import PRECISIONS

BTD = ("activation_batch", "activation_length", "activation_embed")
BTHD = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
BTV = ("activation_batch", "activation_length", "activation_vocab")
# With pipeline stages, outside them (the embedding, the head, the loss): the length split over the stages, so that
# those run once over the batch, each stage its 1/S of the tokens, not S times (maxlm/parallel/pipelining.py).
STAGED_BTD = ("activation_batch", "stage_length", "activation_embed")
STAGED_BTV = ("activation_batch", "stage_length", "activation_vocab")


def _dtype(name: str):
  return jnp.dtype(name)


def compute_dtype(m: ModelConfig):
  """The activations' dtype: the one `model.precision` forces (float16 for fp16, loss-scaled), else `m.dtype`."""
  return jnp.dtype(PRECISIONS[m.precision].compute_dtype or m.dtype)


@dataclasses.dataclass(frozen=True)
class Overrides:
  """What a measurement of the step replaces in the model (maxlm/plan/standins.py), never set in a run:
  `attention` in place of the layer backend's (the same signature), `policy(p)` wrapping the remat policy."""
  attention: Callable | None = None
  policy: Callable | None = None


class Block(nn.Module):
  """One pre-norm decoder block; returns (x, None) so it can be scanned, or (x, (k, v)) with a cache."""
  cfg: ModelConfig
  backend: str
  max_segments: int = 1
  context_strategy: str = "auto"
  attention: Callable | None = None  # Overrides.attention
  moe_layer: bool = False  # a mixture of experts in place of the MLP (is_moe_layer)

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache_kv=None, cache_pos=None):
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
    new_kv = None
    if cache_kv is None:
      ctx = (self.attention or be.attention)(q, k, v, segment_ids=segment_ids, positions=positions,
                                             window=m.sliding_window, max_segments=self.max_segments,
                                             context_strategy=self.context_strategy, name="attention")  # [B, T, H, Dh]
    else:  # generation: over this layer's KV cache, pure JAX for both backends (layers/kv_cache.py)
      ctx, *new_kv = attention_with_cache(q, k, v, *cache_kv, cache_pos, positions, segment_ids > 0,
                                          m.sliding_window)  # [B, T, H, Dh]
      new_kv = tuple(new_kv)
    # named here, for both backends, so that the remat policies save_attn and save_qkv_attn keep it
    ctx = checkpoint_name(nn.with_logical_constraint(ctx, BTHD), "context")  # [B, T, H, Dh]
    out = be.dense(ctx, features=(m.d_model,), axis=(-2, -1), kernel_axes=("heads", "head_dim", "embed"),
                   param_dtype=pdt, kernel_init=init, name="out")  # [B, T, D]
    x = nn.with_logical_constraint(x + checkpoint_name(out, "out_proj"), BTD)  # [B, T, D]
    if self.moe_layer:
      mlp = self._experts(be.rms_norm(x, eps=m.norm_eps, param_dtype=pdt, name="moe_norm"), pdt, init)
    else:
      mlp = be.norm_mlp(x, ffn_dim=m.ffn_dim, eps=m.norm_eps, param_dtype=pdt, kernel_init=init,
                        name="mlp")  # [B, T, D]
    x = nn.with_logical_constraint(x + mlp, BTD)  # [B, T, D]
    return x, new_kv

  def _experts(self, h, pdt, init):
    """The mixture of experts on the normed h [B, T, D]; its statistics sown when the collection is mutable."""
    e = self.cfg.moe
    y, stats = moe.MoE(experts=e.experts, top_k=e.top_k, ffn_dim=self.cfg.ffn_dim, capacity_factor=e.capacity_factor,
                       kernel=e.kernel, param_dtype=pdt, kernel_init=init, name="moe")(h)  # [B, T, D]
    if not self.is_initializing():  # (init makes every collection mutable: no statistics in the variables)
      self.sow(moe.COLLECTION, "stats", stats)
    return y


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
  """Block i (from 0) is a mixture of experts: blocks every-1, 2 every-1, ... of a model with experts."""
  return cfg.moe.experts > 0 and (i + 1) % cfg.moe.every == 0


def moe_layers(cfg: ModelConfig) -> list[int]:
  """The MoE blocks, in order (the layers of the statistics maxlm/step.py reports)."""
  return [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]


def head_logits(x, m: ModelConfig, backend: str, embedding=None):
  """The final norm and the LM head over x [B, T, D], creating their modules (final_norm / lm_head) in the calling
  module's scope: logits [B, T, V] (compute dtype); `embedding` [V, D] the tied head's kernel."""
  be, pdt = get_backend(backend), _dtype(m.param_dtype)
  if m.tie_embeddings:
    y = be.rms_norm(x, eps=m.norm_eps, param_dtype=pdt, name="final_norm")  # [B, T, D]
    y, e = nn.dtypes.promote_dtype(y, embedding, dtype=compute_dtype(m))  # nn.Embed.attend's
    return jnp.dot(y, e.T)  # [B, T, V]
  return be.norm_dense(x, features=(m.vocab_size,), kernel_axes=("embed", "vocab"), eps=m.norm_eps, param_dtype=pdt,
                       kernel_init=nn.initializers.normal(m.init_std), name="lm_head",
                       quantize=m.te_fp8_lm_head)  # [B, T, V]


class Head(nn.Module):
  """`head_logits` as a module of its own: what the 1F1B pipeline's last stage applies to each micro-batch, with
  the Transformer's final_norm / lm_head parameters."""
  cfg: ModelConfig
  backend: str

  @nn.compact
  def __call__(self, x, embedding=None):
    return head_logits(x, self.cfg, self.backend, embedding)


class Transformer(nn.Module):
  """Decoder-only LM. `__call__(tokens, positions, segment_ids) -> logits [B, T, V]` (compute dtype).

  Generation passes `cache={"k", "v": [L, B, S, KV, Dh], "pos": [B, S]}` (see layers/kv_cache.py) with
  segment_ids > 0 marking each row's valid tokens (a prefix); it then gets the logits of each row's last
  valid token [B, 1, V] and the updated cache in the mutable "kv_cache" collection.

  `context_strategy` (mesh.context_strategy) is how attention exchanges keys and values where the mesh splits
  the length (maxlm/parallel/context.py); the tokens then come in the order that module gives.

  stages > 1: the scanned stack runs as a pipeline of that many stages over `microbatches` micro-batches
  (maxlm/parallel/pipelining.py; the mesh's `pipeline` degree and train.grad_accum), each stage `repeats` chunks of layers
  (1: GPipe; more: circular), its weights gathered over fsdp once per step when `gather_once`
  (train.pipeline_gather=step); the parameters are the same.
  The embedding and the LM head stay outside it, run once over the batch, its length split over the stages
  (see maxlm/parallel/pipelining.py). schedule 1f1b: `__call__(..., loss=, targets=, mask=)` returns the summed
  loss and the token count, the head applied per micro-batch inside the schedule (maxlm/parallel/onefoneb.py).
  """
  cfg: ModelConfig
  max_segments: int = 1
  context_strategy: str = "auto"
  stages: int = 1
  microbatches: int = 1
  repeats: int = 1
  gather_once: bool = False
  overrides: Overrides | None = None  # measurements only
  schedule: str = "gpipe"  # train.pipeline_schedule; 1f1b: __call__ with `loss` returns the loss itself

  @nn.compact
  def __call__(self, tokens, positions=None, segment_ids=None, cache=None, hidden: bool = False, loss=None,
               targets=None, mask=None):
    m = self.cfg
    backend = resolve_backend(m.backend)
    be = get_backend(backend)
    pdt, cdt = _dtype(m.param_dtype), compute_dtype(m)
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    embed = nn.Embed(m.vocab_size, m.d_model, dtype=cdt, param_dtype=pdt, name="embed",
                     embedding_init=nn.with_logical_partitioning(nn.initializers.normal(m.init_std),
                                                                 ("vocab", "embed")))
    staged = self.stages > 1 and cache is None and m.scan_layers
    btd, btv = (STAGED_BTD, STAGED_BTV) if staged else (BTD, BTV)
    x = nn.with_logical_constraint(embed(tokens), btd)  # [B, T, D]

    block, over = Block, self.overrides or Overrides()
    policy = remat_policy(m.remat, backend)
    if over.policy is not None:
      policy = over.policy(policy)
    if m.remat != "none" and cache is None:
      block = nn.remat(Block, policy=policy, prevent_cse=not m.scan_layers)
    if cache is not None:  # generation
      x = self._cached_layers(x, positions, segment_ids, cache, backend)  # [B, 1, D]
    elif m.scan_layers and self.stages > 1 and not self.is_initializing() and self.schedule == "1f1b" and loss:
      return self._onefoneb(x, positions, segment_ids, backend, policy, over.attention, (loss, targets, mask))
    elif m.scan_layers and self.stages > 1 and not self.is_initializing():
      x = self._pipelined(x, positions, segment_ids, backend, policy, over.attention)  # [B, T, D]
    elif m.scan_layers:  # (also the init of a pipelined model: the same parameters, made the same way)
      stack = nn.scan(block, variable_axes={"params": 0, "fp8_metas": 0, moe.COLLECTION: 0},
                      split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast), length=m.n_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})  # (config: moe.every is 1 when scanned)
      x, _ = stack(m, backend, self.max_segments, self.context_strategy, over.attention,
                   moe_layer=is_moe_layer(m, 0), name="layers")(x, positions, segment_ids)  # [B, T, D]
    else:
      for i in range(m.n_layers):
        x, _ = block(m, backend, self.max_segments, self.context_strategy, over.attention,
                     moe_layer=is_moe_layer(m, i), name=f"layers_{i}")(x, positions, segment_ids)  # [B, T, D]

    x = nn.with_logical_constraint(x, btd)
    if hidden:  # the chunked loss (maxlm/step.py) applies the head itself: no [B, T, V] logits here
      y = be.rms_norm(x, eps=m.norm_eps, param_dtype=pdt,
                      name="final_norm" if m.tie_embeddings else "lm_head")  # [B, T, D]
      kernel = embed.embedding if m.tie_embeddings else nn.unbox(self.variables["params"]["lm_head"]["kernel"])
      return nn.with_logical_constraint(y, btd), kernel  # kernel [V, D] tied, [D, V] untied
    logits = head_logits(x, m, backend, embed.embedding if m.tie_embeddings else None)  # [B, T, V]
    return nn.with_logical_constraint(logits, btv)

  def _stack(self, backend, policy, attention):
    """(layer(p, h, pos, seg) applying one Block, the stack's parameters [L, ...], their logical names)."""
    m = self.cfg
    if m.moe.experts:  # (the config refuses it: the stages would drop the statistics the loss needs)
      raise ValueError("a mixture of experts does not run with pipeline stages yet")
    block = Block(m, backend, self.max_segments, self.context_strategy, attention)

    def layer(p, h, pos, seg):  # one layer: its params p, h [B/M, T, D]
      return block.apply({"params": p}, h, pos, seg)[0]
    if m.remat != "none":
      layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    boxed = self.variables["params"]["layers"]
    axes = jax.tree_util.tree_map(tuple, nn.get_partition_spec(boxed),
                                  is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))  # logical names
    return layer, nn.unbox(boxed), axes

  def _onefoneb(self, x, positions, segment_ids, backend, policy, attention, loss_args):
    """train.pipeline_schedule=1f1b: (summed loss, token count) of `loss(logits, targets, mask)` over the
    micro-batches, the head applied to each on the last stage (maxlm/parallel/onefoneb.py)."""
    m, (loss, targets, mask) = self.cfg, loss_args
    layer, params, axes = self._stack(backend, policy, attention)
    head, names = Head(m, backend), ("final_norm",) if m.tie_embeddings else ("lm_head",)
    tail_params = {"head": {n: nn.unbox(self.variables["params"][n]) for n in names},
                   "embedding": nn.unbox(self.variables["params"]["embed"]["embedding"]) if m.tie_embeddings else None}

    def tail(tp, h, tgt, msk):  # h [B/M, T, D] -> (summed loss, count)
      h = nn.with_logical_constraint(h, STAGED_BTD)
      logits = nn.with_logical_constraint(head.apply({"params": tp["head"]}, h, tp["embedding"]), STAGED_BTV)
      return loss(logits, tgt, msk)
    return pipeline_loss(layer, tail, params, tail_params, x, positions, segment_ids, (targets, mask),
                         stages=self.stages, microbatches=self.microbatches, axes=axes, gather=self.gather_once)

  def _pipelined(self, x, positions, segment_ids, backend, policy, attention):
    """The scanned stack's own parameters [L, ...] applied by maxlm/parallel/pipelining.py's stages, one Block at a time."""
    layer, params, axes = self._stack(backend, policy, attention)
    return pipeline_stack(layer, params, x, positions, segment_ids, stages=self.stages,
                          microbatches=self.microbatches, repeats=self.repeats, axes=axes,
                          gather=self.gather_once)  # [B, T, D]

  def _cached_layers(self, x, positions, segment_ids, cache, backend):
    """The blocks over the KV cache; stores the new cache; returns each row's last valid hidden state."""
    m = self.cfg
    if m.scan_layers:
      stack = nn.scan(Block, variable_axes={"params": 0, "fp8_metas": 0, moe.COLLECTION: 0},
                      split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),
                      length=m.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x, (k, v) = stack(m, backend, self.max_segments, moe_layer=is_moe_layer(m, 0), name="layers")(
          x, positions, segment_ids, (cache["k"], cache["v"]), cache["pos"])  # [B, T, D]
    else:
      ks, vs = [], []
      for i in range(m.n_layers):
        x, (k, v) = Block(m, backend, self.max_segments, moe_layer=is_moe_layer(m, i), name=f"layers_{i}")(
            x, positions, segment_ids, (cache["k"][i], cache["v"][i]), cache["pos"])  # [B, T, D]
        ks.append(k)
        vs.append(v)
      k, v = jnp.stack(ks), jnp.stack(vs)  # [L, B, S, KV, Dh]
    valid = segment_ids > 0  # [B, T]
    self.put_variable("kv_cache", "k", k)
    self.put_variable("kv_cache", "v", v)
    self.put_variable("kv_cache", "pos", update_positions(cache["pos"], positions, valid))
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)  # [B] index of each row's last valid token
    return jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts by the MFU convention: `matmul` counts every GEMM weight incl. the LM head (every expert's);
  `active` those a token passes through (of an MoE block: the router and top_k experts; a dense model: all
  of `matmul`); `layers` those of the decoder blocks (norms included)."""
  d, f, h, kv, dh, v, n = (cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.vocab_size, cfg.n_layers)
  # the MoE blocks' count, as moe_layers would list them (counted, not listed: sizes are checked before they are
  # built, absurd ones included)
  e, k, n_moe = cfg.moe.experts, cfg.moe.top_k, (n // cfg.moe.every if cfg.moe.experts > 0 else 0)
  attn, mlp = d * (h + 2 * kv) * dh + h * dh * d, 3 * d * f
  blocks = n * attn + (n - n_moe) * mlp + n_moe * (d * e + e * mlp)  # an MoE block: router [D, E], E experts
  matmul = blocks + d * v  # the LM head is a GEMM also when tied
  active = matmul - n_moe * (e - k) * mlp
  norms = (2 * n + 1) * d
  embed = v * d
  total = blocks + norms + embed + (0 if cfg.tie_embeddings else d * v)
  layers = blocks + 2 * n * d  # the scanned stack: what the pipeline stages split
  return {"matmul": matmul, "active": active, "embedding": embed, "total": total, "layers": layers}


def flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
  """Training FLOPs of one step: 6*N*tokens + causal attention 6*B*S^2*(H*Dh)*layers (MaxText), N the active
  GEMM weights (a mixture of experts counts the router and the top_k experts a token runs, not all E)."""
  n = count_params(cfg)["active"]
  w = cfg.sliding_window if cfg.sliding_window and cfg.sliding_window < seq_len else seq_len
  pairs = seq_len * w - w * w / 2.0  # attended (query, key) pairs per row; S^2/2 when causal
  attn = 12.0 * batch * pairs * cfg.n_heads * cfg.head_dim * cfg.n_layers
  return 6.0 * n * batch * seq_len + attn


MATMUL_WEIGHTS = ("kernel", "wi_kernel", "wo_kernel", "w1", "w2", "w3")  # the parameters that multiply activations
# (w1, w2, w3: the experts of maxlm/layers/moe.py; its router stays in float32)


def cast_matmul_weights(params, dtype, cfg: ModelConfig):
  """The params with every matmul weight (the model's `kernel`, `wi_kernel`, `wo_kernel`; the embedding
  unless tied) cast to `dtype`: what each use casts them to anyway. Norm scales stay as they are (the
  norms compute in fp32). A tied embedding is left alone: its two uses' gradients are summed in the
  master dtype, not in `dtype`."""
  return jax.tree_util.tree_map_with_path(matmul_cast(dtype, cfg), params)


def matmul_cast(dtype, cfg: ModelConfig):
  """`cast(path, x)`: one leaf as `cast_matmul_weights` gives it."""
  names = MATMUL_WEIGHTS + (() if cfg.tie_embeddings else ("embedding",))

  def cast(path, x):
    return x.astype(dtype) if getattr(path[-1], "key", None) in names else x
  return cast
