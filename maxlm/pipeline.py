"""Pipeline parallelism over the scanned layer stack: a GPipe schedule wrapped around the layers, whose code
knows nothing of it.

Stages: the stack's parameters [L, ...] are split over the `pipeline` mesh axis in contiguous blocks (the
logical axis `layers`, maxlm/sharding.py) and seen here as [S, L/S, ...]: stage s holds layers s*L/S to
(s+1)*L/S - 1. The stored tree (the train state, checkpoints) stays per layer [L, ...], so a checkpoint restores
at any pipeline degree, as it does on any other mesh.

Schedule: the batch [B, T, D] is cut into M micro-batches (`train.grad_accum`). Over M + S - 1 ticks every stage
applies its layers to the activation it holds (a vmap over the stage axis, which the mesh splits over the
pipeline devices: each device runs its own stage only), then the activations move one stage on (a roll over the
stage axis: XLA's collective-permute between neighbouring stages). At tick t stage s works on micro-batch t - s;
ticks where it has none are the bubble, (S - 1) / (M + S - 1) of the step. Differentiating the tick loop gives
the backward in reverse tick order: every forward, then every backward (GPipe). Each stage keeps what
`model.remat` keeps of its layers for every micro-batch in flight (GPipe's memory: M micro-batches, where
1F1B would keep S).

Embedding and LM head: they stay outside the pipeline (maxlm/model.py). Their parameters are not split over
`pipeline` (only `layers` is), and every pipeline stage computes them for the whole batch: the embedding lookup
before the first stage, the final norm, head and loss after the last. Their activations are sharded over
data x fsdp as without a pipeline, and replicated over `pipeline`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxlm.config import ConfigError, MeshConfig, ModelConfig, TrainConfig

AXIS = "pipeline"  # the mesh axis of the stages (maxlm/mesh.py)
# logical names of the stage state [S, micro-batch, T, D] (maxlm/sharding.py maps "stages" to AXIS)
STAGE_BTD = ("stages", "activation_batch", "activation_length", "activation_embed")


def check(m: ModelConfig, t: TrainConfig, mesh: MeshConfig, stages: int) -> None:
  """ConfigError (one line naming the keys) unless `stages` pipeline stages (the mesh's resolved pipeline
  degree) can run this model and schedule."""
  if stages == 1:
    return
  keys = f"mesh.pipeline={mesh.pipeline} x mesh.dcn_pipeline={mesh.dcn_pipeline}"
  if m.n_layers % stages:
    raise ConfigError(f"model.n_layers={m.n_layers} does not split into the {stages} pipeline stages of {keys}: "
                      f"each stage takes an equal number of consecutive layers")
  if t.grad_accum < stages:
    raise ConfigError(f"train.grad_accum={t.grad_accum} gives fewer micro-batches than the {stages} pipeline "
                      f"stages of {keys}; use train.grad_accum >= {stages} (the bubble is (S-1)/(M+S-1) of a "
                      "step: M = 4 x S stages keeps it under 20%)")
  if not m.scan_layers:
    raise ConfigError(f"model.scan_layers=false: the pipeline ({keys}) splits the scanned layer stack; "
                      "set model.scan_layers=true")
  if m.precision == "fp8_delayed":
    raise ConfigError(f"model.precision=fp8_delayed with {keys}: its per-layer amax history is updated once per "
                      "call of a layer, and a pipelined layer runs once per micro-batch in one step; use "
                      "fp8_current (or bf16)")


def bubble_fraction(stages: int, microbatches: int) -> float:
  """The share of a GPipe step a stage waits: (S - 1) / (M + S - 1); 0 without a pipeline."""
  return (stages - 1) / (microbatches + stages - 1)


def micro_batches(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [M, B/M, ...]: row r goes to micro-batch r % M. Strided, so that each micro-batch keeps
  its rows spread over the data-parallel devices as the batch has them (contiguous blocks of B/dp rows, with
  (B/M) % dp == 0): no data moves."""
  return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def whole_batch(x: jax.Array) -> jax.Array:
  """The inverse of `micro_batches`: [M, B/M, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def pipeline_stack(layer: Callable, params, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, *,
                   stages: int, microbatches: int) -> jax.Array:
  """The layer stack applied to x [B, T, D], pipelined: the same result as scanning `layer` over the L layers.

  layer(p, h, positions, segment_ids) -> h [B/M, T, D] applies one layer (params p: one slice of the stack);
  params: the stack, every leaf [L, ...]; positions and segment_ids (or None) [B, T]."""
  n_stages, m = stages, microbatches
  n_layers = jax.tree_util.tree_leaves(params)[0].shape[0]
  per_stage = n_layers // n_stages
  staged = jax.tree_util.tree_map(lambda p: p.reshape(n_stages, per_stage, *p.shape[1:]), params)  # [S, L/S, ...]
  xs = micro_batches(x, m)  # [M, B/M, T, D]
  pos = micro_batches(positions, m)  # [M, B/M, T]
  seg = None if segment_ids is None else micro_batches(segment_ids, m)  # [M, B/M, T]
  stage = jnp.arange(n_stages)  # [S]

  def run_stage(p, h, pos_s, seg_s):  # one stage: its L/S layers in turn over its micro-batch [B/M, T, D]
    def one(carry, p_layer):
      return layer(p_layer, carry, pos_s, seg_s), None
    return jax.lax.scan(one, h, p)[0]

  stages_apply = jax.vmap(run_stage, in_axes=(0, 0, 0, None if seg is None else 0), spmd_axis_name=AXIS)

  def tick(held, t):
    # Every stage takes what the stage before it produced last tick; the first takes micro-batch t (from the
    # last one while draining: those results are never read).
    shifted = jnp.roll(held, 1, axis=0)  # [S, B/M, T, D]
    fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), keepdims=True)  # [1, B/M, T, D]
    inputs = nn.with_logical_constraint(jnp.where((stage == 0)[:, None, None, None], fresh, shifted), STAGE_BTD)
    mb = jnp.clip(t - stage, 0, m - 1)  # [S] the micro-batch each stage works on (clipped in the bubble)
    out = stages_apply(staged, inputs, pos[mb], None if seg is None else seg[mb])  # [S, B/M, T, D]
    out = nn.with_logical_constraint(out, STAGE_BTD)
    # The last stage's result, on every pipeline device: a masked sum over the stage axis (an all-reduce that
    # adds zeros to it: exact), rather than a slice, which XLA may serve by gathering every stage's [B/M, T, D].
    last = jnp.sum(jnp.where((stage == n_stages - 1)[:, None, None, None], out, jnp.zeros_like(out)), axis=0)
    return out, last  # last: [B/M, T, D]

  held = nn.with_logical_constraint(jnp.zeros((n_stages, *xs.shape[1:]), x.dtype), STAGE_BTD)  # [S, B/M, T, D]
  _, done = jax.lax.scan(tick, held, jnp.arange(m + n_stages - 1))  # [M + S - 1, B/M, T, D]
  return whole_batch(done[n_stages - 1:])  # micro-batch i left the last stage at tick i + S - 1; [B, T, D]
