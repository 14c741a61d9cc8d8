"""Profile the trainer's step on a GPU: where do the milliseconds go?

  python benchmarks/profile_step.py config=llama8b.yml model.n_layers=4 data.seq_len=4096 \
      data.global_batch_size=4 model.remat=none [--steps=3] [--warm=3] [--timed=5] [--dir=/tmp/maxlm-prof] \
      [--hlo=FILE.txt.gz] [--report=FILE.txt]

Builds the same Trainer as `python -m maxlm.train` (same runtime flags, same distributed start), warms up, traces a few steps with
`jax.profiler` (Perfetto JSON) and prints the GPU kernels that take the most time per step.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path


def _split(argv):
  """This script's own `--steps=N --dir=PATH`, apart from the config's key=value words."""
  ours = {a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}
  return [a for a in argv if not a.startswith("--")], ours


def gpu_events(trace_file: Path) -> list[dict]:
  """The trace's GPU kernel events (Perfetto JSON written by jax.profiler)."""
  with gzip.open(trace_file, "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  pname = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in pname.items() if "GPU" in n or "gpu" in n}
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def kernel_table(events: list[dict], steps: int, top: int = 30) -> str:
  by_name = collections.Counter()
  for e in events:
    by_name[e["name"]] += e["dur"]
  total = sum(by_name.values())
  lines = [f"GPU kernel time per step: {total / steps / 1e3:.1f} ms"]
  for name, us in by_name.most_common(top):
    lines.append(f"{us / steps / 1e3:9.2f} ms  {100 * us / max(total, 1):5.1f}%  {name[:110]}")
  return "\n".join(lines)


# Kernel families by name: cuBLAS/nvjet and CUTLASS matmuls, cuDNN's fused attention, Transformer Engine's own
# kernels (gated activations, norms, FP8 casts and transposes), XLA's fusions, copies.
FAMILIES = (("matmul", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|s\d+_\d+x\d+", re.I)),
            ("attention", re.compile(r"sdpa|fmha|flash|cudnn", re.I)),
            ("transformer_engine", re.compile(r"transformer_engine", re.I)),
            ("copy", re.compile(r"memcpy|memset|copy", re.I)))


def family(name: str) -> str:
  return next((f for f, pat in FAMILIES if pat.search(name)), "xla_fusion_or_other")


def busy_us(events: list[dict]) -> float:
  """Microseconds in which at least one kernel ran (the union of the kernels' intervals, streams overlapped)."""
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
  total, end = 0.0, float("-inf")
  for a, b in spans:
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def family_table(events: list[dict], steps: int, step_s: float, flops: float | None) -> str:
  """Where a step's wall time goes: each kernel family's GPU time, the time no kernel ran, and the rate of the
  matmuls and attention against XLA's own flop count of the step (cost analysis, all flops counted there)."""
  by = collections.Counter()
  for e in events:
    by[family(e["name"])] += e["dur"]
  busy = busy_us(events) / steps / 1e3
  lines = [f"step {step_s * 1e3:.1f} ms wall (untraced), {busy:.1f} ms with a kernel running, "
           f"{max(step_s * 1e3 - busy, 0):.1f} ms with none"]
  for fam, us in by.most_common():
    lines.append(f"{us / steps / 1e3:9.1f} ms  {100 * us / steps / 1e3 / (step_s * 1e3):5.1f}% of the step  {fam}")
  dense = (by["matmul"] + by["attention"]) / steps / 1e6
  if flops and dense > 0:
    lines.append(f"XLA's flops per step {flops / 1e12:.1f} T: {flops / 1e12 / step_s:.0f} TFLOP/s over the step, "
                 f"{flops / 1e12 / dense:.0f} TFLOP/s over the matmul and attention kernels' time")
  return "\n".join(lines)


def step_flops(compiled) -> float | None:
  """XLA's flop count of the compiled step (jax returns a dict, older versions a one-element list)."""
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) and ca else ca
  return float(ca["flops"]) if isinstance(ca, dict) and ca.get("flops") else None


def kernel_sources(events: list[dict], hlo_text: str, steps: int, top: int = 40) -> str:
  """The top kernels again, each with the `op_name` of its HLO instruction in the optimized HLO text. XLA
  names a fusion's kernel after the fusion (`loop_add_fusion_1` for `loop_add_fusion.1`); the trace's
  `hlo_op` argument is the fallback (inside a CUDA graph it names the command buffer, not the kernel)."""
  meta = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", hlo_text, re.M):
    meta.setdefault(m.group(1), m.group(2))
  by_name, hlo_op = collections.Counter(), {}
  for e in events:
    by_name[e["name"]] += e["dur"]
    hlo_op.setdefault(e["name"], e.get("args", {}).get("hlo_op", ""))
  total = sum(by_name.values())
  lines = ["GPU time per step by kernel, with its HLO instruction's op_name"]
  for name, us in by_name.most_common(top):
    md = meta.get(name) or meta.get(re.sub(r"_(\d+)$", r".\1", name)) or meta.get(hlo_op[name]) or ""
    op = re.search(r'op_name="([^"]*)"', md)
    lines.append(f"{us / steps / 1e3:9.2f} ms  {100 * us / max(total, 1):5.1f}%  {name[:60]}  "
                 f"{op.group(1)[-150:] if op else '?'}")
  return "\n".join(lines)


def _timeout(msg: str) -> None:
  """The processes of a multi-process profile did not all meet in time."""
  print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)
  os._exit(2)


def main(argv):
  import jax

  from maxlm import plan
  from maxlm.config import load_config
  from maxlm.runtime import distributed
  from maxlm.runtime import startup
  from maxlm.trainer import Trainer

  args, ours = _split(argv)
  steps = int(ours.get("steps", 3))
  out = Path(ours.get("dir", "/tmp/maxlm-prof"))
  cfg = load_config(args)
  for line in startup.begin(cfg):  # as the train command: XLA preset, memory share, compilation cache
    print(f"maxlm: {line}")
  distributed.initialize(cfg, on_timeout=_timeout)
  cfg, _ = plan.for_run(cfg, print)  # plan.mode's levers, as the train command decides them
  trainer = Trainer(cfg)
  trainer.build()
  batch = trainer.to_device(next(trainer.train_data))
  warm, timed = int(ours.get("warm", 3)), int(ours.get("timed", 5))
  for _ in range(warm):
    trainer.state, m = trainer.train_step(trainer.state, batch)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(timed):
    trainer.state, m = trainer.train_step(trainer.state, batch)
  jax.block_until_ready(m)
  step_s = (time.perf_counter() - t0) / timed
  print(f"step {step_s * 1e3:.1f} ms, {cfg.data.global_batch_size * cfg.data.seq_len / step_s / 1e3:.1f}k tok/s")
  with jax.profiler.trace(str(out), create_perfetto_trace=True):
    for _ in range(steps):
      trainer.state, m = trainer.train_step(trainer.state, batch)
    jax.block_until_ready(m)
  traces = sorted(out.rglob("*.trace.json.gz")) or sorted(out.rglob("perfetto_trace.json.gz"))
  if not traces:
    print(f"no trace written under {out}")
    return 1
  events = gpu_events(traces[-1])
  print(kernel_table(events, steps))
  compiled = trainer.jitted_train_step.executable  # the program that ran (jit reused this compile)
  families = family_table(events, steps, step_s, step_flops(compiled))
  print(families)
  hlo = compiled.as_text()
  if ours.get("hlo"):  # the optimized HLO, gzipped, to trace kernels to their source later
    with gzip.open(ours["hlo"], "wt") as f:
      f.write(hlo)
  report = kernel_sources(events, hlo, steps)
  print(report)
  if ours.get("report"):
    Path(ours["report"]).write_text(f"{' '.join(args)}\n\n{families}\n\n{kernel_table(events, steps, top=80)}"
                                    f"\n\n{report}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
