"""Pure JAX/Flax layer backend: the same names, parameter trees and logical axes as `te_backend`.

Each function builds one submodule inside the calling `nn.compact` method and applies it, so the
parameters land at `<caller>/<name>/{scale,kernel,wi_kernel,wo_kernel}` in both backends.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from maxlm.layers import cp_attention
from maxlm.parallel import context

NORM_AXES = ("norm",)


def _rms(x: jnp.ndarray, scale: jnp.ndarray, eps: float) -> jnp.ndarray:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., D]
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _dot(x: jnp.ndarray, kernel: jnp.ndarray, n_contract: int) -> jnp.ndarray:
  dims = ((tuple(range(x.ndim - n_contract, x.ndim)), tuple(range(n_contract))), ((), ()))
  return jax.lax.dot_general(x, kernel.astype(x.dtype), dims)


def _norm(module: nn.Module, x: jnp.ndarray) -> jnp.ndarray:
  """RMSNorm with the module's `scale` parameter [D] (TE's name and axes)."""
  scale = module.param("scale", nn.with_logical_partitioning(nn.initializers.ones, NORM_AXES),
                       (x.shape[-1],), module.param_dtype)
  return _rms(x, scale, module.eps)


class _RMSNorm(nn.Module):
  eps: float
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    return _norm(self, x)


class _NormDense(nn.Module):
  features: tuple[int, ...]
  kernel_axes: tuple[str, ...]
  eps: float
  param_dtype: Any
  kernel_init: Callable

  @nn.compact
  def __call__(self, x):
    y = _norm(self, x)  # [..., D]
    kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
                        (x.shape[-1], *self.features), self.param_dtype)  # [D, *F]
    return _dot(y, kernel, 1)  # [..., *F]


class _Dense(nn.Module):
  features: tuple[int, ...]
  axis: tuple[int, ...]
  kernel_axes: tuple[str, ...]
  param_dtype: Any
  kernel_init: Callable

  @nn.compact
  def __call__(self, x):
    axis = tuple(a % x.ndim for a in self.axis)
    assert axis == tuple(range(x.ndim - len(axis), x.ndim)), "contract trailing axes only"
    kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
                        (*(x.shape[a] for a in axis), *self.features), self.param_dtype)
    return _dot(x, kernel, len(axis))  # [..., *F]


class _NormMLP(nn.Module):
  ffn_dim: int
  eps: float
  param_dtype: Any
  kernel_init: Callable

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    y = _norm(self, x)  # [..., D]
    wi = self.param("wi_kernel", nn.with_logical_partitioning(self.kernel_init, ("embed", "act", "mlp")),
                    (d, 2, self.ffn_dim), self.param_dtype)  # [D, 2, F]
    wo = self.param("wo_kernel", nn.with_logical_partitioning(self.kernel_init, ("mlp", "embed")),
                    (self.ffn_dim, d), self.param_dtype)  # [F, D]
    h = checkpoint_name(_dot(y, wi, 1), "ffn1")  # [..., 2, F]
    act = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]  # [..., F]
    return checkpoint_name(_dot(act, wo, 1), "ffn2")  # [..., D]


def rms_norm(x, *, eps: float, param_dtype, name: str):
  return _RMSNorm(eps=eps, param_dtype=param_dtype, name=name)(x)


def norm_dense(x, *, features, kernel_axes, eps: float, param_dtype, kernel_init, name: str,
               quantize: bool = True):
  del quantize  # no quantization in this backend
  return _NormDense(features=tuple(features), kernel_axes=tuple(kernel_axes), eps=eps,
                    param_dtype=param_dtype, kernel_init=kernel_init, name=name)(x)


def dense(x, *, features, axis, kernel_axes, param_dtype, kernel_init, name: str, quantize: bool = True):
  del quantize
  return _Dense(features=tuple(features), axis=tuple(axis), kernel_axes=tuple(kernel_axes),
                param_dtype=param_dtype, kernel_init=kernel_init, name=name)(x)


def norm_mlp(x, *, ffn_dim: int, eps: float, param_dtype, kernel_init, name: str):
  return _NormMLP(ffn_dim=ffn_dim, eps=eps, param_dtype=param_dtype, kernel_init=kernel_init,
                  name=name)(x)


def attention_mask(segment_ids, window: int, length: int):
  """Boolean keep-mask [B|1, 1, T, T]: causal, same document, and within the sliding window."""
  q = jnp.arange(length)[:, None]  # [T, 1]
  k = jnp.arange(length)[None, :]  # [1, T]
  keep = k <= q  # [T, T]
  if window:
    keep &= q - k < window
  keep = keep[None, None]  # [1, 1, T, T]
  if segment_ids is not None:
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    keep = keep & (same & (segment_ids[:, :, None] > 0))[:, None]  # [B, 1, T, T]
  return keep


def attention(q, k, v, *, segment_ids=None, positions=None, window: int = 0, max_segments: int = 1,
              name: str = "attention", context_strategy: str = "auto"):
  """Causal GQA attention. q [B, T, H, Dh], k/v [B, T, KV, Dh] -> [B, T, H, Dh]. With the length split over a
  context axis, the pure-JAX context-parallel attention of maxlm/layers/cp_attention.py (`context_strategy`)."""
  del max_segments, name  # the mask carries the document structure here
  t, dtype = q.shape[1], q.dtype
  if dtype == jnp.float16 and jax.default_backend() == "cpu":
    # XLA:CPU has no float16 dot with float32 accumulation (what dot_product_attention asks for):
    # compute in float32 there, as the accumulation would be anyway.
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  cp = context.axis()
  if cp is not None:
    strategy = context.resolve_strategy(context_strategy, cp[1], t, segment_ids is not None or bool(window))
    return cp_attention.attention(q, k, v, segment_ids, positions, window=window, strategy=strategy, name=cp[0],
                             cp=cp[1]).astype(dtype)
  if segment_ids is None and not window:
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H, Dh]
  else:
    out = jax.nn.dot_product_attention(q, k, v, mask=attention_mask(segment_ids, window, t))
  return out.astype(dtype)


def no_quantization():
  return contextlib.nullcontext()
