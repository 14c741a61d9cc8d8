"""Dynamic loss scaling for `model.precision=fp16` (fp16 compute, fp32 master weights).

The train step differentiates loss * scale, so that small gradients stay representable in fp16, and
divides the gradients by the scale (in fp32) before clipping and the optimizer. A step whose
gradients overflow (Inf/NaN while the loss itself is finite) is skipped: the scale halves (down to
`model.fp16_min_scale`) and the skip is counted in `overflow_steps`, not as a non-finite step. After
`model.fp16_growth_interval` clean steps in a row the scale doubles (up to MAX_SCALE). A non-finite
*loss* is not the scale's doing (the forward pass overflowed or the data is bad): it is skipped and
counted as a non-finite step (`train.nonfinite`), and the scale stays.

The scale and its counters live in the train state (`TrainState.loss_scale`) and in checkpoints.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from maxlm.config import ModelConfig
from maxlm.tables import PRECISIONS

MAX_SCALE = 2.0 ** 24  # beyond this every fp16 gradient that does not overflow would already be exact


@flax.struct.dataclass
class LossScale:
  scale: jax.Array  # float32 scalar: the loss is multiplied by this before differentiation
  good_steps: jax.Array  # int32 scalar: finite steps since the scale last changed
  overflow_steps: jax.Array  # int32 scalar: updates skipped because the scaled gradients overflowed
  # Static settings (not arrays, not checkpointed): from ModelConfig.
  growth_interval: int = flax.struct.field(pytree_node=False, default=2000)
  min_scale: float = flax.struct.field(pytree_node=False, default=1.0)


def uses_loss_scale(cfg: ModelConfig) -> bool:
  return PRECISIONS[cfg.precision].loss_scaling


def init_loss_scale(cfg: ModelConfig) -> LossScale | None:
  """The initial loss scale of a run (None unless `model.precision=fp16`)."""
  if not uses_loss_scale(cfg):
    return None
  return LossScale(scale=jnp.asarray(cfg.fp16_initial_scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
                   overflow_steps=jnp.zeros((), jnp.int32), growth_interval=cfg.fp16_growth_interval,
                   min_scale=cfg.fp16_min_scale)


def update_loss_scale(ls: LossScale, loss_finite: jax.Array, grads_finite: jax.Array) -> LossScale:
  """The scale after a step: halve on a gradient overflow, double after `growth_interval` clean steps."""
  overflow = loss_finite & ~grads_finite
  good = jnp.where(loss_finite & grads_finite, ls.good_steps + 1, jnp.where(overflow, 0, ls.good_steps))
  grow = good >= ls.growth_interval
  scale = jnp.where(overflow, jnp.maximum(ls.scale * 0.5, ls.min_scale),
                    jnp.where(grow, jnp.minimum(ls.scale * 2.0, MAX_SCALE), ls.scale))
  return ls.replace(scale=scale.astype(jnp.float32), good_steps=jnp.where(grow, 0, good).astype(jnp.int32),
                    overflow_steps=ls.overflow_steps + overflow.astype(jnp.int32))
