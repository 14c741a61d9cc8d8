"""A mixture-of-experts SwiGLU block (Mixtral's): a float32 router, top-k experts per token, dropless by default.

Routing (Mixtral): router logits [N, E] in float32 from the token's hidden state, softmax over the E experts, the
top k kept and their weights renormalized to sum to 1. Each token's output is the weighted sum of its k experts'
SwiGLU outputs.

Dispatch, dropless (`capacity_factor=0`): the N x k (token, expert) assignments are sorted by expert (a stable sort,
so within an expert tokens keep their order), the tokens gathered in that order [N k, D], every expert applied to
its contiguous group at once (`grouped`: `jax.lax.ragged_dot`, one grouped GEMM per projection, the form TE's and
XLA:GPU's grouped GEMMs take; `dense`: every expert on every row, the other experts' rows masked out, E times the
work, a reference and a fallback), and the outputs scattered back to their (token, slot) and combined. No token is
dropped, whatever the balance.

Capacity (`capacity_factor=c > 0`): each expert takes at most C = ceil(c N k / E) assignments, in token order;
the rest are dropped (their weight is zero: the token keeps only its other experts, or the residual). The drop rate
is reported.

Auxiliary losses, reported for the caller to weigh (maxlm/step.py adds them to the loss with their coefficients):
* load balancing (Switch Transformer, as in Mixtral's Hugging Face code): E * sum_e f_e * P_e, f_e the share of
  the N k assignments routed to expert e, P_e the mean router probability of e; 1 when perfectly balanced;
* router z-loss (ST-MoE): the mean over tokens of logsumexp(logits)^2, which keeps the router's logits small.

Parameters (the names Hugging Face's Mixtral uses, so import and export map one to one): `router` [D, E] float32
input to the softmax; `w1` (gate) and `w3` (up) [E, D, F], `w2` (down) [E, F, D]. Logical axes: "expert" first, so
that an expert mesh axis shards the experts, and their D "expert_embed" (split like `embed`, but never over the
expert axis, which already splits E).

Expert parallelism (maxlm/parallel/experts.py): when the rules put `expert` on a mesh axis of more than one device
that also splits the tokens, the experts run there, each device its E / ep experts on the tokens the all-to-all
brings it (the same grouped or dense kernel, dropless, padded), and the outputs go back. Routing, the capacity
mask, the auxiliary losses and the statistics are computed before, on the global view of the tokens: the
load-balancing loss is the whole batch's, as on one device. Capacity mode runs too: its mask is the same global
first-come order, and a dropped assignment travels with weight zero (no exchange saved).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxlm.parallel import context, experts as expert_parallel

COLLECTION = "moe"  # the Flax collection the decoder's MoE blocks sow their statistics into (maxlm/model.py)
EXPERT_AXES = ("expert", "expert_embed", "mlp")  # w1, w3 [E, D, F]
DOWN_AXES = ("expert", "mlp", "expert_embed")  # w2 [E, F, D]
ROUTER_AXES = ("embed", "expert_logits")  # router [D, E]
KERNELS = ("grouped", "dense")


def wide(a: jnp.ndarray) -> jnp.ndarray:
  """`a` in float32 at least (the router's precision; float64 stays float64, for the tests' finite differences)."""
  return a.astype(jnp.promote_types(a.dtype, jnp.float32))


def route(logits: jnp.ndarray, k: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """(weights [N, k] float32 summing to 1 per token, experts [N, k] int32, probs [N, E]) from router logits [N, E]:
  softmax over the experts, the top k, renormalized (Mixtral)."""
  probs = jax.nn.softmax(wide(logits), axis=-1)  # [N, E]
  top, experts = jax.lax.top_k(probs, k)  # [N, k]
  return top / jnp.sum(top, axis=-1, keepdims=True), experts.astype(jnp.int32), probs


def sort_by_expert(experts: jnp.ndarray, n_experts: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(order [N k]: the flat (token, slot) assignments sorted by expert, stable; group_sizes [E] int32)."""
  flat = experts.reshape(-1)  # [N k]
  order = jnp.argsort(flat, stable=True)
  return order, jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def capacity_keep(experts: jnp.ndarray, n_experts: int, capacity: int) -> jnp.ndarray:
  """[N, k] bool: the assignments an expert of `capacity` takes, first come (token order, then slot) first served."""
  flat = experts.reshape(-1)  # [N k]
  one_hot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)  # [N k, E]
  position = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=-1) - 1  # [N k]: its place in its expert's queue
  return (position < capacity).reshape(experts.shape)


def _swiglu_grouped(xs, w1, w3, w2, group_sizes):
  """SwiGLU of each expert on its contiguous group of rows: xs [M, D] sorted by expert, group_sizes [E]."""
  gate = jax.lax.ragged_dot(xs, w1, group_sizes)  # [M, F]
  up = jax.lax.ragged_dot(xs, w3, group_sizes)  # [M, F]
  return jax.lax.ragged_dot(nn.silu(gate) * up, w2, group_sizes)  # [M, D]


def _swiglu_dense(xs, w1, w3, w2, group_sizes):
  """The same as `_swiglu_grouped` by every expert on every row, each row keeping its own expert's output."""
  rows = jnp.arange(xs.shape[0])
  ends = jnp.cumsum(group_sizes)
  owner = jnp.sum(rows[:, None] >= ends[None, :], axis=-1)  # [M]: the expert whose group holds the row
  gate = jnp.einsum("md,edf->emf", xs, w1)  # [E, M, F]
  up = jnp.einsum("md,edf->emf", xs, w3)
  out = jnp.einsum("emf,efd->emd", nn.silu(gate) * up, w2)  # [E, M, D]
  mask = jax.nn.one_hot(owner, w1.shape[0], dtype=out.dtype).T[:, :, None]  # [E, M, 1]
  return jnp.sum(out * mask, axis=0)  # [M, D]


def experts_apply(x: jnp.ndarray, weights: jnp.ndarray, experts: jnp.ndarray, w1, w3, w2,
                  kernel: str = "grouped") -> jnp.ndarray:
  """[N, D]: each token's k experts' SwiGLU outputs, weighted by `weights` [N, k] (zero: a dropped assignment)."""
  n, k = experts.shape
  order, group_sizes = sort_by_expert(experts, w1.shape[0])
  xs = x[order // k]  # [N k, D], grouped by expert
  swiglu = _swiglu_grouped if kernel == "grouped" else _swiglu_dense
  ys = swiglu(xs, w1.astype(x.dtype), w3.astype(x.dtype), w2.astype(x.dtype), group_sizes)  # [N k, D]
  y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to (token, slot) [N, k, D]
  return jnp.einsum("nkd,nk->nd", wide(y), weights).astype(x.dtype)


def load_balancing_loss(probs: jnp.ndarray, experts: jnp.ndarray) -> jnp.ndarray:
  """E * sum_e f_e P_e (module doc): f_e over the N k assignments, P_e the mean probability, both float32."""
  n_experts = probs.shape[-1]
  f = jnp.mean(jax.nn.one_hot(experts.reshape(-1), n_experts, dtype=probs.dtype), axis=0)  # [E]
  return n_experts * jnp.sum(f * jnp.mean(probs, axis=0))


def z_loss(logits: jnp.ndarray) -> jnp.ndarray:
  return jnp.mean(jax.nn.logsumexp(wide(logits), axis=-1) ** 2)


def capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
  """The assignments an expert takes with capacity factor `factor` (> 0)."""
  return max(1, math.ceil(factor * n_tokens * k / n_experts))


class MoE(nn.Module):
  """Mixture of SwiGLU experts (module doc). Returns (y [B, T, D], stats): stats holds the auxiliary losses
  `load_balancing` and `z_loss`, `tokens_per_expert` [E] and `dropped` (the share of assignments dropped)."""
  experts: int
  top_k: int
  ffn_dim: int
  capacity_factor: float = 0.0  # 0: dropless
  kernel: str = "grouped"  # KERNELS
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.normal(0.02)

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> tuple[jnp.ndarray, dict]:
    b, t, d = x.shape
    e, f = self.experts, self.ffn_dim
    router = self.param("router", nn.with_logical_partitioning(self.kernel_init, ROUTER_AXES), (d, e),
                        jnp.promote_types(self.param_dtype, jnp.float32))  # [D, E]: float32 at least
    w1 = self.param("w1", nn.with_logical_partitioning(self.kernel_init, EXPERT_AXES), (e, d, f), self.param_dtype)
    w3 = self.param("w3", nn.with_logical_partitioning(self.kernel_init, EXPERT_AXES), (e, d, f), self.param_dtype)
    w2 = self.param("w2", nn.with_logical_partitioning(self.kernel_init, DOWN_AXES), (e, f, d), self.param_dtype)
    tokens = x.reshape(b * t, d)  # [N, D]
    logits = wide(tokens) @ router  # [N, E]
    weights, chosen, probs = route(logits, self.top_k)  # [N, k], [N, k], [N, E]
    kept = jnp.ones_like(weights, dtype=bool)
    if self.capacity_factor > 0:
      kept = capacity_keep(chosen, e, capacity(b * t, self.top_k, e, self.capacity_factor))
    y = self._run(tokens, jnp.where(kept, weights, 0.0), chosen, w1, w3, w2)  # [N, D]
    stats = {"load_balancing": load_balancing_loss(probs, chosen), "z_loss": z_loss(logits),
             "tokens_per_expert": jnp.bincount(chosen.reshape(-1), length=e),
             "dropped": 1.0 - jnp.mean(kept.astype(weights.dtype))}
    return y.reshape(b, t, d), stats

  def _run(self, tokens, weights, chosen, w1, w3, w2):
    """The experts' weighted outputs [N, D]: split over the expert axis when there is one that the tokens are
    split over too (a batch that does not split, e.g. one row of generation: here, the experts gathered)."""
    split = expert_parallel.axis()
    if split is None or split[0] not in context.batch_axes(tokens.shape[0]):
      return experts_apply(tokens, weights, chosen, w1, w3, w2, self.kernel)
    swiglu = _swiglu_grouped if self.kernel == "grouped" else _swiglu_dense
    # cast on each device, after the exchange's entry: the weights' gradients are then summed over the batch axes
    # in float32, as one device's GEMM accumulates them (XLA:CPU also aborts on a bfloat16 all-reduce there)
    def local(rows, p, sizes):
      return swiglu(rows, *(w.astype(rows.dtype) for w in p), sizes)
    return expert_parallel.apply(local, tokens, weights, chosen, (w1, w3, w2), n_experts=self.experts, name=split[0],
                                 ep=split[1])


def sown_stats(collection: dict) -> dict[str, jnp.ndarray]:
  """The statistics the MoE blocks sowed into COLLECTION, stacked over the MoE layers in layer order: each
  [Lm, ...] (the scanned stack sows them stacked; unrolled blocks `layers_<i>` one by one)."""
  if "layers" in collection:
    return collection["layers"]["stats"][0]
  names = sorted(collection, key=lambda name: int(name.rsplit("_", 1)[1]))
  return jax.tree.map(lambda *xs: jnp.stack(xs), *(collection[name]["stats"][0] for name in names))
