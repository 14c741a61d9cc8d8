"""Compare maxlm config switches side by side in one device call: tokens/s, peak memory, first step.

  source .whl/device-setup.sh && python3 benchmarks/switches.py [NAME=OVERRIDES ...] [--steps=30] [--budget=570]

OVERRIDES: comma-separated key=value words, and env:NAME=VALUE words for the variant's environment
(e.g. env:XLA_FLAGS=--xla_gpu_enable_command_buffer=; a '|' in VALUE stands for a comma).

Each variant is one `python -m maxlm.train` process on the benchmark shape of ../shared/bench (Llama-3-8B
cut to 4 layers, batch 4 x 4096, vocab 128256, synthetic data, remat none, AdamW with fp32 master weights)
plus its overrides (comma-separated key=value words). Without arguments it runs DEFAULT_VARIANTS, which
toggle the step switches of issue 13 (model.loss_chunk, model.cast_params_once, model.precision=fp16)
against their baselines. tokens/s and step time are the mean of the logged
10-step windows after the first (steps 11..N); peak memory and the first-step time are what the trainer
itself reports (metrics.jsonl: peak_memory_gb, first_step_s). Prints a table; writes $OUT/switches.json
and one $OUT/<name>.log per variant (when $OUT is set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = ["config=llama8b.yml", "model.n_layers=4", "data.seq_len=4096", "data.global_batch_size=4",
         "model.remat=none", "data.type=synthetic", "optim.warmup_steps=10", "train.log_every=10"]
DEFAULT_VARIANTS = [
    ("bf16", ""),
    ("bf16_chunk1024", "model.loss_chunk=1024"),
    ("bf16_chunk2048", "model.loss_chunk=2048"),
    ("fp8d", "model.precision=fp8_delayed"),
    ("fp8d_chunk1024", "model.precision=fp8_delayed,model.loss_chunk=1024"),
    ("fp16_chunk1024", "model.precision=fp16,model.loss_chunk=1024"),
    ("bf16_chunk1024_cast", "model.loss_chunk=1024,model.cast_params_once=true"),
]
EXPECTED_S = 75  # one variant, process start to exit, on the H200 (first step ~19 s + 30 steps)


def run_variant(name: str, overrides: str, steps: int, root: Path, out: Path | None) -> dict:
  words = [w for w in overrides.split(",") if w]
  # env:NAME=VALUE words set the variant's environment ('|' in VALUE stands for a comma)
  env = dict(os.environ, **{w[4:].split("=", 1)[0]: w[4:].split("=", 1)[1].replace("|", ",")
                            for w in words if w.startswith("env:")})
  words = [w for w in words if not w.startswith("env:")]
  cmd = [sys.executable, "-m", "maxlm.train", *SHAPE, f"train.steps={steps}", *words,
         f"output_dir={root}", f"run_name={name}"]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
  wall = time.perf_counter() - t0
  log = proc.stdout + proc.stderr
  if out is not None:
    (out / f"{name}.log").write_text(" ".join(cmd) + "\n" + log)
  rows = []
  metrics = root / name / "metrics.jsonl"
  if metrics.exists():
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
  steady = [r for r in rows[1:] if r.get("step_time")]
  res = {"name": name, "overrides": words, "rc": proc.returncode, "wall_s": round(wall, 1)}
  if steady:
    step_s = sum(r["step_time"] for r in steady) / len(steady)
    res.update(step_ms=round(1e3 * step_s, 1), tokens_per_s=round(4 * 4096 / step_s),
               tflops=round(steady[-1].get("tflops_per_device") or 0, 1))
  if rows:
    res.update(first_step_s=rows[0].get("first_step_s"), peak_memory_gb=rows[-1].get("peak_memory_gb"),
               compiled_memory_gb=rows[0].get("compiled_memory_gb"),
               loss=rows[-1].get("loss"), loss_scale=rows[-1].get("loss_scale"),
               overflow_steps=rows[-1].get("overflow_steps"), nonfinite_steps=rows[-1].get("nonfinite_steps"))
  if proc.returncode:
    res["error_tail"] = log[-600:]
  return res


def main(argv: list[str]) -> int:
  opts = {a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}
  variants = [tuple(a.split("=", 1)) if "=" in a else (a, "") for a in argv if not a.startswith("--")]
  variants = variants or DEFAULT_VARIANTS
  steps, budget = int(opts.get("steps", 30)), float(opts.get("budget", 570))
  out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
  root = Path(opts.get("dir", "/tmp/maxlm-switches"))
  t0, results = time.perf_counter(), []
  for name, overrides in variants:
    if time.perf_counter() - t0 + EXPECTED_S > budget:
      results.append({"name": name, "overrides": overrides, "status": "not_started (budget)"})
      continue
    results.append(run_variant(name, overrides, steps, root, out))
    print(json.dumps(results[-1]), flush=True)
  head = f"{'variant':<18} {'step ms':>8} {'tokens/s':>9} {'peak GB':>8} {'XLA est':>8} {'1st step s':>10} {'loss':>7}  overrides"
  print("\n" + head)
  for r in results:
    def f(k, fmt):
      return format(r[k], fmt) if r.get(k) is not None else "-"
    print(f"{r['name']:<18} {f('step_ms', '8.1f')} {f('tokens_per_s', '9,d')} {f('peak_memory_gb', '8.1f')} "
          f"{f('compiled_memory_gb', '8.1f')} {f('first_step_s', '10.1f')} {f('loss', '7.3f')}  {r.get('overrides')}"
          + (f"  rc={r['rc']}" if r.get("rc") else "") + (f"  {r['status']}" if r.get("status") else ""))
  if out is not None:
    (out / "switches.json").write_text(json.dumps({"shape": SHAPE, "steps": steps, "runs": results}, indent=1))
  return 0 if all(r.get("rc") == 0 for r in results) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
