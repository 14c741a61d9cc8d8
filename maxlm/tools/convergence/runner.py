"""Run a suite's cases: each one `python -m maxlm.train` subprocess, its metrics read from metrics.jsonl.

A subprocess per case keeps cases apart (a crash, device memory, Transformer Engine's FP8 state) and is
exactly the command a user runs. `jobs` > 1 runs cases side by side (on one GPU each gets a share of its
memory through XLA_PYTHON_CLIENT_MEM_FRACTION unless that is set already).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from maxlm.tools.convergence.bands import trailing_mean
from maxlm.tools.convergence.suite import Case, SuiteError

EXIT_BAD_INPUT, EXIT_CHECKPOINT = 2, 3


@dataclasses.dataclass
class CaseRun:
  case: str
  seed: int
  run_dir: Path
  returncode: int
  seconds: float
  curves: dict[str, dict[int, float]]  # metric -> {step: value}
  steps: int  # the run's train.steps (checks beyond it are skipped)
  error: str = ""  # last stderr line when the run failed

  @property
  def ok(self) -> bool:
    return self.returncode == 0


def read_curves(metrics_file: Path, window: int) -> dict[str, dict[int, float]]:
  """metric -> {step: value} from a run's metrics.jsonl; loss_smooth is the trailing mean of loss."""
  curves: dict[str, dict[int, float]] = {"loss": {}, "eval_loss": {}, "grad_norm": {}}
  if metrics_file.is_file():
    for line in metrics_file.read_text().splitlines():
      try:
        row = json.loads(line)
      except ValueError:
        continue  # a row cut short by a crash
      for m in curves:
        v = row.get(m)
        if v is not None:
          curves[m][int(row["step"])] = float(v)  # "nan"/"inf" strings (non-finite) parse too
  steps = sorted(curves["loss"])
  curves["loss_smooth"] = trailing_mean(steps, [curves["loss"][s] for s in steps], window)
  return curves


def _tail(path: Path) -> str:
  try:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
  except OSError:
    return ""
  errs = [ln for ln in lines if ln.startswith("maxlm: error:")]
  return (errs or lines or [""])[-1][:500]


def run_case(case: Case, seed: int, out: Path, extra: tuple[str, ...], window: int, steps: int,
             env: dict[str, str] | None = None) -> CaseRun:
  """Train `case` at `seed` into out/<case>-seed<seed>/ (replacing an older run there)."""
  name = f"{case.name}-seed{seed}"
  run_dir = out / name
  if run_dir.exists():
    shutil.rmtree(run_dir)
  out.mkdir(parents=True, exist_ok=True)
  log = out / f"{name}.log"
  cmd = [sys.executable, "-m", "maxlm.train", *case.args(seed, extra), f"output_dir={out}", f"run_name={name}"]
  t0 = time.perf_counter()
  with open(log, "w") as f:
    f.write("$ " + " ".join(cmd) + "\n")
    f.flush()
    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
  seconds = time.perf_counter() - t0
  if rc in (EXIT_BAD_INPUT, EXIT_CHECKPOINT):
    raise SuiteError(f"case {case.name}: the run stopped on bad input (exit {rc}): {_tail(log)} (log: {log})")
  curves = read_curves(run_dir / "metrics.jsonl", window)
  return CaseRun(case.name, seed, run_dir, rc, seconds, curves, steps, "" if rc == 0 else _tail(log))


def _child_env(jobs: int) -> dict[str, str]:
  env = dict(os.environ)
  if jobs > 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / jobs:.2f}"  # several runs share one GPU
  return env


def run_all(tasks: list[tuple[Case, int, int, tuple[str, ...]]], out: Path, window: int, jobs: int = 1,
            echo=print) -> list[CaseRun]:
  """Run (case, seed, steps, overrides) tasks, `jobs` at a time; results in task order. One line per run."""
  env = _child_env(jobs)

  def one(task):
    case, seed, steps, extra = task
    r = run_case(case, seed, out, extra, window, steps, env)
    loss = r.curves["loss_smooth"].get(max(r.curves["loss_smooth"], default=0), math.nan)
    state = "done" if r.ok else f"FAILED (exit {r.returncode}): {r.error}"
    echo(f"maxlm convergence: {case.name} seed {seed}: {state} in {r.seconds:.0f} s, final smoothed loss "
         f"{loss:.4f}")
    return r

  if jobs <= 1:
    return [one(t) for t in tasks]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    return list(pool.map(one, tasks))
