"""What the hang watchdog (maxlm/runtime/watchdog.py) costs per training step, two ways:

1. the host calls the trainer makes per step (arm the data wait, the dispatch and the metrics fetch, add a
   step time), timed over many iterations with the watchdog on and with it off (the no-op object);
2. whole runs of the tiny CPU model, train.watchdog=always against never, alternated, each logging every step:
   the median `step_time` of each run (metrics.jsonl), steps 11 on.

  .venv/bin/python benchmarks/watchdog_overhead.py [--calls 200000] [--runs 3] [--steps 200]

Prints one JSON object. The watchdog adds no host sync: the run-to-run differences of (2) are noise unless
they exceed the spread between runs of the same setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maxlm.config import TrainConfig  # noqa: E402
from maxlm.runtime import watchdog  # noqa: E402

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.remat=none", "model.backend=flax", "model.vocab_size=128", "data.type=synthetic",
        "data.seq_len=16", "data.global_batch_size=4", "train.log_every=1", "train.eval_every=0",
        "checkpoint.enabled=false"]


def per_step_calls(wd, n: int) -> float:
  """Seconds per step of the watchdog calls the trainer makes in a step that logs."""
  t0 = time.perf_counter()
  for step in range(1, n + 1):
    wd.arm("data wait", step)
    wd.arm("step dispatch", step, dispatch=True)
    wd.arm("metrics fetch", step, sync=True)
    wd.step_time(0.01)
  return (time.perf_counter() - t0) / n


def run_median_step_time(setting: str, steps: int, out: Path) -> float:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  r = subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={out}", f"run_name={setting}", *TINY,
                      f"train.steps={steps}", f"train.watchdog={setting}"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [json.loads(line) for line in (out / setting / "metrics.jsonl").read_text().splitlines()]
  return statistics.median(r["step_time"] for r in rows[10:] if r.get("step_time"))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--calls", type=int, default=200_000)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--steps", type=int, default=200)
  a = ap.parse_args()
  with tempfile.TemporaryDirectory() as d:
    on = watchdog.Watchdog(TrainConfig(watchdog_floor_s=3600, watchdog_first_step_s=3600), Path(d))
    try:
      calls_on = per_step_calls(on, a.calls)
    finally:
      on.stop()
  calls_off = per_step_calls(watchdog._Off(), a.calls)
  runs = {"always": [], "never": []}
  for i in range(a.runs):
    for setting in ("always", "never") if i % 2 == 0 else ("never", "always"):
      with tempfile.TemporaryDirectory() as d:
        runs[setting].append(run_median_step_time(setting, a.steps, Path(d)))
  print(json.dumps({
      "host_calls_per_step_us": {"on": calls_on * 1e6, "off": calls_off * 1e6},
      "tiny_cpu_median_step_time_ms": {k: [v * 1e3 for v in vs] for k, vs in runs.items()},
      "python": sys.version.split()[0], "cpus": os.cpu_count(),
  }, indent=1))


if __name__ == "__main__":
  main()
