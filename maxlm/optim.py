"""AdamW with warmup + cosine / WSD / constant schedules, global-norm clipping and a decay mask."""

from __future__ import annotations

import jax
import optax

from maxlm.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  peak = cfg.learning_rate
  decay_steps = max(1, (cfg.decay_steps or total_steps) - cfg.warmup_steps)
  warmup = optax.linear_schedule(0.0, peak, max(1, cfg.warmup_steps))
  end = peak * cfg.min_lr_ratio
  if cfg.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
  elif cfg.schedule == "wsd":  # warmup-stable-decay: flat, then linear decay over the last fraction
    n_decay = max(1, int(round(decay_steps * cfg.wsd_decay_fraction)))
    after = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, end, n_decay)],
        [decay_steps - n_decay])
  else:
    raise ValueError(f"unknown schedule {cfg.schedule!r}")
  if cfg.warmup_steps <= 0:
    return after
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def decay_mask(params, decay_norms_and_embeddings: bool):
  """True where weight decay applies: matmul kernels; norms and embeddings only if asked."""
  def keep(path, leaf):
    names = [getattr(k, "key", str(k)) for k in path]
    if decay_norms_and_embeddings:
      return True
    return not ("scale" in names or "embedding" in names)
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(cfg, total_steps)
  parts = []
  if cfg.clip_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.clip_grad_norm))
  parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=lambda p: decay_mask(p, cfg.decay_norms_and_embeddings)))
  return optax.chain(*parts), schedule
