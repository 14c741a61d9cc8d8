"""Transformer Engine layer backend: the same names and parameter trees as `flax_backend`.

`norm_dense` is TE's fused RMSNorm+GEMM (`LayerNormDenseGeneral`), `norm_mlp` its fused
RMSNorm+SwiGLU MLP (`LayerNormMLP`, `wi_kernel` [D, 2, F]), `attention` its
`DotProductAttention` (cuDNN fused on GPU; THD + SequenceDescriptor for packed rows).
"""

from __future__ import annotations

import contextlib
import math

import jax.numpy as jnp

from maxlm.layers import cp_attention, flax_backend
from maxlm.parallel import context
from maxlm.layers.te_env import import_te, on_gpu

NORM_AXES = flax_backend.NORM_AXES


def _flax():
  return import_te().flax


def rms_norm(x, *, eps: float, param_dtype, name: str):
  return _flax().LayerNorm(layernorm_type="rmsnorm", epsilon=eps, scale_axes=NORM_AXES,
                           dtype=param_dtype, name=name)(x)


def norm_dense(x, *, features, kernel_axes, eps: float, param_dtype, kernel_init, name: str,
               quantize: bool = True):
  with contextlib.nullcontext() if quantize else no_quantization():
    out, _ = _flax().LayerNormDenseGeneral(
        features=tuple(features), layernorm_type="rmsnorm", epsilon=eps, scale_axes=NORM_AXES,
        kernel_axes=tuple(kernel_axes), kernel_init=kernel_init, use_bias=False,
        dtype=param_dtype, name=name)(x)
  return out


def dense(x, *, features, axis, kernel_axes, param_dtype, kernel_init, name: str, quantize: bool = True):
  with contextlib.nullcontext() if quantize else no_quantization():
    return _flax().DenseGeneral(
        features=tuple(features), axis=tuple(axis), kernel_axes=tuple(kernel_axes),
        kernel_init=kernel_init, use_bias=False, dtype=param_dtype, name=name)(x)


def norm_mlp(x, *, ffn_dim: int, eps: float, param_dtype, kernel_init, name: str):
  out, _ = _flax().LayerNormMLP(
      intermediate_dim=ffn_dim, layernorm_type="rmsnorm", epsilon=eps, scale_axes=NORM_AXES,
      kernel_axes_1=("embed", "act", "mlp"), kernel_axes_2=("mlp", "embed"),
      activations=("silu", "linear"), use_bias=False, kernel_init=kernel_init,
      intermediate_dropout_rate=0.0, dtype=param_dtype, name=name)(x, deterministic=True)
  return out


def attention(q, k, v, *, segment_ids=None, positions=None, window: int = 0, max_segments: int = 1,
              name: str = "attention", context_strategy: str = "auto"):
  """Causal GQA attention. q [B, T, H, Dh], k/v [B, T, KV, Dh] -> [B, T, H, Dh]. With the length split over a
  context axis (maxlm/parallel/context.py), cuDNN's fused attention runs TE's context-parallel strategy over it."""
  te = import_te()
  b, t, h, dh = q.shape
  common = dict(head_dim=dh, num_attention_heads=h, num_gqa_groups=k.shape[2], attention_dropout=0.0,
                attn_bias_type="no_bias", scale_factor=1.0 / math.sqrt(dh),
                transpose_batch_sequence=False,
                window_size=(window - 1, 0) if window else None, name=name)
  cp = context.axis()
  if cp is not None:
    return _context_parallel(te, q, k, v, segment_ids, positions, window, max_segments, context_strategy, cp,
                             common)
  if segment_ids is None and not window:
    mod = te.flax.DotProductAttention(attn_mask_type="causal", qkv_layout="bshd_bshd_bshd", **common)
    return mod(q, k, v, deterministic=False)
  # cuDNN's fused attention takes bf16/fp16 only; TE runs other dtypes (fp32 inference, fp32 tests) on its
  # unfused path, which takes a mask array, not a SequenceDescriptor: give it the mask below.
  if on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16):
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)  # [B, T]
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    from transformer_engine.jax.attention import SequenceDescriptor  # noqa: PLC0415 - TE: only once chosen and set up
    desc = SequenceDescriptor.from_segment_ids_and_pos(segment_ids, positions)
    mod = te.flax.DotProductAttention(attn_mask_type="padding_causal", qkv_layout="thd_thd_thd",
                                      max_segments_per_seq=max_segments, **common)
    return mod(q, k, v, desc, deterministic=False)
  # Unfused pure-JAX path (CPU, and fp32 on a GPU): it takes a boolean "masked out" array with everything folded in.
  masked = ~flax_backend.attention_mask(segment_ids, window, t)  # [B|1, 1, T, T]
  masked = jnp.broadcast_to(masked, (b, 1, t, t))
  mod = te.flax.DotProductAttention(attn_mask_type="padding_causal", qkv_layout="bshd_bshd_bshd",
                                    **common)
  return mod(q, k, v, masked, deterministic=False)


def _context_parallel(te, q, k, v, segment_ids, positions, window, max_segments, strategy, cp, common):
  """Attention with the length split over mesh axis cp = (name, size), the tokens in the order
  `context.layout` gives (the step reordered them). On a GPU in bf16/fp16, cuDNN's fused attention with TE's
  context parallelism: unpacked rows without a window in TE's BSHD layout (dual-chunk order), packed rows
  or a window in its THD layout (striped order: TE's module takes no stripe size, so its function is
  called). Elsewhere TE's unfused path with the mask from segment ids and positions, which XLA partitions."""
  b, t = q.shape[:2]
  packed = segment_ids is not None or bool(window)
  strategy = context.resolve_strategy(strategy, cp[1], t, packed)
  if not (on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16)):
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids  # [B, T]
    masked = ~cp_attention.keep_mask(seg, positions, seg, positions, window)  # [B, 1, T, T]
    # the window is in the mask: TE's unfused path would add its own by index, wrong in the reordered order
    mod = te.flax.DotProductAttention(attn_mask_type="padding_causal", qkv_layout="bshd_bshd_bshd",
                                      **{**common, "window_size": None})
    return mod(q, k, v, masked, deterministic=False)
  cp_args = dict(context_parallel_causal_load_balanced=True, context_parallel_axis=cp[0])
  if not packed:
    mod = te.flax.DotProductAttention(attn_mask_type="causal", qkv_layout="bshd_bshd_bshd",
                                      context_parallel_strategy=strategy, **cp_args, **common)
    return mod(q, k, v, deterministic=False)
  from transformer_engine.jax import attention as tea  # noqa: PLC0415 - TE: only once chosen and set up
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)  # [B, T]
  desc = tea.SequenceDescriptor.from_segment_ids_and_pos(segment_ids, positions)
  lay = context.layout(strategy, cp[1], t, packed)
  return tea.fused_attn(
      (q, k, v), None, desc, None, attn_bias_type=tea.AttnBiasType.NO_BIAS,
      attn_mask_type=tea.AttnMaskType.PADDING_CAUSAL_MASK, qkv_layout=tea.QKVLayout.THD_THD_THD,
      softmax_type=tea.AttnSoftmaxType.VANILLA_SOFTMAX, scaling_factor=common["scale_factor"],
      dropout_probability=0.0, is_training=True, max_segments_per_seq=max_segments,
      window_size=common["window_size"], context_parallel_strategy=tea.CPStrategy[strategy.upper()],
      stripe_size=lay.stripe, **cp_args)


def no_quantization():
  """Run the enclosed TE modules unquantized, keeping the current mesh resource."""
  te = import_te()
  from transformer_engine.jax.sharding import global_mesh_resource  # noqa: PLC0415 - TE: only once chosen and set up
  return te.autocast(enabled=False, mesh_resource=global_mesh_resource())
