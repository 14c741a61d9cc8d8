"""Do independent compiles of one training program give the same numbers? (issue 26, item 9)

On the H200, after `source .whl/device-setup.sh`:

  python3 benchmarks/determinism_gpu.py [--procs 8] [--parallel 4] [--precision fp8_delayed] [--out DIR]

Every process trains the run of tests/test_gpu.py::test_deterministic_resume_is_bit_identical (train.deterministic=
true, 20 steps) from the same seed, and the runs are grouped by their logged (loss, grad_norm) sequences, bit for bit:

  cold   each process compiles everything itself (compile.cache=false);
  warm   one process fills a compilation cache that keeps every program (no size or time threshold), then the
         others read it, so they run the first one's binaries;
  resume the test's own sequence on that warm cache: 20 steps, 10 steps, resume to 20.

Processes run `--parallel` at a time (XLA_CLIENT_MEM_FRACTION=0.9/parallel each), so the autotuner's timings
are noisier than in a process alone: a difference in `cold` shows that compiles can differ, not how often they do
when a process has the GPU to itself. Prints one line per phase and writes determinism.json under --out (the
logs stay in a scratch folder; the first failure's tail is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RUN = ["config=llama3.2-1b.yml", "model.n_layers=2", "data.seq_len=1024", "data.global_batch_size=4",
       "train.log_every=1", "optim.warmup_steps=5", "optim.decay_steps=20", "train.eval_every=0",
       "checkpoint.enabled=true", "checkpoint.every=10", "checkpoint.async_save=false", "train.deterministic=true"]


def train(args: list[str], env: dict, log: Path) -> tuple[int, float]:
  t = time.perf_counter()
  with open(log, "w") as f:
    r = subprocess.run([sys.executable, "-m", "maxlm.train", *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                       timeout=400)
  return r.returncode, time.perf_counter() - t


def rows(run_dir: Path) -> tuple:
  out = []
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if "loss" in r:
      out.append((r["step"], r["loss"], r["grad_norm"]))
  return tuple(sorted(out))


def classes(runs: dict[str, tuple]) -> list[dict]:
  groups: dict[tuple, list[str]] = {}
  for name, seq in runs.items():
    groups.setdefault(seq, []).append(name)
  ref = next(iter(groups))
  out = []
  for seq, names in groups.items():
    d = max((abs(a[1] - b[1]) for a, b in zip(seq, ref, strict=False)), default=0.0)
    first = next((a[0] for a, b in zip(seq, ref, strict=False) if a != b), None)
    out.append({"runs": names, "max_abs_dloss_vs_first_class": d, "first_differing_step": first})
  return out


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--procs", type=int, default=8)
  p.add_argument("--parallel", type=int, default=4)
  p.add_argument("--precision", default="fp8_delayed")
  p.add_argument("--phases", default="cold,warm,resume")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/maxlm-determinism"))
  a = p.parse_args()
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  work = Path(tempfile.mkdtemp(prefix="det-"))
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")
         and not k.startswith("JAX_COMPILATION_CACHE") and not k.startswith("JAX_PERSISTENT_CACHE")}
  env["XLA_CLIENT_MEM_FRACTION"] = f"{0.9 / a.parallel:.3f}"
  base = [*RUN, f"model.precision={a.precision}", f"output_dir={work}"]
  cache = work / "xla-cache"
  warm_keys = [f"compile.cache_dir={cache}", "compile.min_compile_s=0"]
  report: dict = {"precision": a.precision, "procs": a.procs, "parallel": a.parallel}

  def many(phase: str, extra: list[str], n: int) -> dict:
    names = [f"{phase}{i}" for i in range(n)]
    with ThreadPoolExecutor(a.parallel) as ex:
      res = list(ex.map(lambda nm: train([*base, *extra, f"run_name={nm}", "train.steps=20"], env, work / f"{nm}.log"),
                        names))
    bad = [nm for nm, (rc, _) in zip(names, res, strict=True) if rc != 0]
    for nm in bad[:1]:
      print(f"--- {nm} failed:\n" + (work / f"{nm}.log").read_text()[-3000:], flush=True)
    runs = {nm: rows(work / nm) for nm in names if nm not in bad}
    return {"failed": bad, "seconds": [round(s, 1) for _, s in res], "classes": classes(runs) if runs else []}

  for phase in a.phases.split(","):
    t = time.perf_counter()
    if phase == "cold":
      report["cold"] = many("cold", ["compile.cache=false"], a.procs)
    elif phase == "warm":
      rc, _ = train([*base, *warm_keys, "run_name=fill", "train.steps=20"], env, work / "fill.log")
      r = many("warm", warm_keys, a.procs - 1)
      r["classes"] = classes({"fill": rows(work / "fill"), **{n: rows(work / n) for c in r["classes"] for n in c["runs"]}})
      report["warm"] = {"fill_rc": rc, **r}
    elif phase == "resume":
      seqs = {}
      for nm, steps in (("whole", 20), ("split", 10), ("split", 20)):
        rc, _ = train([*base, *warm_keys, f"run_name={nm}", f"train.steps={steps}"], env, work / f"{nm}{steps}.log")
        if rc:
          seqs = {}
          break
      if rc == 0:
        seqs = {"whole": rows(work / "whole"), "split": rows(work / "split")}
      report["resume"] = {"rc": rc, "classes": classes(seqs) if seqs else []}
    print(f"{phase}: {len(report[phase].get('classes', []))} class(es) in {time.perf_counter() - t:.0f} s: "
          f"{json.dumps(report[phase])[:600]}", flush=True)
  (out / "determinism.json").write_text(json.dumps(report, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
