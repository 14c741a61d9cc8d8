"""Stand-ins for measuring a GPU's train step on XLA:CPU (maxlm/plan/measure.py, simulated devices): fused
attention's memory footprint in place of CPU attention's [B, H, T, T] scores, and bf16 kept as bf16 where
XLA:CPU would compute it (and gather FSDP's weights) in f32. Measurements only: these programs are never run.

Where the activations' length is split over a context axis (maxlm/parallel/context.py), the attention stand-in
runs in the same shard_map and makes the same exchange as the pure-JAX context-parallel attention (context.py's
`gather_exchange`, `ring_exchange`: the same collectives on K, V, segment ids and positions, the same dtypes
and shapes, forward and backward), so a planned program compiles the context traffic and its buffers; only the
local compute is the stand-in's (fused attention's footprint: no [B, H, T, T] scores).

`for_gpu_step` gives them to the builder (maxlm/build.py): the attention stand-in and the remat policies that
keep the rounded GEMM results go through the model (`maxlm.model.Overrides`), the bf16 GEMMs through
`gpu_dot_dtypes`, entered while the step is traced.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax._src.lax import lax as _lax_internal  # jnp.dot and jnp.matmul call its dot_general
from jax.ad_checkpoint import checkpoint_name

from maxlm.build import Standins
from maxlm.parallel import context
from maxlm.model import Overrides


@jax.custom_vjp
def _fused_standin(q, k, v):
  return _standin_fwd(q, k, v)[0]


def _standin_fwd(q, k, v):
  """Same inputs, output and residuals as a fused attention kernel; not attention's values."""
  g = q.shape[2] // k.shape[2]
  s = jnp.sum(q.astype(jnp.float32) * jnp.repeat(k, g, axis=2), axis=-1)  # [B, T, H]
  out = (jnp.repeat(v, g, axis=2) * jax.nn.sigmoid(s)[..., None]).astype(q.dtype)  # [B, T, H, Dh]
  stats = jnp.moveaxis(s, 1, 2)  # [B, H, T] fp32, as cuDNN's softmax statistics
  return out, (q, k, v, out, stats)


def _standin_bwd(res, d_out):
  q, k, v, _, stats = res
  b, t, kv, dh = k.shape
  g = q.shape[2] // kv
  w = jax.nn.sigmoid(jnp.moveaxis(stats, 2, 1))[..., None]  # [B, T, H, 1]
  dw = d_out.astype(jnp.float32) * w  # [B, T, H, Dh]
  dq = (dw * jnp.repeat(k, g, axis=2)).astype(q.dtype)  # [B, T, H, Dh]
  dk = (dw * q).reshape(b, t, kv, g, dh).sum(3).astype(k.dtype)  # [B, T, KV, Dh]
  dv = dw.reshape(b, t, kv, g, dh).sum(3).astype(v.dtype)  # [B, T, KV, Dh]
  return dq, dk, dv


_fused_standin.defvjp(_standin_fwd, _standin_bwd)


def standin_attention(q, k, v, *, segment_ids=None, positions=None, window: int = 0,
                      context_strategy: str = "auto", **_):
  """`attention` of a layer backend, with fused attention's memory footprint (see the module doc); where the
  length is split over a context axis, with the context-parallel attention's exchange."""
  cp = context.axis()
  if cp is None:
    return _fused_standin(q, k, v)  # [B, T, H, Dh]
  b, t = q.shape[:2]
  strategy = context.resolve_strategy(context_strategy, cp[1], t, segment_ids is not None or bool(window))
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)  # [B, T]
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
  fn = functools.partial(_ring_standin if strategy == "ring" else _gathered_standin, name=cp[0], cp=cp[1])
  return context.sharded(fn, cp[0], q, k, v, segment_ids, positions)


def _gathered_standin(q, k, v, seg, pos, *, name: str, cp: int):
  """The all-gather strategy's exchange (K/V gathered in their dtype, their gradients reduce-scattered in
  float32), the gathered blocks summed to the local length for the stand-in (its gradient a broadcast)."""
  kg, vg, sg, pg = context.gather_exchange(k, v, seg, pos, name, dtype=k.dtype)  # [B, T, KV, Dh], [B, T]
  def fold(a):  # [B, T, ...] -> [B, T / cp, ...]
    return a.reshape(a.shape[0], cp, -1, *a.shape[2:]).sum(1)

  keep = jnp.any((sg.reshape(sg.shape[0], cp, -1) > 0) & (pg.reshape(pg.shape[0], cp, -1) >= 0), axis=1)
  out = _fused_standin(q, fold(kg), fold(vg))  # [B, T / cp, H, Dh]
  return jnp.where(keep[..., None, None], out, jnp.zeros((), out.dtype))


def _ring_standin(q, k, v, seg, pos, *, name: str, cp: int):
  """The ring strategy's exchange (cp - 1 passes of the K/V block with its segment ids and positions), the
  stand-in run on each block in turn."""
  def step(acc, s, k_blk, v_blk, seg_k, pos_k):
    del s
    keep = (seg_k > 0) & (pos_k >= 0)  # [B, T / cp]: the passed ids used, as the real mask uses them
    part = jnp.where(keep[..., None, None], _fused_standin(q, k_blk, v_blk), jnp.zeros((), q.dtype))
    return part if acc is None else acc + part

  return context.ring_exchange(step, None, (k, v, seg, pos), name, cp)  # [B, T / cp, H, Dh]


def for_gpu_step(gpu_dtypes: bool, guard_select: bool = False) -> Standins:
  """The stand-ins of a GPU's step measured on XLA:CPU: fused attention's footprint; with gpu_dtypes (simulated
  CPU devices) also bf16 kept, and the remat policies keeping the rounded GEMM results. guard_select: the step's
  non-finite guard as a select of both branches rather than a cond, a what-if for measuring with jax 0.10's
  XLA:GPU, which keeps a copy of the donated state under a cond where jax 0.11.2's updates it in place
  (docs/plan.md: compiled so on 0.10.2, the 8B's peaks were within -5.3% to +1.8% of an H200's on 0.11.2 without
  accumulation, and 12-38% low with 2 to 8 micro-batches)."""
  return Standins(Overrides(attention=standin_attention, policy=_saving_sim_dots if gpu_dtypes else None),
                  scope=functools.partial(gpu_dot_dtypes, gpu_dtypes), guard="select" if guard_select else "cond")


# XLA:CPU has no bf16 arithmetic: its pass float-normalization-bf16 rewrites every bf16 instruction it does not
# support (on the CPU: all but dots a library runs; collectives included) to f32 between converts, which the
# algebraic simplifier then drops. FSDP's bf16 weight all-gathers so became f32 ones (70B, 2 layers, 8 simulated
# devices: all 9, the gathered LM head f32[8192,128256], 3.9 GiB, where XLA:GPU gathers bf16), and most bf16
# activations f32. --xla_allow_excess_precision=false does not help (the same 9 f32 gathers, the same bytes: the
# pass itself makes them f32). So a simulated step (measured for a GPU on XLA:CPU; the program is never run) is
# compiled without that pass (bf16 stays bf16, as XLA:GPU, which supports bf16 nearly everywhere, keeps it).
# XLA:CPU's dot emitter has no bf16, so each GEMM with a bf16 result is traced as a bf16 x bf16 -> f32 dot
# and a convert to bf16 (cuBLAS's f32 accumulation; its result is f32 until the convert: a transient XLA:GPU
# does not hold) and run by YNNPACK (individual_dot), which takes the bf16 operands as they are (without it,
# XLA's operand upcaster makes f32 copies of them). The remat policies that save dots save the bf16 result,
# as on the GPU, not the f32 dot. Measured (docs/plan.md, "Simulated H200s"): the 70B cut to 2 layers on 8
# simulated devices, 71.6 -> 44.2 GiB per device and the 9 weight all-gathers bf16; the 8B cut to 4 layers on
# one device against XLA:GPU on an H200, every remat policy, 29-67% high before, 13.5-22% high after.
GPU_DTYPE_OPTIONS = {"xla_disable_hlo_passes": "float-normalization-bf16",
                     "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
SIM_DOT = "maxlm_sim_dot"  # checkpoint name of a GEMM's bf16 result (no batch dimensions) in a simulated step
_LAX_DOT = jax.lax.dot_general
_MIXED = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}


def _gpu_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
  """`jax.lax.dot_general` whose bf16 result is an f32 dot rounded to bf16 (see GPU_DTYPE_OPTIONS). An f32 x
  bf16 -> f32 dot is JAX's transpose of such a dot (the bf16 cotangent of its f32 result, upcast): its f32
  operand is rounded back to the bf16 it is on the GPU (else XLA's upcast f32 copies of the bf16 one, a
  gathered weight among them, would be measured)."""
  out = jnp.result_type(lhs, rhs) if preferred_element_type is None else jnp.dtype(preferred_element_type)
  if preferred_element_type is not None and out == jnp.float32 and {lhs.dtype, rhs.dtype} == _MIXED:
    return _LAX_DOT(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dimension_numbers, precision, out, **kw)
  if out != jnp.bfloat16:
    return _LAX_DOT(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kw)
  y = _LAX_DOT(lhs, rhs, dimension_numbers, precision, jnp.float32, **kw).astype(jnp.bfloat16)
  batch = any(len(b) for b in dimension_numbers[1])
  return y if batch else checkpoint_name(y, SIM_DOT)


def _saving_sim_dots(policy):
  """A remat policy that keeps a SIM_DOT result exactly when it keeps a dot without batch dimensions."""
  if policy is None:
    return None

  def keep(prim, *args, **params):
    if getattr(prim, "name", None) == "name" and params.get("name") == SIM_DOT:
      return policy(jax.lax.dot_general_p, *args, dimension_numbers=(((), ()), ((), ())))
    return policy(prim, *args, **params)
  return keep


# Why JAX's dot_general is rebound while a simulated step is traced, not reached by a supported route: the GEMMs
# to change are called inside code maxlm does not own (TE's layers call jax.lax.dot_general themselves, jnp.dot and
# flax's `attend` call JAX's private lax.dot_general), JAX has no hook that substitutes one primitive for another
# in a traced function short of a jaxpr interpreter over every higher-order primitive (scan, cond, remat, pjit,
# custom_vjp), and XLA:CPU cannot compile the bf16 dot as it is (dot_op_emitter.cc: RET_CHECK on the element type,
# with float-normalization-bf16 disabled). A model flag reaches only maxlm's own GEMMs; the attention and the
# remat policy do go through the model (`for_gpu_step`). Issue 59 asked for the GEMMs to go through the model's
# overrides too (maxlm.model.Overrides, as attention and remat do): that reaches maxlm's own GEMMs only (the flax
# backend's dense, the LM head, the chunked loss's head), not those inside TE's layers (te_backend: norm_dense,
# norm_mlp), which the 8B's planned step (model.backend=auto -> te) is made of, so the rebinding would stay for
# them; kept whole here until JAX offers a primitive substitution (or TE a GEMM hook) that reaches them.


@contextlib.contextmanager
def gpu_dot_dtypes(enabled: bool = True):
  """While a step is traced: `jax.lax.dot_general` (what both layer backends and the LM head call; also as
  jax.numpy's dot and matmul call it, e.g. the tied head's `attend`) as `_gpu_dot` (measurements on XLA:CPU
  only)."""
  if enabled:
    jax.lax.dot_general = _lax_internal.dot_general = _gpu_dot
  try:
    yield
  finally:
    jax.lax.dot_general = _lax_internal.dot_general = _LAX_DOT
