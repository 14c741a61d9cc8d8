"""Chosen GPU tests, many times over, several at once on one GPU (issue 39, item 5: "the three deterministic-resume
GPU tests pass 10 times in a row").

On the H200, from the project root, after `source .whl/device-setup.sh`:

  python3 benchmarks/gpu_test_repeat.py [--repeat 10] [--parallel 8] [--budget 560] [--disk-gb 16] \
      [-k test_deterministic_resume_is_bit_identical] [--out DIR]

Each repetition of each test id that `-k` selects in tests/test_gpu.py runs in a pytest process of its own
(`MAXLM_TEST_GPU=1 python3 -m pytest -m gpu <id> -p no:cacheprovider`, its own --basetemp, removed after it), and
`--parallel` of them run at a time (fewer where the scratch disk holds fewer jobs of `--disk-gb`), each with
XLA_CLIENT_MEM_FRACTION=0.9/parallel so that they share the GPU.
Sharing changes the timings XLA's autotuner sees, which makes a start that compiles again more likely to choose
another kernel than in a process alone: the condition the flaky failure depended on, made harsher, not milder.
A job is started only while its expected time (the slowest finished so far, else --est) fits in what is left of
--budget; jobs not started are recorded as "not_started", never as passes.

One JSON line per job goes to DIR/gpu_test_repeat.jsonl (test id, repetition, status, seconds, start and end
times, commit, the parallelism), and the output tail of each failure to DIR/failure_<n>.txt. Then a line per test
id: passes, failures, and the longest run of passes in start order ("in a row").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collect(k: str) -> list[str]:
  """The test ids in tests/test_gpu.py that `-k k` selects."""
  r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                      "tests/test_gpu.py", "-k", k], cwd=ROOT, capture_output=True, text=True,
                     env={**os.environ, "MAXLM_TEST_GPU": "1"})
  ids = [line for line in r.stdout.splitlines() if "::" in line]
  if not ids:
    sys.exit(f"gpu_test_repeat: -k {k!r} selects no test\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
  return ids


def streak(statuses: list[str]) -> int:
  best = cur = 0
  for s in statuses:
    cur = cur + 1 if s == "passed" else 0
    best = max(best, cur)
  return best


def at_once(parallel: int, free_gb: float, disk_gb: float) -> int:
  """Jobs to run at a time: at most `parallel`, no more than the free disk holds at `disk_gb` each, at least one."""
  return max(1, min(parallel, int(free_gb // disk_gb)))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("-k", default="test_deterministic_resume_is_bit_identical")
  ap.add_argument("--repeat", type=int, default=10)
  ap.add_argument("--parallel", type=int, default=8)
  ap.add_argument("--budget", type=float, default=560.0)
  ap.add_argument("--est", type=float, default=150.0, help="seconds a job is expected to take before one finished")
  ap.add_argument("--disk-gb", type=float, default=16.0,
                  help="disk a job may fill at its peak: the deterministic-resume test's three starts of a 2-layer "
                       "llama3.2-1b keep three checkpoints of ~4.6 GB (fp32 weights and moments) plus a cache")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/maxlm-gpu-test-repeat"))
  a = ap.parse_args()
  t0 = time.time()
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  ids = collect(a.k)
  commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                      capture_output=True, text=True).stdout.strip() or None
  scratch = Path(tempfile.mkdtemp(prefix="gpu-test-repeat-"))
  # As many at once as the disk holds: eight deterministic-resume jobs (~110 GB) would fill the H200 machine's 64 GB.
  free_gb = shutil.disk_usage(scratch).free / 1e9
  parallel = at_once(a.parallel, free_gb, a.disk_gb)
  print(f"gpu_test_repeat: {parallel} at a time ({free_gb:.0f} GB free, --disk-gb {a.disk_gb:g}, "
        f"--parallel {a.parallel})", flush=True)
  jobs = [(rep, tid) for rep in range(1, a.repeat + 1) for tid in ids]  # repetition-major: each id's order kept
  env = {**os.environ, "MAXLM_TEST_GPU": "1", "XLA_CLIENT_MEM_FRACTION": f"{0.9 / parallel:.3f}"}
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  lock = threading.Lock()
  seen = {"slowest": 0.0}  # the slowest job finished so far
  rows: list[dict] = []

  def one(n: int, rep: int, tid: str) -> None:
    left = a.budget - (time.time() - t0)
    row = {"job": n, "test": tid, "repetition": rep, "parallel": parallel, "commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if left < (seen["slowest"] or a.est) * 1.1:
      row.update(status="not_started", seconds=0, left_s=round(left))
    else:
      base = scratch / f"job{n}"
      start = time.time()
      try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
                            f"--basetemp={base}", tid], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=max(left - 5, 1))
        status = "passed" if r.returncode == 0 else "failed"
        text = r.stdout + r.stderr
      except subprocess.TimeoutExpired as e:
        status, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
      secs = time.time() - start
      shutil.rmtree(base, ignore_errors=True)
      row.update(status=status, seconds=round(secs, 1), started_s=round(start - t0, 1), ended_s=round(time.time() - t0, 1))
      with lock:
        seen["slowest"] = max(seen["slowest"], secs)
        if status != "passed":
          (out / f"failure_{n}.txt").write_text(str(text)[-20000:])
    with lock:
      rows.append(row)
      with open(out / "gpu_test_repeat.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
      print(f"[{time.time() - t0:6.0f}s] job {n} rep {rep} {tid.split('::')[-1]}: {row['status']} "
            f"({row['seconds']} s)", flush=True)

  with ThreadPoolExecutor(parallel) as ex:
    futures = [ex.submit(one, n, rep, tid) for n, (rep, tid) in enumerate(jobs, 1)]
  for f in futures:
    f.result()  # a fault in this script shows its traceback
  shutil.rmtree(scratch, ignore_errors=True)
  for tid in ids:
    mine = sorted((r for r in rows if r["test"] == tid), key=lambda r: r["repetition"])
    st = [r["status"] for r in mine if r["status"] != "not_started"]
    print(f"{tid}: {st.count('passed')} passed, {len(st) - st.count('passed')} not passed, "
          f"{len(mine) - len(st)} not started; {streak(st)} passes in a row")


if __name__ == "__main__":
  main()
