"""Pure train / eval steps: loss in fp32, gradient accumulation, clipping, non-finite handling.

The jitted train step takes explicit in/out shardings and donates the state. TE's FP8 state
(`model_state`, e.g. `fp8_metas`) is differentiated alongside the params: its "gradient" is the
updated state, which replaces the old one and never reaches the optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from maxlm.train_state import TrainState


def token_losses(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Summed next-token NLL in fp32 over masked positions, and the count of those positions."""
  logits = logits.astype(jnp.float32)  # [B, T, V]
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
  mask = mask.astype(jnp.float32)  # [B, T]
  return jnp.sum((lse - target_logit) * mask), jnp.sum(mask)


def _forward_loss(model: nn.Module, packed: bool):
  def loss_fn(params, model_state, batch):
    seg = batch["segment_ids"] if packed else None
    logits = model.apply({"params": params, **model_state}, batch["inputs"], batch["positions"], seg)
    return token_losses(logits, batch["targets"], batch["segment_ids"] > 0)
  return loss_fn


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    *, grad_accum: int = 1, packed: bool = False) -> Callable:
  """`step(state, batch) -> (state, metrics)`; batch arrays are [B, T] with B = global batch."""
  loss_fn = _forward_loss(model, packed)

  def step(state: TrainState, batch):
    params = state.params

    def summed(p, s, b):
      loss, n = loss_fn(p, s, b)
      return loss, (loss, n)

    vg = jax.grad(summed, argnums=(0, 1), has_aux=True)

    def one(carry, mb):
      grad_sum, model_state, loss_sum, count = carry
      (g, new_state), (loss, n) = vg(params, model_state, mb)
      return (jax.tree_util.tree_map(jnp.add, grad_sum, g), new_state, loss_sum + loss, count + n), None

    if grad_accum == 1:
      (grad_sum, new_model_state), (loss_sum, count) = vg(params, state.model_state, batch)
    else:
      zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
      carry = (zeros, state.model_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
      micro_batches = jax.tree_util.tree_map(
          lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)  # [A, B/A, T]
      (grad_sum, new_model_state, loss_sum, count), _ = jax.lax.scan(one, carry, micro_batches)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / count, grad_sum)
    loss = loss_sum / count
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    # A conditional rather than a select over every parameter: the skip costs nothing when the
    # update is finite (a select reads and writes params and both Adam moments once more).
    def apply_update(_):
      updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
      return optax.apply_updates(params, updates), new_opt_state, new_model_state

    def skip_update(_):
      return params, state.opt_state, state.model_state

    new_params, new_opt_state, new_model_state = jax.lax.cond(finite, apply_update, skip_update, None)
    new_state = state.replace(
        step=state.step + 1, params=new_params, opt_state=new_opt_state, model_state=new_model_state,
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32))
    metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step),
               "tokens": count, "finite": finite, "nonfinite_steps": new_state.nonfinite_steps}
    return new_state, metrics

  return step


def make_eval_step(model: nn.Module, *, packed: bool = False) -> Callable:
  loss_fn = _forward_loss(model, packed)

  def step(state: TrainState, batch):
    loss, n = loss_fn(state.params, state.model_state, batch)
    return {"loss_sum": loss, "tokens": n}
  return step


def jit_step(step: Callable, state_shardings, batch_shardings, scope: Callable[[], contextlib.AbstractContextManager],
             donate: bool = True, metrics_sharding=None) -> Callable:
  """Jit with explicit shardings; every call (hence every trace) runs inside `scope()`."""
  jitted = jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, metrics_sharding) if donate else metrics_sharding,
                   donate_argnums=(0,) if donate else ())

  def call(state, batch):
    with scope():
      return jitted(state, batch)
  return call
