"""Throughput accounting (tokens/s, TFLOP/s per device, MFU) and metric sinks.

Sinks: `metrics.jsonl` (one JSON object per logged step), TensorBoard event files
(tensorboardX) and a progress line on stdout. Only process 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

from maxlm.tables import gpu


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX's writer module runs `import torch` when
  it is imported, only to accept torch tensors (maxlm passes floats): 3.4 s of every start on the H200 image, which
  has torch installed (benchmarks/results/2026-12-04-importtime_h200.txt). A `None` in sys.modules makes that
  import fail for the moment of this import (the documented way to block one); torch is importable again after
  it, and a process that imported torch already keeps it."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415 - imported here, under the block above, on purpose
  finally:
    if blocked:
      del sys.modules["torch"]
  return SummaryWriter


SummaryWriter = _summary_writer_class()

def device_peak_flops(device_kind: str) -> float | None:
  """Dense BF16 peak FLOP/s of a `jax.Device.device_kind` (maxlm/tables.py GPUS), None where unknown."""
  row = gpu(device_kind)
  return row.bf16_flops if row else None


def throughput(tokens: float, flops: float, seconds: float, n_devices: int,
               peak: float | None) -> dict[str, float | None]:
  tflops = flops / seconds / n_devices / 1e12
  return {"tokens_per_sec": tokens / seconds, "tflops_per_device": tflops,
          "mfu": (tflops * 1e12 / peak) if peak else None}


def _step_of(line: str) -> float:
  """The step of a metrics.jsonl row; a row cut short by a crash counts as after every step."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return float("inf")


def _clean(v):
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


class MetricsWriter:
  """Appends to the run's sinks. Every (re)start at `start_step` (0 included) first drops what an
  earlier, interrupted attempt logged after that step: it is about to be logged again."""

  def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = True, start_step: int = 0):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    if not enabled:
      return
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
      kept = [line for line in path.read_text().splitlines() if _step_of(line) <= start_step]
      tmp = path.with_suffix(".jsonl.tmp")
      tmp.write_text("".join(line + "\n" for line in kept))
      os.replace(tmp, path)
    self._jsonl = open(path, "a", buffering=1)
    if tensorboard:
      # Non-finite values are written as they are; maxlm reports non-finite steps itself, once per
      # logged interval, so tensorboardX's per-value warning is dropped.
      logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
      # purge_step: TensorBoard discards events at or after it from earlier (dead) attempts.
      # flush_secs=1: tensorboardX's writer thread puts every event on disk within a second (its default,
      # 120 s, lost the steps a killed run had logged).
      self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1, flush_secs=1)

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        if isinstance(v, (int, float)):  # a bool (compile_cache_hit) as 0 or 1
          self._tb.add_scalar(k, int(v) if isinstance(v, bool) else v, step)

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()


def duration(seconds: float) -> str:
  """1234.5 -> '20:34', 5000 -> '1:23:20'."""
  s = int(round(max(0.0, seconds)))
  h, rest = divmod(s, 3600)
  m, s = divmod(rest, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(step: int, total: int, m: dict, *, flops_known: bool = True) -> str:
  """One line per logged step. `flops_known=False` (CPU) shows TFLOP/s and MFU as n/a."""
  parts = [f"step {step}/{total}", f"loss {m['loss']:.4f}"]
  if m.get("eval_loss") is not None:
    parts.append(f"eval {m['eval_loss']:.4f}")
  parts += [f"lr {m['learning_rate']:.2e}", f"gnorm {m['grad_norm']:.3f}"]
  if m.get("tokens_per_sec"):
    parts.append(f"{m['tokens_per_sec'] / 1e3:.1f}k tok/s")
    parts.append(f"{m['tflops_per_device']:.1f} TFLOP/s/dev" if flops_known else "TFLOP/s n/a")
  parts.append(f"MFU {100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "MFU n/a")
  if m.get("peak_memory_gb") is not None:
    parts.append(f"mem {m['peak_memory_gb']:.1f} GB")
  if m.get("save_s"):
    parts.append(f"save {m['save_s']:.1f} s")
  if m.get("moe_aux_loss") is not None:  # a mixture of experts: its load-balancing loss (1 = balanced), drops
    parts.append(f"moe aux {m['moe_aux_loss']:.3f}" + (f", dropped {100 * m['moe_dropped']:.1f}%"
                                                        if m.get("moe_dropped") is not None else ""))
  if m.get("nonfinite_steps"):
    parts.append(f"skipped {m['nonfinite_steps']}")
  if m.get("loss_scale") is not None:  # fp16: the loss scale, and updates skipped for its overflows
    parts.append(f"scale {m['loss_scale']:g}" + (f", {m['overflow_steps']} overflow skips"
                                                 if m.get("overflow_steps") else ""))
  if m.get("elapsed_s") is not None:
    eta = f", ETA {duration(m['eta_s'])}" if m.get("eta_s") is not None and step < total else ""
    parts.append(f"{duration(m['elapsed_s'])} elapsed{eta}")
  return " | ".join(parts)


def echo(line: str) -> None:
  print(line, file=sys.stdout, flush=True)
