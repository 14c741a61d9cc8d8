"""Expert parallelism in the model (maxlm/layers/moe.py through maxlm/parallel/experts.py): whole train steps of the
tiny MoE (configs/tiny_moe.yml's decoder) with the experts split over `mesh.expert` (2, 4, and beside fsdp and
data) equal one device's in loss and every gradient, in float32 and in bfloat16; the experts' weights actually
split; the load-balancing loss the whole batch's; the refusals of a bad expert degree."""

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm.build import CompiledStep, build_step
from maxlm.checkpoint import Checkpointer
from maxlm.config import CheckpointConfig, ConfigError, MeshConfig, OptimConfig, load_config, to_dict
from maxlm.data import BATCH_KEYS
from maxlm.layers import moe, precision_scope
from maxlm.model import Transformer
from maxlm.optim import make_optimizer
from maxlm.parallel.mesh import make_mesh, mesh_shape
from maxlm.parallel.sharding import TE_MESH_AXES, axis_rules, batch_sharding, replicated
from maxlm.step import make_train_step
from maxlm.train_state import create_train_state
from maxlm.trainer import Trainer

TINY = dataclasses.replace(load_config(["config=tiny_moe.yml"]).model, backend="flax")  # 4 blocks, 8 experts, top 2
B, T = 8, 16
U32, U16 = 2.0 ** -24, 2.0 ** -8


def recorder() -> optax.GradientTransformation:
  """Leaves the params as they are and keeps the step's gradients as its state (as tests/test_parallel_sharding.py)."""
  return optax.GradientTransformation(lambda p: jax.tree_util.tree_map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (jax.tree_util.tree_map(jnp.zeros_like, g), g))


def step_batch(i: int) -> dict:
  rng = np.random.default_rng(i)
  toks = rng.integers(0, TINY.vocab_size, (B, T + 1), dtype=np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}


def train_steps(mesh_cfg: MeshConfig, n_devices: int, steps: int = 2, optimizer=None, **model_kw):
  """`steps` jitted, sharded train steps: ([(loss, grad_norm, aux loss, drop rate or -1)], [gradients on the host],
  final state)."""
  mesh = make_mesh(mesh_cfg, jax.devices()[:n_devices])
  cfg = dataclasses.replace(TINY, **model_kw)
  model = Transformer(cfg, max_segments=16)
  _, schedule = make_optimizer(OptimConfig(warmup_steps=0, learning_rate=1e-2), 10)
  optimizer = optimizer or recorder()

  @contextlib.contextmanager
  def scope():
    with jax.set_mesh(mesh), axis_rules(), precision_scope("bf16", cfg.backend, mesh_axes=TE_MESH_AXES):
      yield

  with scope():
    state, shardings = create_train_state(model, optimizer, mesh, seed=0, batch=B, seq_len=T)
  bs = batch_sharding(mesh)
  step = CompiledStep(make_train_step(model, optimizer, schedule, packed=False), shardings,
                      {k: bs for k in BATCH_KEYS}, scope, metrics_sharding=replicated(mesh))
  metrics, grads = [], []
  for i in range(steps):
    state, m = step(state, {k: jax.device_put(v, bs) for k, v in step_batch(i).items()})
    metrics.append((float(m["loss"]), float(m["grad_norm"]), float(m["moe_aux_loss"]), float(m.get("moe_dropped", -1))))
    grads.append(jax.tree_util.tree_map(np.asarray, state.opt_state))
  return metrics, grads, state


@functools.cache
def one_device(**model_kw):
  return train_steps(MeshConfig(fsdp=1), 1, **model_kw)


# float32. A mesh changes only the order of float32 sums: over the batch's 8 x 16 tokens (split over data x fsdp x
# expert; with the experts split, each expert's weight gradient sums its tokens in the order they arrive) and
# none inside a token's forward (no tensor axis; the exchange moves rows without arithmetic; with context 2 the
# attention's sums over keys come permuted, each of length <= 16, inside the same count). A contraction of
# length n carries rounding of random sign ~ sqrt(n) ulps, n <= 512 (the vocabulary) here: <= 23 ulps. Along the
# backward chain of a leaf, 1 + 6 x 4 = 25 contractions (the LM head; per block qkv, attention, out, the router
# and the experts' w1/w3 and w2) add in quadrature (5 x 23 = 113 ulps), plus sqrt(128) = 11 for the sum over the
# tokens: 124 ulps of a leaf's largest gradient per run, two runs 248. The loss (a mean over 128 tokens of
# logsumexp over V = 512) (V + tokens) ulps; the gradient norm the gradient bound plus sqrt(n) ulps for its n
# squares.
GRAD_DIFF = 2 * (5 * np.sqrt(512) + np.sqrt(B * T)) * U32
LOSS_DIFF = (TINY.vocab_size + B * T) * U32

CAPACITY = {"moe": dataclasses.replace(TINY.moe, capacity_factor=1.0)}  # drops: the first-come order is global
MESHES = {  # name: (mesh, devices, model changes)
    "expert2": (MeshConfig(expert=2, fsdp=1), 2, {}),
    "expert4": (MeshConfig(expert=4, fsdp=1), 4, {}),
    "expert2_fsdp2": (MeshConfig(expert=2, fsdp=2), 4, {}),
    "expert2_data2_fsdp2": (MeshConfig(expert=2, data=2, fsdp=2), 8, {}),
    "expert2_context2": (MeshConfig(expert=2, context=2, fsdp=1), 4, {}),  # the sequence split too
    "expert4_capacity": (MeshConfig(expert=4, fsdp=1), 4, CAPACITY),
    "expert2_dense_kernel": (MeshConfig(expert=2, fsdp=1), 2, {"moe": dataclasses.replace(TINY.moe, kernel="dense")}),
    "expert2_fsdp2_te": (MeshConfig(expert=2, fsdp=2), 4, {"backend": "te"}),  # TE's dense layers, pure-JAX experts
}
CASES = [pytest.param(name, marks=pytest.mark.te) if name.endswith("_te") else name for name in MESHES]


def leaf_names(state) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_train_steps_equal_one_device(case):
  """Loss, gradient norm, the load-balancing loss and every gradient of two train steps (the second on the first's
  batch 1, a different routing) with the experts split equal one device's within the float32 bounds above; in
  capacity mode too (factor 1: each expert takes at most N k / E of the batch's assignments, the rest dropped,
  the same ones as on one device)."""
  mesh_cfg, n_devices, model_kw = MESHES[case]
  ref_metrics, ref_grads, ref_state = one_device(**model_kw)
  metrics, grads, state = train_steps(mesh_cfg, n_devices, **model_kw)
  n = sum(x.size for x in jax.tree_util.tree_leaves(ref_state.params))
  for i, ((loss, norm, aux, dropped), (r_loss, r_norm, r_aux, r_dropped)) in enumerate(zip(metrics, ref_metrics)):
    assert dropped == r_dropped and (dropped > 0) == (model_kw is CAPACITY), (case, i, dropped, r_dropped)
    np.testing.assert_allclose(loss, r_loss, rtol=LOSS_DIFF, err_msg=f"{case} step {i}")
    np.testing.assert_allclose(aux, r_aux, rtol=LOSS_DIFF, err_msg=f"{case} step {i} aux loss")
    np.testing.assert_allclose(norm, r_norm, rtol=GRAD_DIFF + np.sqrt(n) * U32, err_msg=f"{case} step {i}")
    for name, g, r in zip(leaf_names(ref_state), *map(jax.tree_util.tree_leaves, (grads[i], ref_grads[i]))):
      np.testing.assert_allclose(g, r, rtol=0, atol=GRAD_DIFF * np.abs(r).max(), err_msg=f"{case} step {i} {name}")


# bfloat16. tests/test_parallel_sharding.py's error model (its bfloat16 section says why): each bf16 run is within
# sqrt(K) u (L2, per leaf) of one device's fp32 run, K the bf16 roundings along a gradient's chain. Counted for an
# MoE block: forward 19 per layer (the two norms' outputs; the qkv, out, w1, w3 and w2 kernels and their products;
# the rotated q/k; the attention output; silu and its product with the up projection; the combined experts'
# output; the two residual sums; the router computes in float32 from the norm's output, counted) and 4 outside:
# K_FWD = 4 x 19 + 4 = 80; backward, the 14 activations' cotangents and the 5 weight gradients per layer and 4
# outside: 80. A top-k choice is discontinuous: a rounding anywhere before the router flips a near tie, which no
# tolerance bounds (measured: bf16 on one device and on expert 2 x fsdp 1 routed one assignment differently at
# top 2); so here every token goes to all 8 experts (top_k = experts: the weights continuous in the logits, and
# the exchange still sends each device's rows to every other device).
K_FWD = 4 * 19 + 4
K_BF16 = K_FWD + 4 * 19 + 4
ALL_EXPERTS = {"moe": dataclasses.replace(TINY.moe, top_k=TINY.moe.experts)}


def max_logit_norm(params, i: int) -> float:
  cfg = dataclasses.replace(TINY, **ALL_EXPERTS)
  mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
  with jax.set_mesh(mesh), axis_rules():
    z, _ = Transformer(cfg, max_segments=16).apply({"params": params}, step_batch(i)["inputs"],
                                                   step_batch(i)["positions"], None, mutable=[moe.COLLECTION])
  return float(jnp.linalg.norm(z, axis=-1).max())


def assert_within_bf16_error(got, ref, logit_norms, label):
  (metrics, grads, _), (ref_metrics, ref_grads, ref_state) = got, ref
  for i, ((loss, norm, *_), (r_loss, r_norm, *_)) in enumerate(zip(metrics, ref_metrics)):
    assert abs(loss - r_loss) <= np.sqrt(2 * K_FWD) * U16 * logit_norms[i], (label, i, loss, r_loss)
    assert abs(norm - r_norm) <= np.sqrt(K_BF16) * U16 * r_norm, (label, i, norm, r_norm)
    for name, g, r in zip(leaf_names(ref_state), *map(jax.tree_util.tree_leaves, (grads[i], ref_grads[i]))):
      err, scale = np.linalg.norm(g - r), np.linalg.norm(r)
      assert err <= np.sqrt(K_BF16) * U16 * scale, f"{label} step {i} {name}: {err / scale / U16:.2f} u"


def test_bfloat16_expert_parallel_equals_one_device():
  """bf16 steps on expert 4 x fsdp 2 and on one device, each within the bf16 error model of one device's fp32
  steps (so within twice it of each other); the cross-device sums of the experts' gradients run in float32."""
  ref = one_device(dtype="float32", **ALL_EXPERTS)
  norms = [max_logit_norm(ref[2].params, i) for i in range(2)]
  assert_within_bf16_error(one_device(dtype="bfloat16", **ALL_EXPERTS), ref, norms, "one device")
  got = train_steps(MeshConfig(expert=4, fsdp=2), 8, dtype="bfloat16", **ALL_EXPERTS)
  assert_within_bf16_error(got, ref, norms, "expert 4 x fsdp 2")


def test_experts_and_their_optimizer_state_are_split_over_the_expert_axis():
  """expert 4 x fsdp 2: each device holds E / 4 = 2 experts, their D = 128 split over fsdp (64), F whole; the dense
  weights' D over fsdp x expert (ZeRO over the expert group too: 128 / 8 = 16); Adam's moments alike."""
  optimizer, _ = make_optimizer(OptimConfig(warmup_steps=0, learning_rate=1e-2), 10)
  _, _, state = train_steps(MeshConfig(expert=4, fsdp=2), 8, steps=1, optimizer=optimizer)
  layers = state.params["layers"]
  assert layers["moe"]["w1"].addressable_shards[0].data.shape == (4, 2, 64, 128)  # [L, E, D, F]
  assert layers["moe"]["w2"].addressable_shards[0].data.shape == (4, 2, 128, 64)  # [L, E, F, D]
  assert layers["moe"]["router"].addressable_shards[0].data.shape == (4, 16, 8)  # [L, D, E]
  assert layers["qkv"]["kernel"].addressable_shards[0].data.shape[1] == 16
  first = sorted({s.index[1].start for s in layers["moe"]["w1"].addressable_shards})
  assert first == [0, 2, 4, 6]  # 4 groups of 2 experts, each on the 2 devices of its fsdp pair
  like = lambda x: jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(state.params)
  moments = [t for t in jax.tree_util.tree_leaves(state.opt_state, is_leaf=like) if like(t)]
  assert len(moments) == 2  # AdamW's mu and nu
  for tree in moments:
    assert tree["layers"]["moe"]["w1"].addressable_shards[0].data.shape == (4, 2, 64, 128)


def test_the_expert_axis_takes_its_devices_from_fsdps_minus_one():
  """mesh.expert between fsdp and context (the batch over data x fsdp x expert); the other axes' -1 rules as
  before; an error names mesh.expert only where it is not 1."""
  assert mesh_shape(MeshConfig(expert=2), 8) == ([1, 1, 4, 2, 1, 1], [1, 1, 1, 1, 1, 1])
  assert mesh_shape(MeshConfig(expert=-1, fsdp=2), 8) == ([1, 1, 2, 4, 1, 1], [1, 1, 1, 1, 1, 1])
  assert (mesh_shape(MeshConfig(fsdp=4, dcn_data=1, dcn_expert=-1), 8, n_nodes=2)
          == ([1, 1, 4, 1, 1, 1], [1, 1, 1, 2, 1, 1]))
  with pytest.raises(ConfigError, match=r"^mesh: mesh.pipeline=1 x mesh.data=1 x mesh.fsdp=2 x mesh.expert=2 x "
                                        r"mesh.context=1 x mesh.tensor=1 multiply to 4, but there are 8 devices"):
    mesh_shape(MeshConfig(fsdp=2, expert=2), 8)


@pytest.mark.parametrize("bad,words", [
    (["model.moe.experts=0", "mesh.expert=2"], "model.moe.experts=0: no experts"),
    (["mesh.expert=3"], "model.moe.experts=8: 8 experts, not divisible by it"),
    (["mesh.expert=2", "mesh.dcn_expert=8"], "mesh.expert x mesh.dcn_expert = 16"),
])
def test_a_bad_expert_degree_is_refused_at_load(bad, words):
  with pytest.raises(ConfigError, match=words):
    load_config(["config=tiny_moe.yml", *bad])


SMALL = ["config=tiny_moe.yml", "model.backend=flax", "model.n_layers=2", "data.type=synthetic", "data.seq_len=16",
         "data.global_batch_size=8", "optim.warmup_steps=0"]


def host(tree) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_a_checkpoint_saved_at_expert_4_restores_at_expert_1_and_2(tmp_path):
  """Saved with the experts over 4 devices (x fsdp 2), restored bit for bit with them over 2 (x fsdp 4), over none
  (fsdp 8) and on one device, each array with its new mesh's sharding."""
  cfg = load_config([*SMALL, "mesh.expert=4", "mesh.fsdp=2"])
  t = Trainer(cfg)
  t.build()
  assert t.state.params["layers"]["moe"]["w1"].addressable_shards[0].data.shape == (2, 2, 64, 128)
  state = jax.jit(lambda s: jax.tree_util.tree_map(  # every array changed, as a step would
      lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.integer) else x * 1.5 + 0.25, s))(t.state)
  want = host(state)
  ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(enabled=True))
  ckpt.save(1, state, t.train_data.get_state(), to_dict(cfg))
  ckpt.close()
  t.train_data.close()
  for mesh, devices in ((["mesh.expert=2", "mesh.fsdp=4"], None), (["mesh.expert=1", "mesh.fsdp=8"], None),
                        (["mesh.expert=1", "mesh.fsdp=1"], jax.devices()[:1])):
    new = load_config([*SMALL, *mesh])
    built = build_step(new, make_mesh(new.mesh, devices), abstract=True)
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(enabled=True))
    r = ckpt.restore_latest(built.state, to_dict(new))
    ckpt.close()
    assert r.step == 1 and len(want) == len(host(r.state)), mesh
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(host(r.state), want)), mesh
    for x, s in zip(jax.tree_util.tree_leaves(r.state), jax.tree_util.tree_leaves(built.state_shardings)):
      assert x.sharding == s, mesh


ROOT = Path(__file__).resolve().parent.parent


def run_cli(tmp_path, *args, devices=4):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"}
  return subprocess.run([sys.executable, "-m", "maxlm.train", "config=tiny_moe.yml", f"output_dir={tmp_path}",
                         "run_name=m", "model.backend=flax", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def test_the_train_command_trains_with_the_experts_split(tmp_path):
  """`python -m maxlm.train config=tiny_moe.yml mesh.expert=2` on 4 CPU devices (expert 2 x fsdp 2): three steps,
  finite losses, the load-balancing loss logged."""
  r = run_cli(tmp_path, "mesh.expert=2", "train.steps=3", "train.log_every=1", "train.eval_every=0",
              "checkpoint.enabled=false")
  assert r.returncode == 0, r.stderr
  rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [1, 2, 3]
  assert all(np.isfinite(row["loss"]) and row["moe_aux_loss"] > 0 for row in rows)
  assert "'fsdp': 2, 'expert': 2" in r.stdout, r.stdout  # the mesh line: expert 2 x fsdp 2


def test_an_expert_degree_that_does_not_split_the_experts_stops_the_cli_with_exit_2(tmp_path):
  """-1 leaves the degree to the device count: refused once the mesh is made (4 devices: expert 4 is fine, 3
  devices: 8 experts do not split over 3)."""
  r = run_cli(tmp_path, "mesh.expert=-1", "mesh.fsdp=1", "train.steps=1", devices=3)
  assert r.returncode == 2, r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("maxlm: error:")]
  assert errors == ["maxlm: error: mesh.expert x mesh.dcn_expert = 3 (expert parallelism) but model.moe.experts=8: "
                    "8 experts, not divisible by it; use an expert degree that divides model.moe.experts, or 1"], \
      r.stderr
