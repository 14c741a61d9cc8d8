"""Two CPU trainings at once on 8 simulated devices, in rounds: does XLA:CPU's pool deadlock (maxlm/runtime/env.py)?

Each round starts JOBS copies of `python -m maxlm.train train.steps=50 model.backend=flax` (the README's CPU
try-out; compile cache off, so every copy compiles) with `--xla_force_host_platform_device_count=8`, at once, and
waits for them. Rounds alternate between two arms:
  xla    PJRT_NPROC=8: XLA's own pool, max(cores, devices) threads, as on any machine with at most 8 cores;
  maxlm  PJRT_NPROC unset: maxlm's commands size the pool (runtime.size_cpu_pool, 4 threads per device).
A deadlock shows as XLA's abort ("Termination timeout for `all gather ...`", exit 134) about 40 s after the
collective stalls. One JSON line per training goes to OUT (default: stdout).

  .venv/bin/python benchmarks/cpu_collectives_stress.py --rounds 12 --out benchmarks/results/X.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8
ARMS = {"xla": {"PJRT_NPROC": str(DEVICES)}, "maxlm": {}}
COMMAND = [sys.executable, "-m", "maxlm.train", "train.steps=50", "model.backend=flax", "run_name=try",
           "compile.cache=false"]


def round_of(arm: str, jobs: int, timeout_s: float) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
  env.update(ARMS[arm], PYTHONPATH=str(ROOT),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0")
  with tempfile.TemporaryDirectory(prefix="maxlm-stress-") as tmp:
    procs, t0 = [], time.perf_counter()
    for j in range(jobs):
      work = Path(tmp) / str(j)
      work.mkdir()
      log = open(work / "log", "w+")  # closed below, after the process ends
      procs.append((subprocess.Popen(COMMAND, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    rows = []
    for p, log in procs:
      try:
        rc = p.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
      except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
      log.seek(0)
      text = log.read()
      log.close()
      rows.append({"arm": arm, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
                   "deadlock": "Termination timeout" in text or "may be stuck" in text,
                   "pool_line": next((ln for ln in text.splitlines() if "PJRT_NPROC=" in ln), None)})
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=12, help="rounds, alternating xla, maxlm, xla, ...")
  ap.add_argument("--jobs", type=int, default=2, help="trainings at once in a round")
  ap.add_argument("--timeout-s", type=float, default=300.0)
  ap.add_argument("--out", type=Path)
  args = ap.parse_args()
  out = open(args.out, "a") if args.out else sys.stdout  # for the whole run
  machine = {"cores": os.cpu_count(), "commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                                                capture_output=True, text=True).stdout.strip()}
  for r in range(args.rounds):
    arm = ("xla", "maxlm")[r % 2]
    for i, row in enumerate(round_of(arm, args.jobs, args.timeout_s)):
      out.write(json.dumps({"round": r, "job": i, **row, **machine}) + "\n")
      out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
