"""The 1F1B pipeline schedule (`train.pipeline_schedule=1f1b`): one forward and one backward per tick, so that a
stage holds the activations of at most 2 S - 1 micro-batches (maxlm/parallel/schedules.py), not all M.

JAX differentiates a loop by running it forward and then its transpose backward: every forward before any
backward, which is GPipe's memory. Here the backward is written into the forward: `pipeline_loss` is a custom_vjp
whose forward rule runs the 1F1B ticks and returns, with the loss, its gradients (of the stack, the tail's
parameters and the stack's input); the backward rule only scales them by the loss's cotangent. Each tick:

  forward phase   every stage applies its K = L / S layers to the micro-batch it holds (the first stage takes a
                  fresh one); the stage's input is kept in its slot of a ring of R = min(M, 2 S - 1); the last
                  stage's output goes through the tail (final norm, head, loss), whose vjp gives its cotangent;
  backward phase  every stage recomputes its layers from the kept input of the micro-batch whose cotangent it
                  holds (the last stage: the tail's, this tick) and takes their vjp: the layers' gradient, added to
                  the stage's sum, and the input's cotangent, handed to the stage before.

Stages are the vmapped axis of the stack [S, 1, K, ...], which the mesh splits over `pipeline` (as GPipe's), and
activations and cotangents move one stage on per tick (rolls: collective-permutes). Residuals live only inside
one stage's backward of one micro-batch (what `model.remat` keeps of K layers); between ticks a stage keeps R
inputs [B/M, T, D]. The price: a stage's forward runs twice per micro-batch (once in each phase), as under
model.remat=full. The tail runs once per micro-batch, on the last stage's output only. Phases where a stage has
no micro-batch compute on stale inputs whose results are masked out (vmapped stages run one program).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxlm.parallel.pipelining import AXIS, STAGE_BTD, micro_batches, pipeline_stack, stage_stack, whole_batch


def _on(stage_mask, new, old):
  """Per stage [S, ...]: `new` where stage_mask [S], else `old`."""
  return jnp.where(stage_mask.reshape(-1, *([1] * (new.ndim - 1))), new, old)


def _last(x, stage, n_stages):
  """The last stage's [B/M, T, D] on every pipeline device: a masked sum over the stage axis (exact)."""
  return jnp.sum(_on(stage == n_stages - 1, x, jnp.zeros_like(x)), axis=0)


def _read(ring, slot):
  """Per stage: ring [S, R, ...] at slot [S] -> [S, ...] (each stage its own slot: no data moves)."""
  return jax.vmap(lambda r, i: jax.lax.dynamic_index_in_dim(r, i, keepdims=False), spmd_axis_name=AXIS)(ring, slot)


def _write(ring, slot, new, ok):
  """Per stage: `new` [S, ...] into slot [S] of ring [S, R, ...] where ok [S]; elsewhere the ring as it was."""
  def one(r, i, v, o):
    return jax.lax.dynamic_update_index_in_dim(r, jnp.where(o, v, jax.lax.dynamic_index_in_dim(r, i, keepdims=False)),
                                               i, 0)
  return jax.vmap(one, spmd_axis_name=AXIS)(ring, slot, new, ok)


def pipeline_loss(layer: Callable, tail: Callable, params, tail_params, x, positions, segment_ids, tail_args, *,
                  stages: int, microbatches: int, axes=None, gather: bool = False):
  """(loss, count) = the sum over micro-batches of tail(tail_params, stack(x_i), *tail_args_i), the stack being
  `layer` scanned over the L layers of `params` (every leaf [L, ...]), run as S = `stages` 1F1B stages over M =
  `microbatches` micro-batches. Differentiable in params, tail_params and x (once: the gradients are formed in
  the forward pass). tail(tp, h [B/M, T, D], *args) -> (loss, count); tail_args: arrays [B, ...] cut into
  micro-batches as x is; positions, segment_ids (or None) [B, T]; axes, gather: pipelining.stage_stack's."""
  @jax.custom_vjp
  def run(params, tail_params, x, positions, segment_ids, tail_args):  # undifferentiated (eval): GPipe's forward
    h = pipeline_stack(layer, params, x, positions, segment_ids, stages=stages, microbatches=microbatches,
                       axes=axes, gather=gather)  # [B, T, D]
    return tail(tail_params, h, *tail_args)

  def fwd(params, tail_params, x, positions, segment_ids, tail_args):
    out, grads = _ticks(layer, tail, params, tail_params, x, positions, segment_ids, tail_args, stages,
                        microbatches, axes, gather)
    return out, grads

  def bwd(grads, cot):
    g = cot[0].astype(jnp.float32)  # the loss's cotangent; the count's has no effect
    scaled = jax.tree_util.tree_map(lambda a: (a.astype(jnp.float32) * g).astype(a.dtype), grads)
    return (*scaled, None, None, None)
  run.defvjp(fwd, bwd)
  return run(params, tail_params, x, positions, segment_ids, tail_args)


def _unstage(grads, params):
  """The inverse of stage_stack for V = 1: [S, 1, K, ...] -> [L, ...] in the parameters' dtypes."""
  return jax.tree_util.tree_map(lambda g, p: g.reshape(p.shape).astype(p.dtype), grads, params)


def _ticks(layer, tail, params, tail_params, x, positions, segment_ids, tail_args, n_stages, m, axes, gather):
  """The 1F1B tick loop: ((loss, count), (d params, d tail_params, d x))."""
  ring = min(m, 2 * n_stages - 1)
  staged = stage_stack(params, n_stages, 1, axes, gather)  # [S, 1, K, ...]
  xs, pos = micro_batches(x, m), micro_batches(positions, m)  # [M, B/M, T, D], [M, B/M, T]
  seg = None if segment_ids is None else micro_batches(segment_ids, m)
  targs = jax.tree_util.tree_map(lambda a: micro_batches(a, m), tail_args)
  stage = jnp.arange(n_stages)  # [S]

  def stage_fwd(p, h, pos_s, seg_s):  # one stage's K layers over one micro-batch
    def one(carry, p_layer):
      return layer(p_layer, carry, pos_s, seg_s), None
    return jax.lax.scan(one, h, jax.tree_util.tree_map(lambda a: a[0], p))[0]

  def stage_bwd(p, h, pos_s, seg_s, ct):  # recompute, then the vjp: (d p, d h)
    return jax.vjp(lambda p, h: stage_fwd(p, h, pos_s, seg_s), p, h)[1](ct)

  seg_axis = None if seg is None else 0
  fwd_all = jax.vmap(stage_fwd, in_axes=(0, 0, 0, seg_axis), spmd_axis_name=AXIS)
  bwd_all = jax.vmap(stage_bwd, in_axes=(0, 0, 0, seg_axis, 0), spmd_axis_name=AXIS)

  def pick(a, i):  # per stage s, a[i[s]] ([S] indices into a [M, ...])
    return None if a is None else a[jnp.clip(i, 0, m - 1)]

  def forward(c, t):
    inputs = _on(stage == 0, jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), keepdims=False)[None],
                 jnp.roll(c["held"], 1, axis=0))  # [S, B/M, T, D]
    inputs = nn.with_logical_constraint(inputs, STAGE_BTD)
    mb = t - stage  # [S]
    ok = (mb >= 0) & (mb < m)
    kept = _write(c["kept"], jnp.mod(mb, ring), inputs, ok)  # [S, R, B/M, T, D]
    out = nn.with_logical_constraint(fwd_all(staged, inputs, pick(pos, mb), pick(seg, mb)), STAGE_BTD)
    return {**c, "held": out, "kept": kept}

  def tail_phase(c, t):  # the micro-batch t - S + 1 leaves the last stage: its loss and cotangent
    i = t - n_stages + 1
    args = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), targs)
    (loss, count), vjp = jax.vjp(lambda tp, h: tail(tp, h, *args), tail_params, _last(c["held"], stage, n_stages))
    d_tail, d_h = vjp((jnp.ones_like(loss), jnp.zeros_like(count)))
    add = jax.tree_util.tree_map(jnp.add, c["d_tail"], d_tail)
    return {**c, "loss": c["loss"] + loss, "count": c["count"] + count, "d_tail": add, "d_last": d_h}

  def backward(c, t):
    mb = t - 2 * (n_stages - 1) + stage  # [S]
    ok = (mb >= 0) & (mb < m)
    cot = nn.with_logical_constraint(_on(stage == n_stages - 1, c["d_last"][None], jnp.roll(c["cot"], -1, axis=0)),
                                     STAGE_BTD)
    h = nn.with_logical_constraint(_read(c["kept"], jnp.mod(mb, ring)), STAGE_BTD)
    d_p, d_h = bwd_all(staged, h, pick(pos, mb), pick(seg, mb), cot)
    d_p = jax.tree_util.tree_map(lambda s, d: s + _on(ok, d, jnp.zeros_like(d)).astype(s.dtype), c["d_p"], d_p)
    d_h = nn.with_logical_constraint(d_h, STAGE_BTD)
    first = t - 2 * (n_stages - 1)  # stage 0's micro-batch: its input's cotangent is the stack's
    at = jnp.clip(first, 0, m - 1)
    d_x = jax.lax.dynamic_update_index_in_dim(
        c["d_x"], jnp.where(first >= 0, d_h[0], jax.lax.dynamic_index_in_dim(c["d_x"], at, keepdims=False)), at, 0)
    return {**c, "cot": d_h, "d_p": d_p, "d_x": d_x}

  def phases(body_parts):
    def body(c, t):
      for part in body_parts:
        c = part(c, t)
      return c, None
    return body

  zeros_s = nn.with_logical_constraint(jnp.zeros((n_stages, *xs.shape[1:]), x.dtype), STAGE_BTD)
  c = {"held": zeros_s, "cot": zeros_s, "d_last": jnp.zeros(xs.shape[1:], x.dtype),
       "kept": jnp.zeros((n_stages, ring, *xs.shape[1:]), x.dtype),
       "d_p": jax.tree_util.tree_map(jnp.zeros_like, staged), "d_tail": jax.tree_util.tree_map(jnp.zeros_like,
                                                                                                tail_params),
       "d_x": jnp.zeros_like(xs), "loss": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.float32)}
  warm, steady = n_stages - 1, m
  c = jax.lax.scan(phases([forward]), c, jnp.arange(warm))[0]
  c = jax.lax.scan(phases([forward, tail_phase, backward]), c, warm + jnp.arange(steady))[0]
  c = jax.lax.scan(phases([backward]), c, warm + steady + jnp.arange(warm))[0]
  grads = (_unstage(c["d_p"], params), c["d_tail"], whole_batch(c["d_x"]).astype(x.dtype))
  return (c["loss"], c["count"]), grads
