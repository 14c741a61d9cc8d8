"""What `maxlm doctor` asks Transformer Engine (only maxlm/layers/ imports TE): is it importable, are its
GPU custom calls active, which cuDNN and CUDA does it load, and is cuDNN fused attention really selected
(and right) for a model's attention shape.
"""

from __future__ import annotations

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from maxlm.layers import flax_backend
from maxlm.layers.te_env import import_te, te_installed

FUSED_ATTN_TARGETS = ("te_fused_attn_forward", "te_fused_attn_backward")  # TE's FFI custom-call targets


def te_import_error() -> str | None:
  """None when TE imports; else why not (not installed, or the import's own error, e.g. an undefined
  symbol from a second cuDNN)."""
  if not te_installed():
    return "not installed"
  try:
    import_te()
  except Exception as e:  # noqa: BLE001 - any import failure is the finding
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


def te_version() -> str:
  import_te()  # the host set-up, and TE's package imported without its PyTorch half
  import transformer_engine  # noqa: PLC0415 - lazy on purpose: TE is optional
  return getattr(transformer_engine, "__version__", "unknown")


def te_library_versions() -> dict[str, int]:
  """cuDNN / CUDA / cuBLASLt versions as TE's extension reports them (ints as the libraries report)."""
  import_te()
  import transformer_engine_jax as tej  # noqa: PLC0415 - after import_te (CPU set-up)
  out = {}
  for key, fn in (("cudnn", "get_cudnn_version"), ("cuda", "get_cuda_version"), ("cublaslt", "get_cublasLt_version")):
    try:
      out[key] = int(getattr(tej, fn)())
    except Exception:  # noqa: BLE001 - without a driver some of these raise; report what answers
      pass
  return out


def custom_call_targets() -> list[str]:
  """The TE custom-call targets in the HLO of a jitted TE RMSNorm (forward + backward): empty when TE's
  GPU kernels are off (NVTE_JAX_CUSTOM_CALLS=false, or the CPU fallback) and it runs as plain JAX."""
  te = import_te()
  x = jnp.ones((2, 8, 64), jnp.bfloat16)  # [B, T, D]
  ln = te.flax.LayerNorm(layernorm_type="rmsnorm", epsilon=1e-5, dtype=jnp.float32)
  params = ln.init(jax.random.PRNGKey(0), x)

  def loss(p, x):
    return ln.apply(p, x).astype(jnp.float32).sum()

  # Compiled HLO: before SPMD partitioning TE's calls hide inside CustomSPMDPartitioning wrappers.
  text = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
  return sorted({t for t in custom_call_names(text) if t.startswith("te_")})


def custom_call_names(hlo_text: str) -> list[str]:
  """Custom-call targets in HLO text (`custom_call_target="name"`) or StableHLO (`custom_call @name(`)."""
  return re.findall(r'custom_call_target="([^"]+)"', hlo_text) + re.findall(r"custom_call @([\w.$-]+)", hlo_text)


def env_custom_calls() -> str | None:
  return os.environ.get("NVTE_JAX_CUSTOM_CALLS")


class _Attention(nn.Module):
  window: int
  max_segments: int

  @nn.compact
  def __call__(self, q, k, v, segment_ids, positions):
    from maxlm.layers import te_backend  # noqa: PLC0415 - after import_te
    return te_backend.attention(q, k, v, segment_ids=segment_ids, positions=positions, window=self.window,
                                max_segments=self.max_segments)


def _max_abs_diff(a, b) -> float:
  return float(max(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))) for x, y in zip(a, b)))


def probe_fused_attention(*, n_heads: int, n_kv_heads: int, head_dim: int, window: int, dtype: str,
                          max_segments: int, seq_len: int = 256, seed: int = 0) -> dict:
  """Forward + backward of the model's TE attention call (packed rows: two documents, the model's
  window, GQA ratio, head_dim and compute dtype) against the pure-JAX reference in float32.

  Returns selected (the compiled HLO calls cuDNN fused attention forward and backward), fallback_warning
  (TE said it falls back), and for outputs and gradients the largest error and its tolerance.
  Tolerance: the unfused XLA path in the same dtype is measured against the same fp32 reference;
  the fused kernel may be 4x worse (it rounds the softmax probabilities to the compute dtype in the
  forward and again in the backward pass), plus 2 unit roundoffs of the result's scale (so an exact
  baseline does not make the bound zero). A wrong mask, window or GQA mapping errs by O(1) of the
  result and fails by orders of magnitude.
  """
  import_te()
  dt = jnp.dtype(dtype)
  b, t = 1, seq_len
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n_heads, head_dim), jnp.float32).astype(dt)  # [B, T, H, Dh]
  k = jax.random.normal(keys[1], (b, t, n_kv_heads, head_dim), jnp.float32).astype(dt)  # [B, T, KV, Dh]
  v = jax.random.normal(keys[2], (b, t, n_kv_heads, head_dim), jnp.float32).astype(dt)  # [B, T, KV, Dh]
  cot = jax.random.normal(keys[3], (b, t, n_heads, head_dim), jnp.float32)  # [B, T, H, Dh]
  half = t // 2
  segment_ids = jnp.concatenate([jnp.ones((b, half), jnp.int32), jnp.full((b, t - half), 2, jnp.int32)], 1)  # [B, T]
  positions = jnp.concatenate([jnp.arange(half), jnp.arange(t - half)])[None].astype(jnp.int32)  # [1, T]
  positions = jnp.broadcast_to(positions, (b, t))  # [B, T]
  mod = _Attention(window=window, max_segments=max_segments)

  def te_loss(q, k, v):
    out = mod.apply({}, q, k, v, segment_ids, positions)  # [B, T, H, Dh]
    return (out.astype(jnp.float32) * cot).sum(), out

  def ref_loss(q, k, v):
    out = flax_backend.attention(q, k, v, segment_ids=segment_ids, window=window)  # [B, T, H, Dh]
    return (out.astype(jnp.float32) * cot).sum(), out

  te_fn = jax.jit(jax.grad(te_loss, argnums=(0, 1, 2), has_aux=True))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = te_fn.lower(q, k, v).compile()
    (dq, dk, dv), out = compiled(q, k, v)
  hlo = compiled.as_text()  # after partitioning: TE's own custom-call targets are visible
  fallback = any("unfused attention" in str(w.message) for w in caught)
  names = custom_call_names(hlo)
  selected = all(any(target in n for n in names) for target in FUSED_ATTN_TARGETS)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (rq, rk, rv), rout = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2), has_aux=True))(*f32)
  (bq, bk, bv), bout = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  u = float(jnp.finfo(dt).eps) / 2  # unit roundoff: 2**-8 for bfloat16
  out_scale = float(jnp.max(jnp.abs(rout)))
  grad_scale = max(float(jnp.max(jnp.abs(g))) for g in (rq, rk, rv))
  return {
      "selected": selected,
      "fallback_warning": fallback,
      "custom_calls": sorted({n for n in names if n.startswith("te_")}),
      "err_out": _max_abs_diff([out], [rout]),
      "tol_out": 4 * _max_abs_diff([bout], [rout]) + 2 * u * out_scale,
      "err_grad": _max_abs_diff((dq, dk, dv), (rq, rk, rv)),
      "tol_grad": 4 * _max_abs_diff((bq, bk, bv), (rq, rk, rv)) + 2 * u * grad_scale,
  }
