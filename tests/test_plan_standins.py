"""The stand-ins for measuring a GPU's step on XLA:CPU (maxlm/plan/standins.py): fused attention's footprint
(shapes and gradients), and bf16 kept as bf16 on simulated devices (FSDP's weight all-gathers bf16, as on
XLA:GPU; an f32 fallback that says so; remat policies keep the rounded GEMM results)."""

import json
import re
import subprocess
import sys

import jax
import pytest
from jax.ad_checkpoint import checkpoint_name

from maxlm.plan import target as plan_target
from maxlm.config import load_config
from maxlm.plan import measure as plan_measure
from maxlm.plan import standins as plan_standins


# In a child on 2 simulated CPU devices (the Simulator's environment): the simulated step of a tiny FSDP model
# (as `measure(gpu_footprint=True)` compiles it) and its optimized HLO's all-gathers by element type.
GATHERS_CHILD = r"""
import collections, json, re, sys
from maxlm.config import load_config
from maxlm.plan import measure as plan_measure
text = plan_measure.compile_step(load_config(sys.argv[1:]), fused_attention=True)[0].as_text()
print(json.dumps(collections.Counter(re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather\(", text))))
"""


@pytest.mark.parametrize("backend", [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)])
def test_simulated_fsdp_gathers_weights_in_bf16(backend):
  # XLA:GPU gathers FSDP's bf16 weights in bf16; XLA:CPU's float normalization made every one of them f32,
  # doubling the gathered weights of a simulated step (plan_standins.GPU_DTYPE_OPTIONS)
  args = [f"model.backend={backend}", "data.type=synthetic", "data.global_batch_size=4", "model.remat=save_dots"]
  child = subprocess.run([sys.executable, "-c", GATHERS_CHILD, *args], env=plan_target.simulated_env(2),
                         capture_output=True, text=True, timeout=300, check=False)
  assert child.returncode == 0, child.stderr[-3000:]
  gathers = json.loads(child.stdout.splitlines()[-1])
  # 9 when written: a layer's 4 weights (qkv, out, MLP in and out) for the forward and again for the backward,
  # and the LM head; before GPU_DTYPE_OPTIONS the same 9 were f32
  assert gathers.get("bf16", 0) >= 4 and gathers.get("f32", 0) == 0, gathers


def test_simulated_bf16_has_an_f32_fallback_and_remat_keeps_rounded_gemms(monkeypatch):
  cfg = load_config(["model.backend=flax", "data.type=synthetic", "data.global_batch_size=8"])
  kept = plan_measure.measure(cfg, gpu_footprint=True)
  # a bf16 GEMM not traced through _gpu_dot: XLA:CPU cannot emit it with bf16 kept; the step is measured
  # as XLA:CPU compiles it otherwise (bf16 in f32: higher), and says so
  monkeypatch.setattr(plan_standins, "_gpu_dot", plan_standins._LAX_DOT)
  f32 = plan_measure.measure(cfg, gpu_footprint=True)
  assert kept["how"] == "measured" and f32["how"].startswith("measured, bf16 computed in f32")
  assert f32["device"] > kept["device"]
  # a GEMM's rounded bf16 result is kept by exactly the policies that keep dots without batch dimensions
  cp = jax.checkpoint_policies
  name_p = jax.make_jaxpr(lambda x: checkpoint_name(x, "any"))(1.0).eqns[0].primitive
  saves = {k: plan_standins._saving_sim_dots(p)(name_p, name=plan_standins.SIM_DOT)
           for k, p in {"dots": cp.checkpoint_dots_with_no_batch_dims, "nothing": cp.nothing_saveable,
                        "context": cp.save_only_these_names("context")}.items()}
  assert saves == {"dots": True, "nothing": False, "context": False}
  assert plan_standins._saving_sim_dots(None) is None


def test_standin_attention_has_attentions_shapes_and_gradients():
  q = jax.ShapeDtypeStruct((2, 16, 8, 4), jax.numpy.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 16, 2, 4), jax.numpy.bfloat16)
  f = lambda q, k, v: plan_standins.standin_attention(q, k, v).astype(float).sum()
  out = jax.eval_shape(plan_standins.standin_attention, q, kv, kv)
  grads = jax.eval_shape(jax.grad(f, argnums=(0, 1, 2)), q, kv, kv)
  assert (out.shape, out.dtype) == (q.shape, q.dtype)
  assert [(g.shape, g.dtype) for g in grads] == [(q.shape, q.dtype), (kv.shape, kv.dtype), (kv.shape, kv.dtype)]


# In a child on 8 simulated CPU devices: the context exchange of a tiny model's step, as the planner compiles it
# (`compile_step(fused_attention=True)`: the stand-in, bf16 kept) and, with "real", as the trainer does (the
# pure-JAX context-parallel attention, maxlm/parallel/context.py; XLA:CPU computes its bf16 in f32): the
# collectives over the context axis (groups of cp devices; a permute's pairs) that move K or V (4-D) or their segment ids and
# positions (s32), by "kind dtype[shape]", counted per step (scanned layers times their trip count).
EXCHANGE_CHILD = r"""
import collections, json, re, sys
from maxlm.build import build_step
from maxlm.config import load_config
from maxlm.parallel.mesh import make_mesh
from maxlm.plan import collectives
from maxlm.plan import measure as plan_measure

def exchange(text, cp):
  types = dict(re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z0-9]+\[[\d,]*\])", text, re.M))
  out = collections.Counter()
  for op in collectives.parse(text, n_devices=8):
    kind = types.get(op.name, "?")
    if op.group == (2 if op.kind == "collective-permute" else cp) and (kind.count(",") == 3 or kind.startswith("s32")):
      out[f"{op.kind} {kind}"] += op.times
  return out

cfg = load_config(sys.argv[2:])
res = {"standin": exchange(plan_measure.compile_step(cfg, fused_attention=True)[0].as_text(), cfg.mesh.context)}
if sys.argv[1] == "real":
  built = build_step(cfg, make_mesh(cfg.mesh), abstract=True)
  res["real"] = exchange(built.train_step.lower(built.state, built.batch_structs()).compile().as_text(),
                         cfg.mesh.context)
print(json.dumps(res))
"""


def exchange_by_hand(strategy: str, cp: int, layers=2, batch=8, seq=128, kv=2, dh=32, devices=8) -> dict:
  """The K/V collectives of one step of a `layers`-layer model, batch x seq tokens, kv heads of dh, on `devices`
  as cp (context) x devices / cp (fsdp, which splits the batch), the model's dtype bf16. Each layer's forward
  exchange runs twice per step: in the forward, and again in the backward, where JAX's AD of the shard_map
  recomputes the forward inside it (the jaxpr shows it, for the real attention as for the stand-in)."""
  b = batch // (devices // cp)  # rows per device
  if strategy == "ring":
    # cp - 1 passes of the bf16 K and V blocks forward (x 2, above), and of their bf16 cotangents backward
    return {f"collective-permute bf16[{b},{seq // cp},{kv},{dh}]": layers * 2 * (cp - 1) * 3}
  # K and V gathered in bf16 (x 2, above), their float32 cotangents reduce-scattered once, each device's own rows
  # only (the batch axes manual in the shard_map; left automatic, XLA gathered the whole batch on every device)
  return {f"all-gather bf16[{b},{seq},{kv},{dh}]": layers * 2 * 2,
          f"reduce-scatter f32[{b},{seq // cp},{kv},{dh}]": layers * 2}


def _kv_only(counts: dict) -> dict:
  return {k: n for k, n in counts.items() if not k.split()[1].startswith("s32")}


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_planned_program_has_the_context_exchange(strategy, cp):
  # the stand-in used to leave the exchange out: a ring step compiled with it had 0 collective-permutes
  args = ["model.backend=flax", "model.dtype=bfloat16", "data.type=synthetic", "data.seq_len=128",
          "data.global_batch_size=8", f"mesh.context={cp}", f"mesh.fsdp={8 // cp}", f"mesh.context_strategy={strategy}"]
  child = subprocess.run([sys.executable, "-c", EXCHANGE_CHILD, "real", *args], env=plan_target.simulated_env(8),
                         capture_output=True, text=True, timeout=600, check=False)
  assert child.returncode == 0, child.stderr[-3000:]
  got = json.loads(child.stdout.splitlines()[-1])
  assert _kv_only(got["standin"]) == exchange_by_hand(strategy, cp), got
  # the trainer's program moves the same K/V blocks the same number of times (XLA:CPU computes its bf16 in f32)
  as_f32 = lambda counts: {re.sub(r" \w+\[", " [", k): n for k, n in _kv_only(counts).items()}
  assert as_f32(got["standin"]) == as_f32(got["real"]), got
  # and passes (or gathers) segment ids and positions with them, as many times as the real attention
  ids = lambda counts: sum(n for k, n in counts.items() if k.split()[1].startswith("s32"))
  assert ids(got["standin"]) == ids(got["real"]) > 0, got
