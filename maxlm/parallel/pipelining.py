"""Pipeline parallelism over the scanned layer stack: a GPipe or a circular (interleaved) schedule wrapped around
the layers, whose code knows nothing of it.

Stages: the stack's parameters [L, ...] are split over the `pipeline` mesh axis in contiguous blocks (the
logical axis `layers`, maxlm/parallel/sharding.py). The stored tree (the train state, checkpoints) stays per layer
[L, ...], so a checkpoint restores at any pipeline degree and schedule, as it does on any other mesh.

Schedules (`train.pipeline_schedule`): the batch [B, T, D] is cut into M micro-batches (`train.grad_accum`);
the S stages run V = `train.pipeline_repeats` chunks of K = L / (S V) consecutive layers each (V = 1 for
gpipe): virtual stage j = r S + s (repeat r, stage s) holds layers j K .. (j + 1) K - 1, so stage s holds the
chunks s, S + s, 2 S + s, ... (circular, MaxText's num_pipeline_repeats; Megatron's virtual stages). The stack
is seen here as [S, V, K, ...]: for V > 1 that is not the stored blocks' order, and XLA moves each stage's
chunks to it once per step (an all-to-all over `pipeline`, and back for the gradients).

Over V M + S - 1 ticks every stage applies one chunk to the activation it holds (a vmap over the stage axis,
which the mesh splits over the pipeline devices: each device runs its own stage only), then the activations
move one stage on (a roll over the stage axis: XLA's collective-permute between neighbouring stages). At tick t
stage s works on micro-batch (t - s) mod M at repeat (t - s) div M (`assignment`): stage 0 takes the M fresh
micro-batches at ticks 0 .. M-1, then at tick r M + i micro-batch i back from the last stage (repeat r - 1, kept
in a buffer of M slots since it left, M - S + 1 ticks earlier: hence M >= S). Ticks where a stage has no work
are the bubble, (S - 1) / (V M + S - 1) of the step (`bubble_fraction`; `schedule_table` is what the code runs):
the idle stages compute on clipped inputs whose results are never read, so the compiled step does the work of
V M + S - 1 ticks on every stage. Differentiating the tick loop gives the backward in reverse tick order: every
forward, then every backward. Each stage keeps what `model.remat` keeps of its L/S layers for every micro-batch
(M micro-batches in flight, for both schedules, where 1F1B would keep S).

FSDP (`train.pipeline_gather`): `tick` leaves each stage's weights sharded over fsdp and XLA gathers them in the
tick loop, at every tick (the least memory); `step` gathers them once, before the loop (a constraint on the
[S, V, K, ...] stack: the stage axis over `pipeline`, `embed` unsharded), and reduce-scatters their gradient
once after it: per device the stage's L/S layers gathered (tensor-parallel shards kept) plus their gradient sum,
in the parameters' dtype, for the whole step.

Embedding and LM head: they stay outside the pipeline (maxlm/model.py). Their parameters are not split over
`pipeline` (only `layers` is); the embedding lookup before the first stage and the final norm, head and loss
after the last run once over the batch, its length split over the stages (the logical axis `stage_length`), not
on every stage. Under 1f1b (maxlm/parallel/onefoneb.py) the head and loss run per micro-batch on the last
stage's output, its length split the same way.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxlm.config import ConfigError, MeshConfig, ModelConfig, TrainConfig
from maxlm.parallel.schedules import assignment, bubble_fraction, schedule_table  # noqa: F401 (their home before)

AXIS = "pipeline"  # the mesh axis of the stages (maxlm/parallel/mesh.py)
# logical names of the stage state [S, micro-batch, T, D] (maxlm/parallel/sharding.py maps "stages" to AXIS)
STAGE_BTD = ("stages", "activation_batch", "activation_length", "activation_embed")
FSDP_NAME = "embed"  # the parameters' logical axis that maxlm/parallel/sharding.py splits over fsdp


def repeats(t: TrainConfig) -> int:
  """V: the layer chunks each stage runs per micro-batch (1 for gpipe, train.pipeline_repeats for circular)."""
  return t.pipeline_repeats if t.pipeline_schedule == "circular" else 1


def check(m: ModelConfig, t: TrainConfig, mesh: MeshConfig, stages: int, context: int = 1) -> None:
  """ConfigError (one line naming the keys) unless `stages` pipeline stages (the mesh's resolved pipeline
  degree) can run this model and schedule; `context` is the mesh's resolved context degree."""
  if stages == 1:
    return
  keys = f"mesh.pipeline={mesh.pipeline} x mesh.dcn_pipeline={mesh.dcn_pipeline}"
  if context > 1:  # context.py's shard_map inside the vmapped stages does not lower (jax 0.10.2)
    raise ConfigError(f"mesh.context={mesh.context} x mesh.dcn_context={mesh.dcn_context} (context parallelism) "
                      f"with the {stages} pipeline stages of {keys}: the two do not run together yet; use one "
                      "of them")
  if m.n_layers % stages:
    raise ConfigError(f"model.n_layers={m.n_layers} does not split into the {stages} pipeline stages of {keys}: "
                      f"each stage takes an equal number of consecutive layers")
  v = repeats(t)
  if m.n_layers % (stages * v):
    raise ConfigError(f"model.n_layers={m.n_layers} does not split into train.pipeline_repeats={v} chunks on "
                      f"each of the {stages} pipeline stages of {keys} (train.pipeline_schedule=circular): "
                      f"n_layers must be a multiple of {stages * v}")
  if t.grad_accum < stages:
    raise ConfigError(f"train.grad_accum={t.grad_accum} gives fewer micro-batches than the {stages} pipeline "
                      f"stages of {keys}; use train.grad_accum >= {stages} (the bubble is (S-1)/(V*M+S-1) of a "
                      "step: M = 4 x S stages keeps it under 20%)")
  if not m.scan_layers:
    raise ConfigError(f"model.scan_layers=false: the pipeline ({keys}) splits the scanned layer stack; "
                      "set model.scan_layers=true")
  if t.pipeline_schedule == "1f1b" and m.precision == "fp16":
    raise ConfigError(f"model.precision=fp16 with train.pipeline_schedule=1f1b ({keys}): 1f1b forms the gradients "
                      "in its forward pass, before the loss scale applies; use bf16, or train.pipeline_schedule="
                      "gpipe")
  if m.precision == "fp8_delayed":
    raise ConfigError(f"model.precision=fp8_delayed with {keys}: its per-layer amax history is updated once per "
                      "call of a layer, and a pipelined layer runs once per micro-batch in one step; use "
                      "fp8_current (or bf16)")


def micro_batches(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [M, B/M, ...]: row r goes to micro-batch r % M. Strided, so that each micro-batch keeps
  its rows spread over the data-parallel devices as the batch has them (contiguous blocks of B/dp rows, with
  (B/M) % dp == 0): no data moves."""
  return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def whole_batch(x: jax.Array) -> jax.Array:
  """The inverse of `micro_batches`: [M, B/M, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def stage_stack(params, stages: int, repeats: int = 1, axes=None, gather: bool = False):
  """The stack [L, ...] as the stages hold it, [S, V, K, ...]: [s, r] the chunk of virtual stage r S + s.
  axes: each leaf's logical names ("layers", ...) or None (no constraint); gather: `embed` left unsharded (the
  stage's weights gathered over fsdp here, once)."""
  def one(p, names=None):
    chunk = p.shape[0] // (stages * repeats)
    p = jnp.swapaxes(p.reshape(repeats, stages, chunk, *p.shape[1:]), 0, 1)  # [S, V, K, ...]
    if names is None:
      return p
    rest = tuple(None if gather and n == FSDP_NAME else n for n in names[1:])
    return nn.with_logical_constraint(p, ("stages", None, None, *rest))
  if axes is None:
    return jax.tree_util.tree_map(one, params)
  return jax.tree_util.tree_map(one, params, axes, is_leaf=lambda x: isinstance(x, tuple))


def pipeline_stack(layer: Callable, params, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, *,
                   stages: int, microbatches: int, repeats: int = 1, axes=None, gather: bool = False) -> jax.Array:
  """The layer stack applied to x [B, T, D], pipelined: the same result as scanning `layer` over the L layers.

  layer(p, h, positions, segment_ids) -> h [B/M, T, D] applies one layer (params p: one slice of the stack);
  params: the stack, every leaf [L, ...]; positions and segment_ids (or None) [B, T]; repeats: V (circular
  when > 1); axes, gather: see `stage_stack`."""
  n_stages, m = stages, microbatches
  staged = stage_stack(params, n_stages, repeats, axes, gather)  # [S, V, K, ...]
  xs = micro_batches(x, m)  # [M, B/M, T, D]
  pos = micro_batches(positions, m)  # [M, B/M, T]
  seg = None if segment_ids is None else micro_batches(segment_ids, m)  # [M, B/M, T]
  stage = jnp.arange(n_stages)  # [S]

  def run_stage(p, rep, h, pos_s, seg_s):  # one stage: its chunk `rep` (K layers) over its micro-batch
    def one(carry, p_layer):
      return layer(p_layer, carry, pos_s, seg_s), None
    chunk = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, rep, keepdims=False), p)  # [K, ...]
    return jax.lax.scan(one, h, chunk)[0]

  stages_apply = jax.vmap(run_stage, in_axes=(0, 0, 0, 0, None if seg is None else 0), spmd_axis_name=AXIS)

  def tick(carry, t):
    held, back = carry  # [S, B/M, T, D]; back [M, B/M, T, D]: each micro-batch as it last left the last stage
    # Every stage takes what the stage before it produced last tick; the first takes micro-batch t while
    # t < M (the last one while draining: those results are never read), then micro-batch t mod M back from
    # the last stage.
    shifted = jnp.roll(held, 1, axis=0)  # [S, B/M, T, D]
    fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), keepdims=False)  # [B/M, T, D]
    if repeats > 1:
      fresh = jnp.where(t < m, fresh, jax.lax.dynamic_index_in_dim(back, t % m, keepdims=False))
    inputs = nn.with_logical_constraint(jnp.where((stage == 0)[:, None, None, None], fresh[None], shifted),
                                        STAGE_BTD)
    mb, rep, _ = assignment(t, stage, m, repeats)  # [S] each, clipped in the bubble
    out = stages_apply(staged, rep, inputs, pos[mb], None if seg is None else seg[mb])  # [S, B/M, T, D]
    out = nn.with_logical_constraint(out, STAGE_BTD)
    # The last stage's result, on every pipeline device: a masked sum over the stage axis (an all-reduce that
    # adds zeros to it: exact), rather than a slice, which XLA may serve by gathering every stage's [B/M, T, D].
    last = jnp.sum(jnp.where((stage == n_stages - 1)[:, None, None, None], out, jnp.zeros_like(out)), axis=0)
    # into the slot of its micro-batch (t - S + 1) mod M; before tick S - 1 the slot gets a result that is
    # never read: its micro-batch's true one comes S - 1 ticks later, before stage 0 reads the slot (M >= S)
    back = jax.lax.dynamic_update_index_in_dim(back, last, (t - n_stages + 1) % m, 0)
    return (out, back), None

  held = nn.with_logical_constraint(jnp.zeros((n_stages, *xs.shape[1:]), x.dtype), STAGE_BTD)  # [S, B/M, T, D]
  (_, done), _ = jax.lax.scan(tick, (held, jnp.zeros_like(xs)), jnp.arange(repeats * m + n_stages - 1))
  return whole_batch(done)  # each micro-batch's last pass through the last stage; [B, T, D]
