"""Pure train / eval steps: loss in fp32, gradient accumulation, clipping, non-finite handling.

The jitted train step takes explicit in/out shardings and donates the state. TE's FP8 state
(`model_state`, e.g. `fp8_metas`) is differentiated alongside the params: its "gradient" is the
updated state, which replaces the old one and never reaches the optimizer.

`model.loss_chunk` > 0: the model returns its final-normed hidden states and the head's kernel, and
`chunked_token_losses` applies the LM head and the cross-entropy chunk by chunk over the sequence, so
the [B, T, V] logits never exist. `model.precision=fp16`: the loss is scaled by the train state's
dynamic loss scale before differentiation (maxlm/loss_scale.py); an overflow skips the update.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from maxlm import moe_loss
from maxlm.config import ModelConfig
from maxlm.layers import moe
from maxlm.loss_scale import update_loss_scale
from maxlm.model import BTV, compute_dtype, matmul_cast
from maxlm.offload import in_host_memory, to_device_in_turn, to_device_memory, to_host_memory
from maxlm.optim import LAG, apply_updates
from maxlm.parallel import context
from maxlm.tables import PRECISIONS
from maxlm.train_state import TrainState



def token_losses(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Summed next-token NLL in fp32 over masked positions, and the count of those positions."""
  logits = logits.astype(jnp.float32)  # [B, T, V]
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
  mask = mask.astype(jnp.float32)  # [B, T]
  return jnp.sum((lse - target_logit) * mask), jnp.sum(mask)


def use_chunked_loss(cfg: ModelConfig) -> bool:
  """`model.loss_chunk` > 0: the head and the loss run chunk by chunk here, quantized or not."""
  return cfg.loss_chunk > 0


def fp8_chunked_head(cfg: ModelConfig) -> bool:
  """The chunked head runs its three GEMMs in FP8: `model.fp8_lm_head` under a quantized precision."""
  return use_chunked_loss(cfg) and cfg.fp8_lm_head and PRECISIONS[cfg.precision].quantized


# The chunked FP8 head (fp8=True below) quantizes like TE's HYBRID format: e4m3 for the hidden states and
# the kernel, e5m2 for the logits' gradient, and multiplies the FP8 arrays themselves (dot_general with FP8
# operands and a bf16 or fp32 result: cuBLASLt's FP8 GEMM on Hopper), then scales the result back. Every
# scale is a power of 2, so that is exact. The hidden states and the kernel are scaled by their current
# amax (one per step, over the whole tensor), the gradient by its bound: |softmax - onehot| <= 1 times the
# mask and the loss scale, so 2**15 * |d| / scale stays under e5m2's largest value 57344.
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
GRAD_HEADROOM = 2.0 ** 15


def pow2_scale(x: jax.Array, dtype) -> jax.Array:
  """The smallest power of 2 `s` with max|x| / s <= the largest finite value of `dtype` (fp32 scalar; 1 for an
  all-zero x). Exponents are compared, never the ratio formed, which would be subnormal for a tiny amax."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  big_mant, big_exp = math.frexp(float(jnp.finfo(dtype).max))  # e.g. e4m3's 448 = 0.875 * 2**9
  mant, exp = jnp.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
  exp = jnp.where(mant <= big_mant, exp - big_exp, exp - big_exp + 1)
  scale = jnp.ldexp(jnp.float32(1), jnp.clip(exp, -126, 127))  # exact: a normal fp32
  return jnp.where(amax > 0, scale, jnp.float32(1))


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """x / scale rounded to the FP8 `dtype` (saturating at its largest value)."""
  big = float(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -big, big).astype(dtype)


def _gemm(a, b, dims, out_dtype):
  """dot_general(a, b, dims) with a result in `out_dtype`; a and b are arrays in the compute dtype, or
  (FP8 array, fp32 power-of-2 scale) pairs, multiplied in FP8 and scaled back exactly."""
  if isinstance(a, tuple):
    (qa, sa), (qb, sb) = a, b
    out = jax.lax.dot_general(qa, qb, dims, preferred_element_type=out_dtype)
    return out * (sa * sb).astype(out_dtype)
  return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)


def chunked_token_losses(y: jax.Array, kernel: jax.Array, targets: jax.Array, mask: jax.Array, *, chunk: int,
                         vocab_axis: int, grad_scale: jax.Array | None = None,
                         fp8: bool = False) -> tuple[jax.Array, jax.Array]:
  """`token_losses` of the LM head's logits, computed `chunk` positions at a time.

  y: final-normed hidden states [B, T, D] (compute dtype); kernel: the head, [D, V] (vocab_axis=1) or the
  tied embedding [V, D] (vocab_axis=0). Only one chunk's logits [B, C, V] exist at a time, in the
  forward and the backward. The gradients (of the loss times `grad_scale`, the loss scale) are formed
  in the same pass, chunk by chunk (dW summed in fp32, then rounded to the compute dtype once, as the
  unchunked head does), and kept for the backward: no logits are recomputed, and the head costs the
  FLOPs of the unchunked one. fp8: the three GEMMs take FP8 operands (see E4M3 above).
  """
  mask = mask.astype(jnp.float32)  # [B, T]
  scale = jnp.ones((), jnp.float32) if grad_scale is None else grad_scale.astype(jnp.float32)
  return _chunked_loss(y, kernel, targets, mask, scale, chunk, vocab_axis, fp8), jnp.sum(mask)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
  """[B, T, ...] -> [N, B, C, ...] with N = ceil(T / C), zero-padded at the end."""
  b, t = x.shape[:2]
  n = -(-t // chunk)
  x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))  # [B, N*C, ...]
  return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)  # [N, B, C, ...]


def _head_operands(y, kernel, fp8: bool):
  """(the kernel as the chunk loop multiplies it, a function giving a chunk's y so): the kernel in the
  compute dtype, or (FP8, scale) pairs of both at their current power-of-2 scales. The kernel is cast or
  quantized once, outside the loop."""
  if not fp8:
    return kernel.astype(y.dtype), lambda y_c: y_c
  sy, sw = pow2_scale(y, E4M3), pow2_scale(kernel, E4M3)
  return (quantize(kernel, sw, E4M3), sw), lambda y_c: (quantize(y_c, sy, E4M3), sy)


def _chunk_nll(y, w, targets, mask, vocab_axis: int, dtype):
  """(summed NLL, fp32 logits [B, C, V], logsumexp [B, C]) of one chunk; logits rounded to the
  compute dtype first, as the model's head returns them."""
  logits = _gemm(y, w, (((2,), (1 - vocab_axis,)), ((), ())), dtype)  # [B, C, V]
  logits = nn.with_logical_constraint(logits, BTV).astype(jnp.float32)  # [B, C, V]
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, C]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, C]
  return jnp.sum((lse - target_logit) * mask), logits, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunked_loss(y, kernel, targets, mask, grad_scale, chunk, vocab_axis, fp8):
  w, as_multiplied = _head_operands(y, kernel, fp8)

  def body(total, xs):
    return total + _chunk_nll(as_multiplied(xs[0]), w, xs[1], xs[2], vocab_axis, y.dtype)[0], None
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (_chunks(y, chunk), _chunks(targets, chunk), _chunks(mask, chunk)))
  return total


def _chunked_loss_fwd(y, kernel, targets, mask, grad_scale, chunk, vocab_axis, fp8):
  w, as_multiplied = _head_operands(y, kernel, fp8)
  vocab = kernel.shape[vocab_axis]

  def body(carry, xs):
    total, dw = carry
    y_c, t_c, m_c = xs  # [B, C, D], [B, C], [B, C]
    y_c = as_multiplied(y_c)  # [B, C, D], or its (e4m3, scale)
    loss, logits, lse = _chunk_nll(y_c, w, t_c, m_c, vocab_axis, y.dtype)
    onehot = jnp.arange(vocab, dtype=t_c.dtype) == t_c[..., None]  # [B, C, V]
    # d(scaled loss)/d logits, rounded to the compute dtype as the logits' cotangent is unchunked
    d = (jnp.exp(logits - lse[..., None]) - onehot) * (m_c * grad_scale)[..., None]  # [B, C, V]
    if fp8:  # e5m2 at the scale its bound gives (see GRAD_HEADROOM)
      sd = grad_scale / GRAD_HEADROOM
      d = (nn.with_logical_constraint(quantize(d, sd, E5M2), BTV), sd)  # [B, C, V]
    else:
      d = nn.with_logical_constraint(d.astype(y.dtype), BTV)  # [B, C, V]
    dy = _gemm(d, w, (((2,), (vocab_axis,)), ((), ())), y.dtype)  # [B, C, D]
    if vocab_axis == 1:
      dw_c = _gemm(y_c, d, (((0, 1), (0, 1)), ((), ())), jnp.float32)  # [D, V]
    else:
      dw_c = _gemm(d, y_c, (((0, 1), (0, 1)), ((), ())), jnp.float32)  # [V, D]
    return (total + loss, dw + dw_c), dy

  zeros = jnp.zeros(kernel.shape, jnp.float32)  # [D, V] or [V, D]
  (total, dw), dy = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                 (_chunks(y, chunk), _chunks(targets, chunk), _chunks(mask, chunk)))
  b, t, d_model = y.shape
  dy = jnp.moveaxis(dy, 0, 1).reshape(b, -1, d_model)[:, :t]  # [B, T, D]
  # dW is rounded to the compute dtype once, as the unchunked head's GEMM returns it (and as it is
  # when the kernel comes in already cast: model.cast_params_once)
  return total, (dy, dw.astype(y.dtype).astype(kernel.dtype), grad_scale)


def _chunked_loss_bwd(chunk, vocab_axis, fp8, res, g):
  del chunk, vocab_axis, fp8
  dy, dw, grad_scale = res
  f = g / grad_scale  # 1 when the loss is differentiated with the scale passed in (the train step)
  return ((dy.astype(jnp.float32) * f).astype(dy.dtype), (dw * f).astype(dw.dtype), None, None, None)


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)


def load_balanced(batch: dict, model: nn.Module, packed: bool) -> dict:
  """The batch's [B, T] arrays in the load-balanced order of context parallelism (maxlm/parallel/context.py)
  where the current mesh splits the length, else as they are. The tokens' segment ids and positions move
  with them; the losses and token counts are sums over tokens, so nothing needs restoring after."""
  if context.axis() is None:
    return batch
  lay = context.current_layout(model.context_strategy, batch["inputs"].shape[1],
                               packed or bool(model.cfg.sliding_window))  # packed as the attention sees it
  return {k: context.reorder(v, lay) for k, v in batch.items()}


def _forward_loss(model: nn.Module, packed: bool):
  """`loss_fn(params, model_state, batch, grad_scale=None) -> (summed NLL, valid tokens)`, and with experts
  a third element: their statistics as maxlm/moe_loss.py sums them."""
  cfg = model.cfg
  chunked, experts = use_chunked_loss(cfg), moe_loss.enabled(cfg)
  onefoneb = getattr(model, "stages", 1) > 1 and getattr(model, "schedule", "gpipe") == "1f1b"

  def apply(variables, *args, **kw):
    if not experts:
      return model.apply(variables, *args, **kw), ()
    out, sown = model.apply(variables, *args, mutable=[moe.COLLECTION], **kw)
    return out, (moe.sown_stats(sown[moe.COLLECTION]),)

  def loss_fn(params, model_state, batch, grad_scale=None):
    batch = load_balanced(batch, model, packed)
    seg = batch["segment_ids"] if packed else None
    variables = {"params": params, **model_state}
    mask = batch["segment_ids"] > 0  # [B, T]
    if onefoneb:  # the pipeline applies the head and the loss to each micro-batch itself (grad_scale: fp16, refused)
      return model.apply(variables, batch["inputs"], batch["positions"], seg, loss=token_losses,
                         targets=batch["targets"], mask=mask)
    if chunked:
      (y, kernel), stats = apply(variables, batch["inputs"], batch["positions"], seg, hidden=True)  # [B, T, D]
      loss, n = chunked_token_losses(y, kernel, batch["targets"], mask, chunk=cfg.loss_chunk,
                                     vocab_axis=0 if cfg.tie_embeddings else 1, grad_scale=grad_scale,
                                     fp8=fp8_chunked_head(cfg))
    else:
      logits, stats = apply(variables, batch["inputs"], batch["positions"], seg)  # [B, T, V]
      loss, n = token_losses(logits, batch["targets"], mask)
    return (loss, n, *(moe_loss.sums(s, n) for s in stats))
  return loss_fn


def _select(pred, a, b):
  """jnp.where(pred, a, b) computed on the device: leaves in host memory (optim.offload) are moved there first
  and the result back after (XLA:GPU would otherwise run the select as host compute)."""
  if in_host_memory((a, b)):
    return to_host_memory(jnp.where(pred, *to_device_memory((a, b))))
  return jnp.where(pred, a, b)


def forward_params(params, cfg: ModelConfig, cast_once: bool, host_params: bool):
  """The parameters as the forward and backward passes read them. model.cast_params_once: the matmul weights
  enter the model already in the compute dtype (their per-use casts become no-ops); the gradients come back in
  that dtype and return to the master weights' dtype in the step, as the per-use casts' transposes would have
  done. Parameters in host memory (optim.offload=host_params) come to the device in turn, each leaf moved first
  and then cast (whatever model.cast_params_once says: the same numbers; the device holds the compute-dtype copy,
  not the master weights, and only LAG leaves as they were in host memory at once); under a quantized precision
  (FP8: its GEMMs quantize the master weights) they are moved as they are."""
  quantized = PRECISIONS[cfg.precision].quantized
  cast = (matmul_cast(compute_dtype(cfg), cfg) if cast_once or (host_params and not quantized)
          else (lambda path, x: x))
  if host_params:
    return to_device_in_turn(params, cast, LAG)
  return jax.tree_util.tree_map_with_path(cast, params)


# The train step is composed of parts, each a plain function tested alone (tests/test_step.py):
#   loss_and_grad   the one pure loss-and-gradient function (the loss scaled by an fp16 loss scale, when given)
#   accumulated     the same over train.grad_accum micro-batches, one after the other (lax.scan), summed
#   averaged        the sums over the tokens, a loss scale undone
#   guarded_update  the optimizer's update where the step is finite, else the state as it was ("cond", the run's;
#                   "select", a what-if for the planner's measurements: a parameter of build_step)
# and forward_params (the parameters as forward and backward read them: cast once, or brought from host memory).
# A pipelined model (maxlm/parallel/pipelining.py) cuts the batch into its micro-batches itself: in flight together, not
# accumulated one after the other.


def loss_and_grad(model: nn.Module, packed: bool) -> Callable:
  """`fn(cparams, model_state, batch, scale, master) -> ((grads, new_model_state), (loss_sum, count))`: the summed
  next-token loss of `batch` and its gradients with respect to `cparams` (the parameters as the passes read them)
  and the model's state (TE's FP8 state: its "gradient" is its update), the loss times `scale` where one is given
  (fp16), each gradient in its master parameter's dtype (`master`: the train state's params). With experts the
  loss differentiated includes their weighted auxiliary losses, and a third output holds their statistics
  (maxlm/moe_loss.py)."""
  loss_fn = _forward_loss(model, packed)

  def summed(p, s, b, scale):
    out = loss_fn(p, s, b, scale)
    loss = out[0] if len(out) == 2 else out[0] + moe_loss.objective(model.cfg, out[2])
    return loss if scale is None else loss * scale, out
  grad_fn = jax.grad(summed, argnums=(0, 1), has_aux=True)

  def fn(cparams, model_state, batch, scale, master):
    (g, new_s), aux = grad_fn(cparams, model_state, batch, scale)
    return (jax.tree_util.tree_map(lambda gi, pi: gi.astype(pi.dtype), g, master), new_s), aux
  return fn


def accumulated(fn: Callable, grad_accum: int, host_params: bool, aux_zeros: tuple | None = None) -> Callable:
  """`fn` (loss_and_grad's form) over `grad_accum` micro-batches of the batch, one after the other: gradients,
  losses and token counts (and any further outputs: `aux_zeros`, maxlm/moe_loss.py `zeros`) summed, the model's
  state threaded through; `fn` itself for one. The gradient sum lives in device memory (host_params: shaped as
  the parameters on the device, in the master dtype)."""
  if grad_accum == 1:
    return fn
  aux_zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)) if aux_zeros is None else aux_zeros

  def acc(cparams, model_state, batch, scale, master):
    def one(carry, mb):
      grad_sum, ms, aux_sum = carry
      (g, new_ms), aux = fn(cparams, ms, mb, scale, master)
      return (jax.tree_util.tree_map(jnp.add, grad_sum, g), new_ms, jax.tree_util.tree_map(jnp.add, aux_sum, aux)
              ), None
    zeros = (jax.tree_util.tree_map(lambda c, p: jnp.zeros_like(c, p.dtype), cparams, master) if host_params
             else jax.tree_util.tree_map(jnp.zeros_like, master))  # in device memory
    micro_batches = jax.tree_util.tree_map(
        lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)  # [A, B/A, T]
    (grad_sum, new_ms, aux_sum), _ = jax.lax.scan(one, (zeros, model_state, aux_zeros), micro_batches)
    return (grad_sum, new_ms), aux_sum
  return acc


def averaged(grad_sum, loss_sum, count, scale):
  """(gradients, loss, tokens) per token: the sums over the tokens divided by their count (at least 1), a loss
  scale undone (it is a power of 2: exact); each gradient keeps its dtype (bf16 master weights too)."""
  count = jnp.maximum(count, 1.0)
  denom = count if scale is None else count * scale  # fp32
  return jax.tree_util.tree_map(lambda g: (g / denom).astype(g.dtype), grad_sum), loss_sum / count, count


def guarded_update(optimizer: optax.GradientTransformation, guard: str = "cond") -> Callable:
  """`update(finite, grads, params, opt_state, new_model_state, model_state) -> (params, opt_state, model_state)`:
  the optimizer's update and the model's new state where `finite`, else all three as they were. guard "cond": a
  conditional (the skip costs nothing when the update is finite; a select reads and writes the params and both
  Adam moments once more); "select": both branches, chosen leaf by leaf (the planner's what-if, maxlm/plan/
  standins.py `for_gpu_step`: what XLA:GPU's memory would be if it kept no copy under the conditional)."""
  if guard not in ("cond", "select"):
    raise ValueError(f"guard must be cond or select, got {guard!r}")

  def update(finite, grads, params, opt_state, new_model_state, model_state):
    def apply(_):
      return (*apply_updates(optimizer, grads, opt_state, params), new_model_state)

    def skip(_):
      return params, opt_state, model_state
    if guard == "select":
      return jax.tree.map(lambda a, b: _select(finite, a, b), apply(None), skip(None))
    return jax.lax.cond(finite, apply, skip, None)
  return update


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    *, grad_accum: int = 1, packed: bool = False, guard: str = "cond") -> Callable:
  """`step(state, batch) -> (state, metrics)`; batch arrays are [B, T] with B = global batch: the parts above,
  composed. guard: `guarded_update`'s."""
  cfg = model.cfg
  cast_once = cfg.cast_params_once and not PRECISIONS[cfg.precision].quantized  # GEMMs all in the compute dtype
  pipelined = getattr(model, "stages", 1) > 1  # its micro-batches are the pipeline's (see the comment above)
  grads_of, update = loss_and_grad(model, packed), guarded_update(optimizer, guard)

  def step(state: TrainState, batch):
    params = state.params  # optim.offload=host_params: in host memory, read and rewritten by the streamed update
    ls = state.loss_scale  # fp16: differentiate loss * scale (maxlm/loss_scale.py); else None
    scale = None if ls is None else ls.scale
    host_params = in_host_memory(params)
    cparams = forward_params(params, cfg, cast_once, host_params)
    fn = accumulated(grads_of, 1 if pipelined else grad_accum, host_params, moe_loss.zeros(cfg))
    (grad_sum, new_model_state), (loss_sum, count, *experts) = fn(cparams, state.model_state, batch, scale, params)
    grads, loss, count = averaged(grad_sum, loss_sum, count, scale)
    grad_norm = optax.tree.norm(grads)
    loss_finite, grads_finite = jnp.isfinite(loss), jnp.isfinite(grad_norm)
    finite = loss_finite & grads_finite
    new_params, new_opt_state, new_model_state = update(finite, grads, params, state.opt_state, new_model_state,
                                                        state.model_state)
    # Under loss scaling an overflow of the scaled gradients (finite loss) is the scale's business: it
    # halves and counts the skip in overflow_steps. Only a non-finite loss counts as a non-finite step.
    nonfinite = ~finite if ls is None else ~loss_finite
    new_ls = None if ls is None else update_loss_scale(ls, loss_finite, grads_finite)
    new_state = state.replace(
        step=state.step + 1, params=new_params, opt_state=new_opt_state, model_state=new_model_state,
        nonfinite_steps=state.nonfinite_steps + nonfinite.astype(jnp.int32), loss_scale=new_ls)
    metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step),
               "tokens": count, "finite": finite, "nonfinite_steps": new_state.nonfinite_steps}
    if new_ls is not None:
      metrics.update(loss_scale=new_ls.scale, overflow_steps=new_ls.overflow_steps)
    for sums in experts:  # a mixture of experts: its losses and load (maxlm/moe_loss.py)
      metrics.update(moe_loss.metrics(cfg, sums, count))
    return new_state, metrics

  return step


def make_eval_step(model: nn.Module, *, packed: bool = False) -> Callable:
  loss_fn = _forward_loss(model, packed)

  def step(state: TrainState, batch):
    loss, n, *_ = loss_fn(to_device_memory(state.params), state.model_state, batch)  # host_params: to the device first
    return {"loss_sum": loss, "tokens": n}
  return step
