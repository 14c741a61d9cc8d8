"""The stand-ins for measuring a GPU's step on XLA:CPU (maxlm/plan/standins.py): fused attention's footprint
(shapes and gradients), and bf16 kept as bf16 on simulated devices (FSDP's weight all-gathers bf16, as on
XLA:GPU; an f32 fallback that says so; remat policies keep the rounded GEMM results)."""

import json
import subprocess
import sys

import jax
import pytest
from jax.ad_checkpoint import checkpoint_name

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
  child = subprocess.run([sys.executable, "-c", GATHERS_CHILD, *args], env=plan_measure.simulated_env(2),
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
