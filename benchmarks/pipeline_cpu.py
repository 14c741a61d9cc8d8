"""The CPU cost of a pipelined train step against the unsharded one, on 8 simulated devices (maxlm/parallel/pipelining.py).

Not a speed figure: 8 simulated devices share this machine's cores, so a step's wall time follows the work of all
devices together, not one device's. What it shows is what the pipeline adds: every stage computes at every one of
the M + S - 1 ticks, the bubble's ticks included (their results are thrown away; on a GPU they are idle time), so a
pipelined step does (M + S - 1) / M of the layers' work, plus the hand-offs between stages. And that the loss is
the unsharded step's, step after step (AdamW, the same batches).

Arms (the same model, batch and micro-batch count M = --micro): one device with M micro-batches accumulated one
after the other (the unsharded step); FSDP over 8; pipeline 2 x fsdp 4; pipeline 4 x fsdp 2; pipeline 8.
One JSON line per arm to --out (default: stdout), then a table.

  .venv/bin/python benchmarks/pipeline_cpu.py --steps 8 --out benchmarks/results/X.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from maxlm.runtime import env as runtime  # noqa: E402 - imports no JAX; the pool is sized before JAX starts

runtime.size_cpu_pool()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxlm.build import build_step  # noqa: E402
from maxlm.config import CompileConfig, Config, DataConfig, MeshConfig, ModelConfig, OptimConfig  # noqa: E402
from maxlm.config import TrainConfig  # noqa: E402
from maxlm.parallel.mesh import make_mesh  # noqa: E402
from maxlm.parallel.pipelining import bubble_fraction  # noqa: E402

ARMS = {"unsharded (1 device)": (MeshConfig(pipeline=1, data=1, fsdp=1, tensor=1), 1),
        "fsdp 8": (MeshConfig(pipeline=1, fsdp=8), DEVICES),
        "pipeline 2 x fsdp 4": (MeshConfig(pipeline=2, fsdp=4), DEVICES),
        "pipeline 4 x fsdp 2": (MeshConfig(pipeline=4, fsdp=2), DEVICES),
        "pipeline 8": (MeshConfig(pipeline=8, fsdp=1), DEVICES)}


def batches(n: int, b: int, t: int, vocab: int) -> list[dict]:
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    toks = rng.integers(0, vocab, (b, t + 1), dtype=np.int32)
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((b, t), np.int32),
                "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))})
  return out


def arm(name: str, cfg: ModelConfig, micro: int, data: list[dict]) -> dict:
  mesh_cfg, n = ARMS[name]
  mesh = make_mesh(mesh_cfg, jax.devices()[:n])
  stages = mesh.shape["pipeline"]
  b, t = data[0]["inputs"].shape
  run = Config(model=cfg, mesh=mesh_cfg, optim=OptimConfig(warmup_steps=0, learning_rate=1e-3),
               data=DataConfig(type="synthetic", seq_len=t, global_batch_size=b),
               train=TrainConfig(steps=len(data), grad_accum=micro, seed=0), compile=CompileConfig(warm_start=False))
  built = build_step(run, mesh)  # the trainer's builder: model, optimizer, state in its shards, the jitted step
  state, step, bs = built.state, built.train_step, built.batch_sharding
  losses, times = [], []
  for i, batch in enumerate(data):
    batch = {k: jax.device_put(v, bs) for k, v in batch.items()}
    t0 = time.perf_counter()
    state, m = step(state, batch)
    loss = float(m["loss"])  # waits for the step
    if i:  # the first call compiles
      times.append(time.perf_counter() - t0)
    losses.append(loss)
  hlo = step.executable.as_text()  # the stages' hand-offs: collective-permutes (async on a GPU, plain on a CPU)
  permutes = len(re.findall(r"= \S+ collective-permute(?:-start)?\(", hlo))
  return {"arm": name, "devices": n, "stages": stages, "micro_batches": micro,
          "bubble": bubble_fraction(stages, micro), "compile_s": step.compile_s,
          "step_s_median": statistics.median(times), "step_s_min": min(times), "losses": losses,
          "collective_permutes": permutes, "load_average_1min": os.getloadavg()[0]}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=8, help="train steps per arm (the first compiles, not timed)")
  ap.add_argument("--micro", type=int, default=8, help="micro-batches (train.grad_accum)")
  ap.add_argument("--out", default="", help="JSON lines here (default: stdout)")
  args = ap.parse_args(argv)
  cfg = ModelConfig(backend="flax", vocab_size=1024, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                    head_dim=32, ffn_dim=768, dtype="float32", remat="full")
  data = batches(args.steps, b=4 * args.micro * 2, t=128, vocab=cfg.vocab_size)  # 8 rows per micro-batch
  rows = [arm(name, cfg, args.micro, data) for name in ARMS]
  ref = rows[0]
  text = "\n".join(json.dumps(r) for r in rows) + "\n"
  if args.out:
    Path(args.out).write_text(text)
  else:
    sys.stdout.write(text)
  print(f"\n{'arm':<22}{'compile s':>10}{'step s':>9}{'x unsharded':>12}{'(M+S-1)/M':>10}{'permutes':>9}{'load':>6}  "
        f"max |loss - unsharded| over {args.steps} steps")
  for r in rows:
    diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    print(f"{r['arm']:<22}{r['compile_s']:>10.1f}{r['step_s_median']:>9.3f}"
          f"{r['step_s_median'] / ref['step_s_median']:>12.2f}"
          f"{(r['micro_batches'] + r['stages'] - 1) / r['micro_batches']:>10.3f}{r['collective_permutes']:>9}"
          f"{r['load_average_1min']:>6.1f}  {diff:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
