"""The 1F1B pipeline schedule (maxlm/parallel/onefoneb.py, maxlm/parallel/schedules.py): its table against the
schedule's definition and the bubble formula; the loss and gradients of the 1F1B stack against a plain loop over
the layers, exactly; pipelined training against one device in float32 and bfloat16; the activations it holds,
read from XLA's compiled memory, flat in the number of micro-batches where GPipe's grow."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_parallel_pipelining import (AXES, BF16, LR, MODEL, B, T, _assert_same_training, _assert_within_bf16_error,
                                      _batch, _layer, _stack, _train, one_device, one_device_bf16)

from maxlm.parallel import sharding

from maxlm.config import ConfigError, MeshConfig, ModelConfig, TrainConfig
from maxlm.parallel.mesh import make_mesh
from maxlm.parallel.onefoneb import pipeline_loss
from maxlm.parallel.pipelining import check, pipeline_stack
from maxlm.parallel.schedules import bubble_fraction, in_flight, onefoneb_table
from maxlm.model import Transformer
from maxlm.scope import model_scope
from maxlm.step import make_train_step
from maxlm.train_state import create_train_state

__all__ = ["one_device", "one_device_bf16"]  # the module-scoped fixtures, shared with test_parallel_pipelining


@pytest.mark.parametrize("stages,micro", [(2, 2), (2, 5), (4, 4), (4, 16), (8, 8), (3, 7)])
def test_the_1f1b_table_and_its_bubble(stages, micro):
  """The phases 1f1b runs (onefoneb_table): a micro-batch's forward on stage s + 1 one tick after its forward on s
  (the hand-off); its backward on the last stage in the same tick as its forward there, after it; on stage s - 1
  one tick after its backward on s; every (micro-batch, stage, kind) once; a tick's forward phase before its
  backward phase, each at most once. Idle (stage, phase) slots over all: GPipe's (S - 1) / (M + S - 1) (phases of
  one kind last as long as each other: the fraction holds whatever a backward costs against a forward). The
  micro-batches a stage holds from its forward to its backward: at most 2 S - 1 (stage 0), whatever M, as
  in_flight says (GPipe's: M)."""
  table = onefoneb_table(stages, micro)  # [phases, S, 3]
  assert table.shape == (2 * (micro + stages - 1), stages, 3)
  when, tick = {}, {}  # (micro-batch, stage, kind) -> phase index, tick
  for k, row in enumerate(table):
    assert len({tuple(r) for r in row[:, 1:]}) == 1  # one kind and tick per phase
    for s, (mb, kind, t) in enumerate(row):
      if mb >= 0:
        assert (mb, s, kind) not in when
        when[mb, s, kind], tick[mb, s, kind] = k, t
  phases = [tuple(r) for r in table[:, 0, 1:][:, ::-1]]  # (tick, kind) in the order run
  assert phases == sorted(set(phases))  # ticks in order, the forward phase first, none twice
  assert sorted(when) == sorted((i, s, k) for i in range(micro) for s in range(stages) for k in (0, 1))
  last = stages - 1
  for i in range(micro):
    assert all(tick[i, s + 1, 0] - tick[i, s, 0] == 1 for s in range(last))
    assert tick[i, last, 1] == tick[i, last, 0] and when[i, last, 1] > when[i, last, 0]
    assert all(tick[i, s - 1, 1] - tick[i, s, 1] == 1 for s in range(1, stages))
  idle = int((table[..., 0] < 0).sum())
  assert idle / table[..., 0].size == (stages - 1) / (micro + stages - 1) == bubble_fraction(stages, micro)
  held = [max(sum(when[i, s, 0] <= k < when[i, s, 1] for i in range(micro)) for k in range(len(table)))
          for s in range(stages)]
  assert held == [min(micro, 2 * (stages - s) - 1) for s in range(stages)]
  assert max(held) == in_flight("1f1b", stages, micro) and in_flight("gpipe", stages, micro) == micro


def _tail(tp, h, cot):
  """A stand-in tail: the loss sum(h * cot * tp) and a count of 1 per micro-batch."""
  return jnp.sum(h * cot * tp), jnp.float32(1)


@pytest.mark.parametrize("stages,micro,fsdp,gather", [(2, 3, 4, False), (2, 4, 2, True), (4, 4, 2, False),
                                                      (4, 6, 1, True), (2, 2, 2, False), (4, 9, 2, True)])
def test_1f1b_equals_a_loop_over_the_layers(stages, micro, fsdp, gather):
  """The loss and its gradients (of the stack, the tail's parameter and the input) equal the plain loop's
  exactly (test_parallel_pipelining's integer-valued stand-in layer: exact in float32 in any order), for
  micro-batches as many as the stages, more, fewer than 2 S - 1 (the ring as long as M), and many; the weights
  gathered over fsdp at every tick or once. The undifferentiated loss (eval: GPipe's forward) too."""
  n_layers, d, t = 8, 4, 5
  b = micro * fsdp * 2
  mesh = make_mesh(MeshConfig(pipeline=stages, fsdp=fsdp, data=1), jax.devices()[:stages * fsdp])
  rng = np.random.default_rng(stages * 10 + micro)
  params, tp = _stack(n_layers, d, seed=micro), np.float32(2)
  x = rng.integers(-5, 6, (b, t, d)).astype(np.float32)
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1)) + rng.integers(0, 3, (b, 1)).astype(np.int32)
  seg = rng.integers(0, 3, (b, t)).astype(np.int32)
  cot = rng.integers(-2, 3, (b, t, d)).astype(np.float32)

  def ref_loss(p, tp, x):  # every layer in turn over the whole batch, differentiated by jax
    for i in range(n_layers):
      x = _layer(jax.tree_util.tree_map(lambda a, i=i: a[i], p), x, pos, seg)
    return jnp.sum(x * cot * tp)

  def piped(p, tp, x):
    return pipeline_loss(_layer, _tail, p, tp, x, pos, seg, (cot,), stages=stages, microbatches=micro, axes=AXES,
                         gather=gather)[0]
  with model_scope(ModelConfig(backend="flax"), "flax", mesh):
    loss, grads = jax.jit(jax.value_and_grad(piped, argnums=(0, 1, 2)))(params, tp, x)
    forward_only = jax.jit(piped)(params, tp, x)
  ref, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(params, tp, x)
  assert float(loss) == float(ref) == float(forward_only)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.tree_util.tree_map(np.asarray, grads), ref_grads)


@pytest.mark.parametrize("mesh,grad_accum,gather", [(MeshConfig(pipeline=2, fsdp=4), 4, False),
                                                    (MeshConfig(pipeline=4, fsdp=2), 8, True),
                                                    (MeshConfig(pipeline=2, data=2, fsdp=1, tensor=2), 2, False)])
def test_1f1b_training_equals_one_device(one_device, mesh, grad_accum, gather):
  """Loss, gradient norm, every gradient of each of several SGD steps and the final parameters of a 1F1B run equal
  one device's within float32 noise (test_parallel_pipelining's bounds and their derivation: the same sums, in
  another order; the head and loss of each micro-batch on its own, summed over them, is one more such order)."""
  _assert_same_training(one_device, _train(mesh, 8, grad_accum, gather=gather, schedule="1f1b"),
                        f"1f1b {mesh} grad_accum={grad_accum} gather={gather}")


@pytest.mark.parametrize("mesh,grad_accum", [(MeshConfig(pipeline=2, fsdp=4), 4), (MeshConfig(pipeline=4, fsdp=2), 4)])
def test_bfloat16_1f1b_step_equals_one_device(one_device_bf16, mesh, grad_accum):
  """bf16: the 1F1B step's loss, gradient norm and every gradient within test_parallel_pipelining's bf16 error
  model (K roundings to bf16 along a gradient's chain, in quadrature, each run) of one device's fp32 step. The
  recomputed forward in the backward phase rounds as the first one did (the same operations on the same
  inputs), so it adds no rounding to the count."""
  ref, _, max_logit_norm = one_device_bf16
  _assert_within_bf16_error(_train(mesh, 8, grad_accum, BF16, steps=1, gather=True, schedule="1f1b"), ref,
                            max_logit_norm, f"1f1b {mesh} grad_accum={grad_accum}")


def _temp_bytes(loss, params, x) -> int:
  return jax.jit(jax.grad(loss)).lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_holds_a_bounded_number_of_micro_batches():
  """XLA's compiled temporary memory of the stack's gradient (S = 2 stages, L = 4 stand-in layers, K = 2 per
  stage, micro-batches of b x T x D float32 = 32 KiB each, M = 8 and 32 at the same micro-batch size). Hand count
  of what grows with M: both schedules hold the micro-batched input and its cotangent, 2 micro-batches' bytes per
  micro-batch of the batch. GPipe also keeps, for each micro-batch, the input of each of a stage's K layers (for
  their backward): at least (2 + K) per micro-batch. 1F1B keeps the inputs of R = min(M, 2 S - 1) = 3
  micro-batches per stage, however many there are: nothing more per micro-batch than the 2. Measured per added
  micro-batch (bytes / 32 KiB): GPipe 6.0, 1F1B 1.93."""
  stages, n_layers, d, t, b = 2, 4, 64, 32, 4
  mesh = make_mesh(MeshConfig(pipeline=stages, fsdp=1, data=1), jax.devices()[:stages])
  params, mb_bytes, k = _stack(n_layers, d, 0), b * t * d * 4, n_layers // stages
  temp = {}
  for micro in (8, 32):
    x, cot = np.ones((micro * b, t, d), np.float32), np.ones((micro * b, t, d), np.float32)
    pos, seg = np.zeros((micro * b, t), np.int32), np.ones((micro * b, t), np.int32)

    def gpipe(p, x, micro=micro, pos=pos, seg=seg, cot=cot):
      return jnp.sum(pipeline_stack(_layer, p, x, pos, seg, stages=stages, microbatches=micro, axes=AXES) * cot)

    def onefoneb(p, x, micro=micro, pos=pos, seg=seg, cot=cot):
      return pipeline_loss(_layer, _tail, p, jnp.float32(1), x, pos, seg, (cot,), stages=stages,
                           microbatches=micro, axes=AXES)[0]
    with model_scope(ModelConfig(backend="flax"), "flax", mesh):
      temp[micro] = {"gpipe": _temp_bytes(gpipe, params, x), "1f1b": _temp_bytes(onefoneb, params, x)}
  grow = {s: (temp[32][s] - temp[8][s]) / (24 * mb_bytes) for s in ("gpipe", "1f1b")}
  assert grow["1f1b"] <= 2, grow
  assert grow["gpipe"] >= 2 + k, grow
  assert temp[32]["1f1b"] < temp[32]["gpipe"] / 2, temp


def test_1f1b_with_fp16_is_refused_naming_the_keys():
  mesh, t = MeshConfig(pipeline=2), TrainConfig(grad_accum=4, pipeline_schedule="1f1b")
  with pytest.raises(ConfigError, match=r"^model.precision=fp16 with train.pipeline_schedule=1f1b \(mesh.pipeline=2 "):
    check(ModelConfig(n_layers=4, precision="fp16"), t, mesh, 2)
  check(ModelConfig(n_layers=4), t, mesh, 2)  # bf16 runs
  check(ModelConfig(n_layers=4, precision="fp16"), TrainConfig(grad_accum=4), mesh, 2)  # and fp16 under gpipe


def _step_flops(schedule: str, stages: int, fsdp: int, micro: int) -> float:
  """XLA's cost analysis (FLOPs per device) of MODEL's compiled train step on a pipeline x fsdp CPU mesh."""
  mesh = make_mesh(MeshConfig(pipeline=stages, fsdp=fsdp), jax.devices()[:stages * fsdp])
  model = Transformer(MODEL, max_segments=2, stages=stages, microbatches=micro, schedule=schedule)
  opt = optax.sgd(LR)
  with model_scope(MODEL, "flax", mesh):
    state, _ = create_train_state(model, opt, mesh, seed=0, batch=B // micro, seq_len=T)
    step = jax.jit(make_train_step(model, opt, optax.constant_schedule(LR), grad_accum=micro, packed=True))
    bs = sharding.batch_sharding(mesh)
    compiled = step.lower(state, {k: jax.device_put(v, bs) for k, v in _batch(0).items()}).compile()
  return float(compiled.cost_analysis()["flops"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_head_runs_once_over_the_stages(monkeypatch, schedule):
  """The LM head and the loss run once over the batch, each stage on its 1/S of the tokens (the length split over
  `pipeline` outside the stages: logical `stage_length`), not on every stage. Counted as the compiled step's FLOPs
  per device against the same step with `stage_length` replicated (the head on every stage, as before): the
  difference is (S - 1) / S of the head's three GEMMs (forward, the input's and the kernel's gradients), 6 x rows
  x D x V for the rows = B T / fsdp one device computed before. XLA's cost analysis counts a while loop's body once:
  1f1b's tail runs in its tick loop, so there it sees one micro-batch's head, rows B T / (fsdp M). The rest of the
  head (the norm, the softmax and loss over [rows, V]: tens of FLOPs per logit against the GEMMs' 6 D = 384) is
  within 5 %. Measured: +2.0 % (gpipe), +2.8 % (1f1b)."""
  stages, fsdp, micro = 2, 4, 4
  split = _step_flops(schedule, stages, fsdp, micro)
  monkeypatch.setattr(sharding, "LOGICAL_RULES", tuple((k, None if k == "stage_length" else v)
                                                       for k, v in sharding.LOGICAL_RULES))
  every_stage = _step_flops(schedule, stages, fsdp, micro)
  rows = B * T // fsdp // (micro if schedule == "1f1b" else 1)
  want = (stages - 1) / stages * 6 * rows * MODEL.d_model * MODEL.vocab_size
  assert want <= every_stage - split <= 1.05 * want, (every_stage, split, want)


assert MODEL.n_layers == 4  # the stages above split MODEL's 4 layers
