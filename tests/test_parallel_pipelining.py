"""Pipeline parallelism (maxlm/parallel/pipelining.py): the GPipe schedule against a plain loop over the layers, exactly;
pipelined training (pipeline 2 and 4, with fsdp, data and tensor) against one device over several optimizer
steps; the configurations it cannot run, refused in one line naming the keys."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from resume_launcher import compile_cache

from maxlm.checkpoint import Checkpointer
from maxlm.cli.train import main
from maxlm.config import ConfigError, MeshConfig, ModelConfig, TrainConfig, load_config, to_dict
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.parallel.pipelining import bubble_fraction, check, micro_batches, pipeline_stack, schedule_table, whole_batch
from maxlm.scope import model_scope
from maxlm.parallel.sharding import batch_sharding, replicated
from maxlm.build import CompiledStep
from maxlm.step import make_train_step
from maxlm.train_state import create_train_state
from maxlm.trainer import Trainer

U32 = 2.0 ** -24  # float32 unit roundoff
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")


# ---- the schedule, on its own ------------------------------------------------------------------------------

def _layer(p, h, pos, seg):
  """A stand-in layer whose every value is a small integer (exact in float32, whatever the order of the sums):
  a signed permutation of the features, a bias, and the token's position and document, so that a micro-batch
  that met another's positions, or a layer applied out of order, shows."""
  return h @ p["w"] + p["b"] + (pos * seg)[..., None].astype(h.dtype)


def _loop(params, x, pos, seg):
  """The reference: every layer in turn over the whole batch (numpy)."""
  for i in range(params["w"].shape[0]):
    x = x @ params["w"][i] + params["b"][i] + (pos * seg)[..., None]
  return x


def _stack(n_layers, d, seed):
  rng = np.random.default_rng(seed)
  w = np.stack([np.eye(d)[rng.permutation(d)] * rng.choice([-1.0, 1.0], d) for _ in range(n_layers)])
  return {"w": w.astype(np.float32), "b": rng.integers(-3, 4, (n_layers, d)).astype(np.float32)}


@pytest.mark.parametrize("stages,micro,fsdp,repeats,gather", [
    (2, 3, 4, 1, False), (2, 4, 2, 1, False), (4, 4, 2, 1, False), (4, 6, 1, 1, False), (2, 4, 2, 1, True),
    (2, 3, 4, 2, False), (2, 4, 2, 4, True), (4, 4, 2, 2, False), (4, 5, 1, 2, True), (2, 2, 2, 2, False)])
def test_the_schedule_equals_a_loop_over_the_layers(stages, micro, fsdp, repeats, gather):
  """Outputs and gradients (of params and inputs) of the pipelined stack equal the plain loop's exactly, for
  micro-batches as many as the stages, more, and not a multiple of them; GPipe (repeats 1) and circular (each
  stage 2 or 4 chunks, a micro-batch looping the stages that many times), the weights gathered over fsdp at
  every tick or once."""
  n_layers, d, t = 8, 4, 5
  b = micro * fsdp * 2  # two rows of each micro-batch per data-parallel device
  mesh = make_mesh(MeshConfig(pipeline=stages, fsdp=fsdp, data=1), jax.devices()[:stages * fsdp])
  rng = np.random.default_rng(stages * 10 + micro)
  params = _stack(n_layers, d, seed=micro)
  x = rng.integers(-5, 6, (b, t, d)).astype(np.float32)
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1)) + rng.integers(0, 3, (b, 1)).astype(np.int32)
  seg = rng.integers(0, 3, (b, t)).astype(np.int32)
  cot = rng.integers(-2, 3, (b, t, d)).astype(np.float32)
  want = _loop(params, x, pos, seg)

  def ref_loss(p, x):  # the same loop in jax, differentiated by jax: the reference gradients
    for i in range(n_layers):
      x = _layer(jax.tree_util.tree_map(lambda a, i=i: a[i], p), x, pos, seg)
    return jnp.sum(x * cot)

  def piped(p, x):
    return pipeline_stack(_layer, p, x, pos, seg, stages=stages, microbatches=micro, repeats=repeats,
                          axes=AXES, gather=gather)

  with model_scope(ModelConfig(backend="flax"), "flax", mesh):
    got = jax.jit(piped)(params, x)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(piped(p, x) * cot), argnums=(0, 1)))(params, x)
  ref_grads = jax.grad(ref_loss, argnums=(0, 1))(params, x)
  np.testing.assert_array_equal(np.asarray(got), want)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.tree_util.tree_map(np.asarray, grads), ref_grads)


AXES = {"w": ("layers", "embed", None), "b": ("layers", "embed")}  # _stack's leaves' logical names


@pytest.mark.parametrize("stages,micro,repeats", [(2, 2, 1), (2, 4, 1), (4, 4, 1), (4, 16, 1), (8, 8, 1),
                                                  (2, 2, 2), (2, 3, 2), (4, 4, 2), (4, 6, 3), (4, 16, 4),
                                                  (8, 8, 2), (3, 5, 4)])
def test_the_bubble_counted_in_the_schedule_the_code_runs(stages, micro, repeats):
  """The tick loop's own assignment of work (schedule_table): every micro-batch passes every virtual stage
  (chunk r S + s: stage s, repeat r) once, in order, one tick after the one before (the hand-off between
  stages), or later (back from the last stage into the first: its buffer); no stage does two things at once;
  and the idle (stage, tick) pairs over all are GPipe's (S - 1) / (M + S - 1) for one repeat, the circular
  schedule's (S - 1) / (V M + S - 1) for V, both as bubble_fraction says."""
  table = schedule_table(stages, micro, repeats)  # [ticks, S, 2]
  assert table.shape == (repeats * micro + stages - 1, stages, 2)
  seen = {}
  for t, row in enumerate(table):
    for s, (mb, rep) in enumerate(row):
      if mb >= 0:
        assert (mb, rep * stages + s) not in seen
        seen[mb, rep * stages + s] = t
  assert sorted(seen) == [(i, j) for i in range(micro) for j in range(repeats * stages)]
  for i in range(micro):
    ticks = [seen[i, j] for j in range(repeats * stages)]
    assert all(b - a == 1 for j, (a, b) in enumerate(zip(ticks, ticks[1:]), start=1) if j % stages), ticks
    assert all(b - a >= 1 for a, b in zip(ticks, ticks[1:])), ticks
  idle = int((table[..., 0] < 0).sum())
  assert idle / table[..., 0].size == (stages - 1) / (repeats * micro + stages - 1)
  assert idle / table[..., 0].size == bubble_fraction(stages, micro, repeats)
  assert idle == stages * (stages - 1)  # each stage waits S - 1 ticks, whatever M and V


def _executed(hlo: str, op: str) -> int:
  """How many times a step runs the `op` instructions of a compiled module (its text): each computation's own
  count times how often it runs, a while loop's body as often as its known trip count says."""
  comps, cur = {}, None  # name -> [entry?, own count, [(callee, times per call)]]
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
    if head:
      cur = head.group(2)
      comps[cur] = [bool(head.group(1)), 0, []]
    elif cur is not None and line.startswith("  "):
      comps[cur][1] += len(re.findall(rf"[\]}})] {re.escape(op)}\(", line))  # after the result's shape
      trip, body = re.search(r'known_trip_count":\{"n":"(\d+)"', line), re.search(r"body=%([\w.\-]+)", line)
      for callee in re.findall(r"(?:calls|to_apply|condition|body|branch_computations)=\{?%([\w.\-]+)", line):
        comps[cur][2].append((callee, int(trip.group(1)) if trip and body and callee == body.group(1) else 1))

  def runs(name):
    _, own, calls = comps[name]
    return own + sum(k * runs(callee) for callee, k in calls)
  return runs(next(name for name, (entry, _, _) in comps.items() if entry))


@pytest.mark.parametrize("repeats,gather", [(1, False), (1, True), (2, False), (2, True)])
def test_the_weights_are_gathered_once_per_step(repeats, gather):
  """Counted in the compiled forward and backward of the stack (S = 2 stages x fsdp 4, M = 4, L = 8 layers of
  one matmul h @ w and a bias b, both split over fsdp on `embed`): the all-gathers and matmuls the step runs,
  against hand numbers. Per tick a stage applies K = L / (S V) layers; the step has V M + S - 1 ticks, every
  stage computing at each (the bubble's ticks compute on clipped inputs), 3 matmuls a layer (h @ w, and for the
  backward the input's and w's gradients). Gathered at every tick: per layer w and b for the forward and w again
  for the input's gradient, 3 per layer application. Gathered once (train.pipeline_gather=step): w and b once;
  circular adds one all-gather over `pipeline` per leaf, moving the gradient of the [S, V, K, ...] stack back
  into the stored per-layer blocks (and an all-to-all per leaf moving the weights the other way)."""
  stages, micro, fsdp, n_layers, d, t = 2, 4, 4, 8, 8, 5
  b = micro * fsdp * 2
  mesh = make_mesh(MeshConfig(pipeline=stages, fsdp=fsdp, data=1), jax.devices()[:stages * fsdp])
  params, x = _stack(n_layers, d, seed=0), np.ones((b, t, d), np.float32)
  pos, seg = np.zeros((b, t), np.int32), np.ones((b, t), np.int32)

  def loss(p, x):
    return jnp.sum(pipeline_stack(_layer, p, x, pos, seg, stages=stages, microbatches=micro, repeats=repeats,
                                  axes=AXES, gather=gather) ** 2)
  shard = {"w": NamedSharding(mesh, P("pipeline", "fsdp", None)), "b": NamedSharding(mesh, P("pipeline", "fsdp"))}
  with model_scope(ModelConfig(backend="flax"), "flax", mesh):
    hlo = jax.jit(jax.grad(loss), in_shardings=(shard, NamedSharding(mesh, P("fsdp")))).lower(params, x).compile(
        ).as_text()
  ticks, per_stage = repeats * micro + stages - 1, n_layers // (stages * repeats)
  assert _executed(hlo, "dot") == ticks * per_stage * 3
  leaves = 2
  want = leaves + (leaves if repeats > 1 else 0) if gather else ticks * per_stage * 3 + (leaves if repeats > 1 else 0)
  assert _executed(hlo, "all-gather") == want
  assert _executed(hlo, "all-to-all") == (leaves if repeats > 1 else 0)


def test_micro_batches_are_strided_and_come_back():
  x = np.arange(12).reshape(6, 2)
  mb = np.asarray(micro_batches(x, 3))
  assert mb.shape == (3, 2, 2) and mb[1].tolist() == [[2, 3], [8, 9]]  # rows 1 and 4: row r in micro-batch r % M
  np.testing.assert_array_equal(np.asarray(whole_batch(mb)), x)
  assert bubble_fraction(1, 8) == 0 and bubble_fraction(4, 4) == 3 / 7 and bubble_fraction(4, 12) == 0.2


def test_the_dry_run_names_the_schedule_and_its_bubble(capsys):
  """Llama 3 70B in 4 stages over 8 nodes, 4 micro-batches: GPipe's bubble 3/7 = 43%; circular with 2 repeats
  of 10 layers per stage 3/11 = 27%, both in the mesh line and the JSON."""
  args = ["--dry-run", "config=llama70b", "--devices", "64", "--nodes", "8", "mesh.dcn_pipeline=4",
          "train.grad_accum=4", "model.scan_layers=true"]
  assert main([*args, "train.pipeline_schedule=circular", "train.pipeline_repeats=2"]) == 0
  assert ("; 4 stages of 20 layers over 4 micro-batches (circular: 2 chunks of 10 layers per stage), bubble 27% of "
          "a step" in capsys.readouterr().out)
  assert main([*args, "--json", "train.pipeline_schedule=circular", "train.pipeline_repeats=2"]) == 0
  mesh = json.loads(capsys.readouterr().out)["mesh"]
  assert (mesh["schedule"], mesh["repeats"], mesh["bubble"]) == ("circular", 2, 3 / 11)
  assert main(args) == 0 and "micro-batches (GPipe), bubble 43% of a step" in capsys.readouterr().out


# ---- the configurations it cannot run ----------------------------------------------------------------------

@pytest.mark.parametrize("model,grad_accum,match", [
    (dict(n_layers=6), 4, r"^model.n_layers=6 does not split into the 4 pipeline stages of mesh.pipeline=2 x "
                          r"mesh.dcn_pipeline=2: "),
    (dict(n_layers=8), 2, r"^train.grad_accum=2 gives fewer micro-batches than the 4 pipeline stages of "
                          r"mesh.pipeline=2 x mesh.dcn_pipeline=2; use train.grad_accum >= 4"),
    (dict(n_layers=8), dict(grad_accum=4, pipeline_schedule="circular", pipeline_repeats=4),
     r"^model.n_layers=8 does not split into train.pipeline_repeats=4 chunks on each of the 4 pipeline stages "
     r"of mesh.pipeline=2 x mesh.dcn_pipeline=2 \(train.pipeline_schedule=circular\): n_layers must be a "
     r"multiple of 16$"),
    (dict(n_layers=8, scan_layers=False), 4, r"^model.scan_layers=false: the pipeline \(mesh.pipeline=2 x "
                                             r"mesh.dcn_pipeline=2\) splits the scanned layer stack"),
    (dict(n_layers=8, precision="fp8_delayed"), 4, r"^model.precision=fp8_delayed with mesh.pipeline=2 x "
                                                   r"mesh.dcn_pipeline=2: "),
])
def test_what_a_pipeline_cannot_run_is_refused_naming_the_keys(model, grad_accum, match):
  mesh = MeshConfig(pipeline=2, dcn_pipeline=2)
  train = TrainConfig(**grad_accum) if isinstance(grad_accum, dict) else TrainConfig(grad_accum=grad_accum)
  with pytest.raises(ConfigError, match=match):
    check(ModelConfig(**model), train, mesh, 4)
  check(ModelConfig(**model), train, mesh, 1)  # no pipeline: nothing to refuse


def test_pipeline_with_context_parallelism_is_refused_naming_the_keys():
  """Context parallelism's attention (a shard_map over the context axis) inside the vmapped stages does not
  lower (the merge of both axes: the stage axis meets the shard_map's shapes); refused until it does."""
  mesh, m, t = MeshConfig(pipeline=2, context=2, fsdp=1), ModelConfig(n_layers=4), TrainConfig(grad_accum=2)
  with pytest.raises(ConfigError, match=r"^mesh.context=2 x mesh.dcn_context=1 \(context parallelism\) with the "
                                        r"2 pipeline stages of mesh.pipeline=2 x mesh.dcn_pipeline=1: "):
    check(m, t, mesh, 2, context=2)
  check(m, t, mesh, 2, context=1)  # either axis alone runs
  check(m, t, mesh, 1, context=2)


# ---- pipelined training against one device -----------------------------------------------------------------

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=128,
                    dtype="float32", remat="full", backend="flax")
B, T, STEPS, LR = 16, 16, 3, 0.05


def _recorder() -> optax.GradientTransformation:
  """Keeps the step's gradient as its state and passes it on (to SGD): what each step computed, on the host."""
  return optax.GradientTransformation(lambda params: jax.tree_util.tree_map(jnp.zeros_like, params),
                                      lambda grads, state, params=None: (grads, grads))


def _batch(step: int) -> dict:
  """Packed rows: two documents each (positions restart at a random cut), and padding at the end of some."""
  rng = np.random.default_rng(step)
  toks = rng.integers(0, MODEL.vocab_size, (B, T + 1), dtype=np.int32)
  seg, pos = np.ones((B, T), np.int32), np.tile(np.arange(T, dtype=np.int32), (B, 1))
  for r in range(B):
    cut = int(rng.integers(2, T - 2))
    seg[r, cut:], pos[r, cut:] = 2, np.arange(T - cut)
    if r % 3 == 0:
      seg[r, T - int(rng.integers(1, 5)):] = 0
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "positions": pos}


def _train(mesh_cfg: MeshConfig, n_devices: int, grad_accum: int, model_cfg: ModelConfig = MODEL,
           steps: int = STEPS, repeats: int = 1, gather: bool = False, schedule: str = "gpipe"):
  """`steps` real (jitted, sharded, donating) train steps with SGD: (initial params, [(loss, grad_norm)],
  [gradients], final params), all on the host. repeats > 1: the circular schedule; gather: FSDP once a step."""
  mesh = make_mesh(mesh_cfg, jax.devices()[:n_devices])
  model = Transformer(model_cfg, max_segments=2, stages=mesh.shape["pipeline"], microbatches=grad_accum,
                      repeats=repeats, gather_once=gather, schedule=schedule)
  optimizer = optax.chain(_recorder(), optax.sgd(LR))
  schedule = optax.constant_schedule(LR)

  def scope():
    return model_scope(model_cfg, model_cfg.backend, mesh)
  with scope():
    state, shardings = create_train_state(model, optimizer, mesh, seed=0, batch=B // grad_accum, seq_len=T)
  init = jax.tree_util.tree_map(np.asarray, state.params)
  bs = batch_sharding(mesh)
  step = CompiledStep(make_train_step(model, optimizer, schedule, grad_accum=grad_accum, packed=True), shardings,
                  {k: bs for k in BATCH_KEYS}, scope, metrics_sharding=replicated(mesh))
  metrics, grads = [], []
  for i in range(steps):
    state, m = step(state, {k: jax.device_put(v, bs) for k, v in _batch(i).items()})
    metrics.append((float(m["loss"]), float(m["grad_norm"])))
    grads.append(jax.tree_util.tree_map(np.asarray, state.opt_state[0]))
  return init, metrics, grads, jax.tree_util.tree_map(np.asarray, state.params)


# Tolerances. The pipelined step and one device's compute the same per-token terms in another order: the
# weight gradients summed per micro-batch and then over the ticks, the batch's rows split over data x fsdp,
# contractions over heads / MLP / vocabulary (<= 256) split over `tensor`. Each float32 result carries
# rounding of random sign ~ sqrt(n) * U32 per contraction of length n (<= 16 ulps for n <= 256); along the
# backward chain (LM head, then per block wo, wi, out, attention, qkv: 21 contractions for 4 layers) they add
# in quadrature (sqrt(21) * 16 ~ 73 ulps), plus sqrt(256) = 16 for the sum over 256 tokens: <= 128 ulps of a
# leaf's largest gradient per run, so two runs differ by <= 256 ulps (GRAD_DIFF) in one step from the same
# parameters. Plain SGD (LR = 0.05) then moves the two runs' parameters apart by LR x that difference, whose
# effect on the next gradient (LR x the loss's curvature times it) is below the difference itself for a tiny
# model near its initialization (curvature well under 1 / LR = 20): the differences at most add up, k x
# GRAD_DIFF at step k. The loss (a mean over <= 256 tokens of logsumexp over V=256: sums of positive terms)
# gets (V + tokens) ulps per run, twice for two, plus the first-order effect of the parameters' difference:
# LR x (sum of the earlier steps' gradient differences) . (this gradient), bounded with Cauchy-Schwarz below.
# The gradient norm: the gradients' bound plus sqrt(n) ulps for summing n squares. Measured: well under a
# tenth of each bound.
GRAD_DIFF = 256 * U32
LOSS_DIFF = 2 * (256 + 256) * U32


def _leaves(tree):
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _bound(grads, k):
  """Per leaf, the bound on |pipelined - one device| of step k's gradients (k = 1, 2, ...)."""
  return [k * GRAD_DIFF * np.abs(g).max() for _, g in _leaves(grads)]


def _assert_same_training(ref, got, what: str):
  (init0, metrics0, grads0, final0), (init1, metrics1, grads1, final1) = ref, got
  jax.tree_util.tree_map(np.testing.assert_array_equal, init1, init0)  # the pipelined init: the same parameters
  n = sum(g.size for _, g in _leaves(grads0[0]))
  drift = 0.0  # L2 bound on the parameters' difference before this step (LR x the gradient differences so far)
  for k, ((loss, norm), (loss0, norm0), g1, g0) in enumerate(zip(metrics1, metrics0, grads1, grads0), start=1):
    first_order = drift * norm0  # |d loss| <= |parameter difference| x |gradient| (Cauchy-Schwarz)
    np.testing.assert_allclose(loss, loss0, rtol=LOSS_DIFF, atol=first_order, err_msg=f"{what} step {k} loss")
    bounds = _bound(g0, k)
    np.testing.assert_allclose(norm, norm0, rtol=k * GRAD_DIFF + np.sqrt(n) * U32, err_msg=f"{what} step {k}")
    for (name, a), (_, r), tol in zip(_leaves(g1), _leaves(g0), bounds):
      np.testing.assert_allclose(a, r, rtol=0, atol=tol, err_msg=f"{what} step {k} gradient {name}")
    drift += LR * np.sqrt(sum(np.size(g) * b * b for (_, g), b in zip(_leaves(g0), bounds)))
  # the final parameters: the init minus LR x each step's gradient, each rounded (<= U32 |p|) once per step
  for (name, a), (_, r), steps in zip(_leaves(final1), _leaves(final0),
                                      zip(*[_bound(g, k) for k, g in enumerate(grads0, start=1)])):
    np.testing.assert_allclose(a, r, rtol=0, atol=LR * sum(steps) + 2 * STEPS * U32 * np.abs(r).max(),
                               err_msg=f"{what} final {name}")


@pytest.fixture(scope="module")
def one_device():
  return _train(MeshConfig(pipeline=1, data=1, fsdp=1, tensor=1), 1, grad_accum=1)


@pytest.mark.parametrize("mesh,grad_accum,repeats,gather", [
    (MeshConfig(pipeline=2, fsdp=4), 4, 1, False),  # more micro-batches than stages, FSDP inside each stage
    (MeshConfig(pipeline=2, data=2, fsdp=1, tensor=2), 2, 1, False),  # as many micro-batches as stages, tensor
    (MeshConfig(pipeline=4, fsdp=2), 4, 1, True),  # the stage's weights gathered once per step
    (MeshConfig(pipeline=4, fsdp=1, tensor=2), 8, 1, False),
    (MeshConfig(pipeline=2, fsdp=4), 4, 2, True),  # circular: 2 chunks of 1 layer per stage, gathered once
    (MeshConfig(pipeline=2, data=2, fsdp=1, tensor=2), 2, 2, False),  # circular with tensor, M = S
])
def test_pipelined_training_equals_one_device(one_device, mesh, grad_accum, repeats, gather):
  """Loss, gradient norm, every gradient of each of several SGD steps and the final parameters of a pipelined
  run (GPipe, or circular with 2 repeats) equal one device's (no pipeline, the whole batch at once) within
  float32 noise."""
  _assert_same_training(one_device, _train(mesh, 8, grad_accum, repeats=repeats, gather=gather),
                        f"{mesh} grad_accum={grad_accum} repeats={repeats} gather={gather}")


@pytest.mark.te
def test_pipelined_training_equals_one_device_on_te_layers():
  """The TE backend's layers (TE's pure-JAX path on CPU) inside the stages: the same as one device."""
  cfg = dataclasses.replace(MODEL, backend="te")
  ref = _train(MeshConfig(pipeline=1, data=1, fsdp=1, tensor=1), 1, 1, cfg)
  _assert_same_training(ref, _train(MeshConfig(pipeline=2, fsdp=2, tensor=2), 8, 4, cfg), "te")


# ---- bfloat16 -----------------------------------------------------------------------------------------------

U16 = 2.0 ** -8  # bfloat16 unit roundoff (8 significant bits, round to nearest)
# The bf16 error model of tests/test_parallel_sharding.py (its bfloat16 section says why): the reductions accumulate in
# float32 (the d_model contraction 64, the 16 keys of an attention row, the 16 x 16 tokens of a weight
# gradient; the pipeline's sum of a weight's gradient over the ticks is of float32 cotangents, the per-use
# casts' transposes, as is the step's sum over micro-batches): sqrt(n) 2^-24 relative, negligible. What
# differs from the fp32 step is the roundings to bf16 along a gradient's chain, each <= u of random sign, in
# quadrature: forward 16 per layer and 4 outside (K_FWD = 4 x 16 + 4 = 68 for MODEL's 4 layers), backward
# 14 per layer and 4 outside (4 x 14 + 4 = 60): K = 128. Per leaf, ||g_bf16 - g_fp32||_2 <= sqrt(K) u
# ||g_fp32||_2 (~ 11.3 u) for each bf16 run, the pipelined one and one device's, so the two differ by at most
# twice it; the gradient norm within the same relative bound (triangle inequality); the loss within
# sqrt(2 K_FWD) u max_t ||z_t||_2 (z: one device's fp32 logits; ||p_t - onehot_t||_2 <= sqrt(2)). One step
# from the same parameters: what follows a step is the optimizer's, the same in both dtypes.
K_FWD = MODEL.n_layers * 16 + 4
K_BF16 = K_FWD + MODEL.n_layers * 14 + 4
BF16 = dataclasses.replace(MODEL, dtype="bfloat16")
ONE = MeshConfig(pipeline=1, data=1, fsdp=1, tensor=1)


@pytest.fixture(scope="module")
def one_device_bf16():
  """One device's step in fp32 and in bf16, and the largest L2 norm of a token's fp32 logits."""
  ref = _train(ONE, 1, 1, steps=1)
  b = _batch(0)
  with model_scope(MODEL, "flax", make_mesh(ONE, jax.devices()[:1])):
    z = Transformer(MODEL, max_segments=2).apply({"params": ref[0]}, b["inputs"], b["positions"], b["segment_ids"])
  return ref, _train(ONE, 1, 1, BF16, steps=1), float(jnp.linalg.norm(z.astype(jnp.float32), axis=-1).max())


def _assert_within_bf16_error(got, ref, max_logit_norm, what):
  (init, [(loss, norm)], [grads], _), (init0, [(loss0, norm0)], [grads0], _) = got, ref
  jax.tree_util.tree_map(np.testing.assert_array_equal, init, init0)  # the same parameters
  assert abs(loss - loss0) <= np.sqrt(2 * K_FWD) * U16 * max_logit_norm, (what, loss, loss0)
  assert abs(norm - norm0) <= np.sqrt(K_BF16) * U16 * norm0, (what, norm, norm0)
  for (name, g), (_, r) in zip(_leaves(grads), _leaves(grads0)):
    err, scale = np.linalg.norm(g - r), np.linalg.norm(r)
    assert err <= np.sqrt(K_BF16) * U16 * scale, f"{what} gradient {name}: {err / scale / U16:.2f} u"


@pytest.mark.parametrize("mesh,grad_accum,repeats", [(MeshConfig(pipeline=2, fsdp=4), 4, 1),
                                                     (MeshConfig(pipeline=4, fsdp=2), 4, 1),
                                                     (MeshConfig(pipeline=2, fsdp=4), 4, 2)])
def test_bfloat16_pipelined_step_equals_one_device(one_device_bf16, mesh, grad_accum, repeats):
  """bf16 (issue 56: every pipeline equality test was float32): the loss, gradient norm and every gradient of a
  pipelined step (micro-batches over 2 or 4 stages, FSDP inside each) and of one device's bf16 step are each
  within the bf16 error model above of one device's fp32 step, so within twice it of each other."""
  ref, one, max_logit_norm = one_device_bf16
  _assert_within_bf16_error(one, ref, max_logit_norm, "one device")
  _assert_within_bf16_error(_train(mesh, 8, grad_accum, BF16, steps=1, repeats=repeats, gather=repeats > 1),
                            ref, max_logit_norm, f"{mesh} grad_accum={grad_accum} repeats={repeats}")


# ---- checkpoints across pipeline degrees -------------------------------------------------------------------

RUN = ["model.backend=flax", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
       "model.ffn_dim=64", "model.n_layers=2", "model.vocab_size=128", "model.remat=none", "data.type=synthetic",
       "data.seq_len=16", "data.global_batch_size=16", "train.grad_accum=2", "optim.warmup_steps=0",
       "optim.decay_steps=10",  # the schedule does not depend on train.steps: a run of 2 steps is the first 2 of 3
       "train.log_every=1", "checkpoint.enabled=true", "mesh.fsdp=-1"]


def _restored(run_dir, args):
  """The latest checkpoint of run_dir restored onto the mesh of `args` (the trainer's own target): leaves on
  the host, and the layers one device holds of the stacked qkv kernel."""
  cfg = load_config(args)
  t = Trainer(cfg)
  try:
    t.build(abstract=True)  # the trainer's own state target: ShapeDtypeStructs with shardings
    target = t.state
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    try:
      state = ckpt.restore_latest(target, to_dict(cfg)).state
    finally:
      ckpt.close()
  finally:
    t.close()
  leaves = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  return leaves, state.params["layers"]["qkv"]["kernel"].addressable_shards[0].data.shape[0]


def _losses(run_dir) -> dict:
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def degree_cache(tmp_path_factory):
  """One compilation cache for both directions: each compiles the same programs (the step at pipeline 1 and 2,
  their restores), so the second loads what the first compiled (alone: 20.6 + 16.4 s -> 18.2 + 6.7 s, measured).
  What is checked is the restored values and losses, not the compiles; the cache is not under test here."""
  return tmp_path_factory.mktemp("xla-cache")


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_a_checkpoint_restores_at_another_pipeline_degree(tmp_path, capsys, degree_cache, first, then):
  """The saved tree is per layer ([L, ...]) whatever the pipeline degree: a run saved with mesh.pipeline=first
  resumes with mesh.pipeline=then, every restored value equal to the saved one (only the sharding differs),
  and its next step's loss is the uninterrupted run's (the same parameters; float32 noise of the forward)."""
  with compile_cache(degree_cache):
    common = [*RUN, f"output_dir={tmp_path}"]
    assert main([*common, "run_name=whole", f"mesh.pipeline={first}", "train.steps=3"]) == 0
    assert main([*common, "run_name=r", f"mesh.pipeline={first}", "train.steps=2"]) == 0
    saved, layers_first = _restored(tmp_path / "r", [*common, "run_name=r", f"mesh.pipeline={first}"])
    moved, layers_then = _restored(tmp_path / "r", [*common, "run_name=r", f"mesh.pipeline={then}"])
    capsys.readouterr()
    assert main([*common, "run_name=r", f"mesh.pipeline={then}", "train.steps=3"]) == 0
  assert "resumed from checkpoint step 2 " in capsys.readouterr().out
  assert saved.keys() == moved.keys() and len(saved) > 10
  for k in saved:
    np.testing.assert_array_equal(moved[k], saved[k], err_msg=k)
  assert (layers_first, layers_then) == (2 // first, 2 // then)  # of the 2 layers: a stage's, or all
  whole, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "r")
  assert resumed[1] == whole[1] and resumed[2] == whole[2]  # the steps before the save: the same run
  # Step 3 starts from the same (restored) parameters on another schedule: the loss, a mean of 256 tokens'
  # logsumexp over V=128 (sums of positive terms), differs by the two runs' rounding, (V + tokens) ulps each.
  np.testing.assert_allclose(resumed[3], whole[3], rtol=2 * (128 + 256) * U32)


def test_a_circular_checkpoint_restores_at_gpipe_and_without_a_pipeline(tmp_path, capsys, degree_cache):
  """A run saved with the circular schedule (2 stages x 2 repeats of 1 layer each: stage s runs layers s and
  2 + s, not the block it stores) restores with every value equal at GPipe over 2 stages and at pipeline 1,
  and resumes there with the uninterrupted circular run's loss (the same parameters; float32 noise)."""
  circular = ["mesh.pipeline=2", "train.pipeline_schedule=circular", "train.pipeline_repeats=2",
              "train.pipeline_gather=step"]
  with compile_cache(degree_cache):
    common = [*RUN, "model.n_layers=4", f"output_dir={tmp_path}"]
    assert main([*common, "run_name=whole", *circular, "train.steps=3"]) == 0
    assert main([*common, "run_name=r", *circular, "train.steps=2"]) == 0
    saved, layers_saved = _restored(tmp_path / "r", [*common, "run_name=r", *circular])
    gpipe, layers_gpipe = _restored(tmp_path / "r", [*common, "run_name=r", "mesh.pipeline=2"])
    single, layers_single = _restored(tmp_path / "r", [*common, "run_name=r", "mesh.pipeline=1"])
    capsys.readouterr()
    assert main([*common, "run_name=r", "mesh.pipeline=1", "train.steps=3"]) == 0
  assert "resumed from checkpoint step 2 " in capsys.readouterr().out
  assert saved.keys() == gpipe.keys() == single.keys() and len(saved) > 10
  for k in saved:
    np.testing.assert_array_equal(gpipe[k], saved[k], err_msg=k)
    np.testing.assert_array_equal(single[k], saved[k], err_msg=k)
  assert (layers_saved, layers_gpipe, layers_single) == (2, 2, 4)  # stored in per-layer blocks either way
  whole, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "r")
  assert resumed[1] == whole[1] and resumed[2] == whole[2]
  np.testing.assert_allclose(resumed[3], whole[3], rtol=2 * (128 + 256) * U32)
