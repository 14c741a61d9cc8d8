"""The mixture of experts' share of the train step (maxlm/step.py): its auxiliary losses in the training loss,
and its statistics as metrics.

The MoE blocks sow, per layer, the load-balancing loss, the router z-loss, tokens per expert and the drop rate
(maxlm/layers/moe.py). The step sums over micro-batches, so each micro-batch's statistics are carried as sums:
the losses (their mean over the MoE layers) and the drop rates times the micro-batch's valid tokens, the tokens
per expert as they are. The objective differentiated is the summed next-token loss plus the valid tokens times
`aux_loss_coef` x load balancing + `z_loss_coef` x z-loss; divided by the tokens (maxlm/step.py `averaged`), the
mean next-token loss plus the weighted losses (token-weighted over the micro-batches). The reported `loss`
stays the next-token loss alone (comparable to the eval loss and to dense models); `moe_aux_loss` and
`moe_z_loss` are reported beside it, unweighted.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxlm.config import ModelConfig
from maxlm.model import moe_layers


def enabled(cfg: ModelConfig) -> bool:
  return cfg.moe.experts > 0


def sums(stats: dict, count) -> dict:
  """One micro-batch's statistics [Lm, ...] (moe.sown_stats) as the sums the step accumulates."""
  return {"load_balancing": count * jnp.mean(stats["load_balancing"]), "z_loss": count * jnp.mean(stats["z_loss"]),
          "dropped": count * stats["dropped"].astype(jnp.float32),  # [Lm]
          "tokens_per_expert": stats["tokens_per_expert"].astype(jnp.float32)}  # [Lm, E]


def zeros(cfg: ModelConfig) -> tuple:
  """The step's per-micro-batch outputs summed from zero: (loss_sum, count) and, with experts, `sums`'s dict."""
  out = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
  if not enabled(cfg):
    return out
  n = len(moe_layers(cfg))
  return out + ({"load_balancing": jnp.zeros((), jnp.float32), "z_loss": jnp.zeros((), jnp.float32),
                 "dropped": jnp.zeros((n,), jnp.float32),
                 "tokens_per_expert": jnp.zeros((n, cfg.moe.experts), jnp.float32)},)


def objective(cfg: ModelConfig, s: dict):
  """The auxiliary losses' share of the summed objective (their coefficients applied)."""
  return cfg.moe.aux_loss_coef * s["load_balancing"] + cfg.moe.z_loss_coef * s["z_loss"]


def metrics(cfg: ModelConfig, s: dict, count) -> dict:
  """Scalars for the metrics row: the losses per token, and per MoE layer i the least and most tokens (token,
  slot assignments) an expert got in the step (`moe_tokens_min/layer_<i>`, `moe_tokens_max/layer_<i>`) and, in
  capacity mode, the share of assignments dropped (`moe_dropped`, the mean over layers, and per layer)."""
  out = {"moe_aux_loss": s["load_balancing"] / count, "moe_z_loss": s["z_loss"] / count}
  tpe = s["tokens_per_expert"]  # [Lm, E]
  for j, i in enumerate(moe_layers(cfg)):
    out[f"moe_tokens_min/layer_{i}"] = jnp.min(tpe[j])
    out[f"moe_tokens_max/layer_{i}"] = jnp.max(tpe[j])
    if cfg.moe.capacity_factor > 0:
      out[f"moe_dropped/layer_{i}"] = s["dropped"][j] / count
  if cfg.moe.capacity_factor > 0:
    out["moe_dropped"] = jnp.mean(s["dropped"]) / count
  return out
