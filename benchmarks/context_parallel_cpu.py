"""The CPU cost of a context-parallel train step against the unsharded step, on simulated devices (correctness,
not speed: XLA:CPU's simulated devices share the host's cores, so a split step only adds work here).

One process, `--xla_force_host_platform_device_count=8`. For each arm: the trainer's own pieces (train state
initialized into its shards, the train step with AdamW and explicit shardings, the scope of mesh + logical rules:
maxlm/build.py `build_step`, as the trainer builds them), a flax-backend model, synthetic batches (unpacked, or
packed rows of random documents with --packed); the compile time and the median wall time of --steps steps after
the first, and the last step's loss against the unsharded arm's (they agree to float32 rounding:
tests/test_parallel_sharding.py derives the bound). Arms:
  unsharded     1 device
  fsdp8         8 devices, FSDP only (what the split costs on these simulated devices without CP)
  cpN_STRATEGY  mesh.context=N (the rest on fsdp), mesh.context_strategy=STRATEGY
One JSON line per arm on stdout, then a Markdown table.

  PYTHONPATH=. .venv/bin/python benchmarks/context_parallel_cpu.py [--seq 1024] [--steps 5] [--packed]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import time

import jax
import numpy as np

from maxlm.runtime import env as runtime
from maxlm.build import build_step
from maxlm.config import CompileConfig, Config, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from maxlm.parallel.mesh import make_mesh

MODEL = ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=384,
                    dtype="float32", remat="none", backend="flax")
ARMS = {"unsharded": (MeshConfig(data=1, fsdp=1), 1), "fsdp8": (MeshConfig(fsdp=8), 8)}
for cp in (2, 4, 8):
  for strategy in ("all_gather", "ring"):
    ARMS[f"cp{cp}_{strategy}"] = (MeshConfig(fsdp=-1, context=cp, context_strategy=strategy), 8)


def batch_of(rng, b: int, t: int, packed: bool) -> dict:
  toks = rng.integers(0, MODEL.vocab_size, (b, t + 1), dtype=np.int32)
  seg, pos = np.ones((b, t), np.int32), np.tile(np.arange(t, dtype=np.int32), (b, 1))
  if packed:  # documents of random lengths up to t/2, positions from 0 in each
    for r in range(b):
      i, doc = 0, 1
      while i < t:
        n = min(int(rng.integers(1, t // 2 + 1)), t - i)
        seg[r, i:i + n], pos[r, i:i + n] = doc, np.arange(n)
        i, doc = i + n, doc + 1
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "positions": pos}


def run_arm(name: str, seq: int, batch: int, steps: int, packed: bool) -> dict:
  mesh_cfg, n = ARMS[name]
  mesh = make_mesh(mesh_cfg, jax.devices()[:n])
  cfg = Config(model=MODEL, mesh=mesh_cfg, optim=OptimConfig(warmup_steps=0, learning_rate=1e-3),
               data=DataConfig(type="text" if packed else "synthetic", seq_len=seq, global_batch_size=batch,
                               max_segments_per_row=seq),  # a type other than synthetic: packed rows
               train=TrainConfig(steps=steps + 1, seed=0), compile=CompileConfig(warm_start=False))
  built = build_step(cfg, mesh)
  state, step, bs = built.state, built.train_step, built.batch_sharding
  rng = np.random.default_rng(0)
  batches = [{k: jax.device_put(v, bs) for k, v in batch_of(rng, batch, seq, packed).items()}
             for _ in range(steps + 1)]
  t0 = time.perf_counter()
  state, metrics = step(state, batches[0])  # compiles
  jax.block_until_ready(metrics)
  first = time.perf_counter() - t0
  times = []
  for b in batches[1:]:
    t0 = time.perf_counter()
    state, metrics = step(state, b)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  return {"arm": name, "devices": n, "mesh": dict(mesh.shape), "seq_len": seq, "batch": batch, "packed": packed,
          "compile_s": round(step.compile_s, 2), "first_step_s": round(first, 2),
          "step_ms_median": round(1e3 * statistics.median(times), 1), "steps_timed": len(times),
          "loss": float(metrics["loss"])}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--packed", action="store_true")
  p.add_argument("--arms", default=",".join(ARMS))
  a = p.parse_args()
  runtime.size_cpu_pool()
  rows = []
  for name in a.arms.split(","):
    rows.append(run_arm(name, a.seq, a.batch, a.steps, a.packed))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]
  print(f"\n| arm | devices | compile s | step ms (median of {a.steps}) | x unsharded | loss - unsharded's |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['arm']} | {r['devices']} | {r['compile_s']} | {r['step_ms_median']} | "
          f"{r['step_ms_median'] / base['step_ms_median']:.2f} | {r['loss'] - base['loss']:+.2e} |")


if __name__ == "__main__":
  main()
