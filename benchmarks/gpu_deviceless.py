"""Compile for NVIDIA GPUs on a machine without one, and read XLA:GPU's own memory analysis (exploratory).

JAX's CUDA plugin can make compile-only devices from a GPU target description (`jax.experimental.topologies.
get_topology_desc(platform="cuda", target_config=<GpuTargetConfigProto text>, topology="1x1xN")`): XLA:GPU then
compiles for N such GPUs with no GPU present and no CUDA driver. This script does that for two programs:

  cond   the Adam-like update of three donated float32 arrays, plain and inside `lax.cond` (maxlm/step.py's
         non-finite guard), on the GPU target and on XLA:CPU: whether each compiler updates in place.
  step   maxlm's train step of a config (plan_measure.compile_step, fused attention's footprint), its per-device
         memory by field (GiB). What fills the temporaries: add XLA_FLAGS=--xla_dump_to=DIR and read
         DIR/*jit_step*memory-usage-report.txt.

    pip install --no-deps --target DIR jax-cuda13-plugin==<jax version> jax-cuda13-pjrt==<jax version>
    PYTHONPATH=DIR JAX_PLATFORMS=cpu python benchmarks/gpu_deviceless.py cond
    PYTHONPATH=DIR JAX_PLATFORMS=cpu python benchmarks/gpu_deviceless.py step --devices 1 config=llama8b.yml \
        model.n_layers=4 data.seq_len=4096 data.global_batch_size=4 model.remat=full [--select-guard]

--target FILE (default maxlm/plan/gpu_targets/h200.txtpb). One JSON line per measurement on stdout. On a machine
with a GPU (the H200) the same commands compile for the target given, not for the GPU at hand.

Host memory (optim.offload=host or host_params): compile_step compiles XLA:GPU's own program with the state in
pinned host memory (compile-only devices drop a sharding's memory kind; maxlm/plan/target.py
`compile_in_host_memory` goes through AbstractMesh shardings); the host_* memory fields are reported beside the
device ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from maxlm.config import load_config
from maxlm.offload import in_host_memory, to_device_memory, to_host_memory
from maxlm.plan.measure import compile_step

HERE = Path(__file__).resolve().parent
GIB = 2 ** 30


def gpu_devices(target: Path, n: int):
  return topologies.get_topology_desc(platform="cuda", target_config=target.read_text(),
                                      topology=f"1x1x{n}").devices


def _stats(compiled) -> dict:
  m = compiled.memory_analysis()
  return {k: round(getattr(m, f"{k}_size_in_bytes") / GIB, 3)
          for k in ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_alias", "host_temp")}


def cond(target: Path) -> None:
  def plain(state, g):
    p, m, v = state
    m = 0.9 * m + 0.1 * g  # [N, N] each
    v = 0.99 * v + 0.01 * g * g
    return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

  def guarded(state, g):
    return jax.lax.cond(jnp.isfinite(jnp.sum(g)), lambda _: plain(state, g), lambda _: state, None)

  for where, sharding in (("XLA:GPU " + target.stem, SingleDeviceSharding(gpu_devices(target, 1)[0])),
                          ("XLA:CPU", None)):
    a = jax.ShapeDtypeStruct((8192, 8192), jnp.float32, sharding=sharding)  # 0.25 GiB
    for name, fn in (("plain", plain), ("lax.cond", guarded)):
      compiled = jax.jit(fn, donate_argnums=(0,)).lower((a, a, a), a).compile()
      print(json.dumps({"program": f"update of 3 donated 0.25 GiB arrays, {name}", "compiler": where,
                        "jax": jax.__version__,
                        **_stats(compiled)}), flush=True)


def _select_cond(pred, true_fn, false_fn, operand):
  """lax.cond as a select of both branches' results, leaf by leaf (a what-if for `--select-guard`), on the device:
  leaves in host memory (optim.offload) are moved there first and back after."""
  def select(a, b):
    if in_host_memory((a, b)):
      return to_host_memory(jnp.where(pred, *to_device_memory((a, b))))
    return jnp.where(pred, a, b)
  return jax.tree.map(select, true_fn(operand), false_fn(operand))


def step(target: Path, n: int, words: list[str], select_guard: bool) -> None:
  cfg = load_config(words + ["plan.mode=off"])
  t0 = time.time()
  with mock.patch.object(jax.lax, "cond", _select_cond) if select_guard else contextlib.nullcontext():
    compiled, parts = compile_step(cfg, gpu_devices(target, n), fused_attention=True)
  seconds = time.time() - t0
  st = _stats(compiled)
  st["device"] = round(st["argument"] + st["output"] + st["temp"] - st["alias"], 3)
  st["host"] = round(st["host_argument"] + st["host_output"] + st["host_temp"] - st["host_alias"], 3)
  print(json.dumps({"program": "train step" + (", guard as a select" if select_guard else ""),
                    "compiler": f"XLA:GPU {target.stem} x {n}", "jax": jax.__version__, "config": words,
                    "compile_s": round(seconds, 1), **st, "params": round(parts["params"] / GIB, 3),
                    "opt_state": round(parts["opt_state"] / GIB, 3)}), flush=True)


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("what", choices=("cond", "step"))
  ap.add_argument("--target", type=Path, default=HERE.parent / "maxlm" / "plan" / "gpu_targets" / "h200.txtpb")
  ap.add_argument("--devices", type=int, default=1)
  ap.add_argument("--select-guard", action="store_true",
                  help="step: compile maxlm/step.py's non-finite guard (lax.cond) as a select of both branches")
  args, words = ap.parse_known_args(argv)
  if args.what == "cond":
    cond(args.target)
  else:
    step(args.target, args.devices, words, args.select_guard)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
