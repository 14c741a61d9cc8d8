"""XLA flag presets (`xla.preset`): short flag lists per GPU generation, merged under `XLA_FLAGS`.

`apply(preset)` runs before the JAX backend starts (XLA reads `XLA_FLAGS` once, then): it adds the
preset's flags to `XLA_FLAGS`, except those whose name the user already set there (the user's flags
win). `auto` cannot ask JAX for the device kind (that would start the backend), so it asks the driver:
`nvidia-smi --query-gpu=name,compute_cap` (compute capability 9.x -> hopper, 10.x -> blackwell), else
the GPU model names in /proc/driver/nvidia/gpus/*/information (maxlm/tables.py GPUS: H100/H200/H800/H20/GH200
-> hopper, B100/B200/B300/GB200/GB300 -> blackwell); no GPU, `JAX_PLATFORMS` without cuda/gpu, or any other GPU
(Ampere, consumer Blackwell 12.x) -> none.

Every flag below is accepted by jaxlib 0.10.2, CPU build included (XLA registers all its debug
options in every build; tests/test_runtime_xla_presets.py starts a backend with each preset, so a flag that a
newer jaxlib drops fails CI). "measured" = tokens/s on one H200, 8B shape cut to 4 layers
(benchmarks/presets.sh); one GPU has no collectives, so the collective flags' effect there is ~0 by
construction and they stay for multi-GPU overlap (FSDP all-gathers / reduce-scatters behind compute).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

from maxlm.runtime.env import backend_started
from maxlm.tables import GPUS

PRESET_NAMES = ("auto", "none", "hopper", "blackwell")

# Collective/compute overlap for FSDP and data parallelism (the settings of MaxText's GPU recipes and
# NVIDIA JAX-Toolbox's performance guide).
_OVERLAP = (
    # schedule async collectives and compute together so communication hides behind matmuls
    # (multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # combine a layer's parameter all-gathers into one NCCL call up to 128 MiB (bigger messages reach
    # link bandwidth; a Llama-8B layer is 436 MB in bf16)
    # (multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    # the same for gradient reduce-scatters, 64 MiB (fp32 gradients are twice the bytes)
    # (multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    # the same for data-parallel all-reduces, 128 MiB
    # (multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    # start the next scanned layer's all-gather during this layer's compute (model.scan_layers=true;
    # multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_enable_pipelined_all_gather=true",
    # finish a scanned layer's reduce-scatter during the next one's compute
    # (multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    # the same for all-reduces in a scanned loop
    # (multi-GPU; measured: no effect on one H200, which has no collectives)
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # unroll the layer scan by two so a layer's collectives overlap the other's compute
    # (model.scan_layers=true; measured: no effect on one H200 with unrolled layers)
    "--xla_gpu_enable_while_loop_double_buffering=true",
)

# XLA's own GEMMs (the LM head's when chunked; the layers' GEMMs are TE's cuBLAS calls) go to cuBLAS /
# cuBLASLt, not to Triton kernels that XLA autotunes while it compiles. As measured on one H200
# (2026-12-03, benchmarks/README.md), fp8_delayed with model.fp8_lm_head=true: first step 40.9 s -> 15.2 s,
# 99,911 vs 100,186 tokens/s (two calls on one held machine).
_NO_TRITON_GEMM = ("--xla_gpu_enable_triton_gemm=false",)

# Measured on one H200 (2026-12-03, benchmarks/README.md), the overlap list against none: bf16
# 64,076 vs 64,283 tokens/s (0.997x), fp8_delayed 82,194 vs 82,220 (1.000x): no effect without
# collectives, as expected; it stays for multi-GPU overlap, unmeasured until a multi-GPU machine is lent.
PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "hopper": _OVERLAP + _NO_TRITON_GEMM,
    # Same as hopper until measured on a B200 (no Blackwell GPU here yet).
    "blackwell": _OVERLAP + _NO_TRITON_GEMM,
}


def _names(arch: str) -> re.Pattern:
  """The GPU model names of one generation (maxlm/tables.py GPUS), as whole words."""
  return re.compile(r"\b(" + "|".join(g.name for g in GPUS if g.arch == arch) + r")\b")


_HOPPER_NAMES, _BLACKWELL_NAMES = _names("hopper"), _names("blackwell")
GPU_INFO_GLOB = "/proc/driver/nvidia/gpus/*/information"


def flag_name(flag: str) -> str:
  return flag.split("=", 1)[0]


def _gpu_platform_allowed() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "").lower()
  return not platforms or any(p in platforms for p in ("cuda", "gpu"))


def _nvidia_smi() -> tuple[str, str] | None:
  """(name, compute capability) of the first GPU nvidia-smi lists, or None."""
  try:
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  lines = [ln for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else []
  if not lines:
    return None
  name, _, cap = lines[0].rpartition(",")
  return (name.strip(), cap.strip()) if name else (cap.strip(), "")


def _proc_gpu_name() -> str | None:
  for path in sorted(glob.glob(GPU_INFO_GLOB)):
    try:
      with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
          if line.startswith("Model:"):
            return line.split(":", 1)[1].strip()
    except OSError:
      continue
  return None


def detect_gpu() -> tuple[str, str] | None:
  """(GPU name, compute capability or "") of this machine's first NVIDIA GPU, without starting JAX."""
  if not _gpu_platform_allowed():
    return None
  found = _nvidia_smi()
  if found:
    return found
  name = _proc_gpu_name()
  return (name, "") if name else None


def preset_for(gpu: tuple[str, str] | None) -> str:
  """The preset `auto` picks for a detected GPU (None: no GPU)."""
  if gpu is None:
    return "none"
  name, cap = gpu
  major = cap.split(".")[0]
  if major == "9" or (not cap and _HOPPER_NAMES.search(name)):
    return "hopper"
  if major == "10" or (not cap and _BLACKWELL_NAMES.search(name)):
    return "blackwell"
  return "none"


def resolve(preset: str, gpu=None) -> tuple[str, str]:
  """(concrete preset, why): `auto` resolved from the GPU (detected when `gpu` is None)."""
  if preset not in PRESET_NAMES:
    raise ValueError(f"unknown xla.preset {preset!r}")
  if preset != "auto":
    return preset, "set"
  gpu = detect_gpu() if gpu is None else gpu
  if not gpu:
    return "none", "auto: no NVIDIA GPU"
  name, cap = gpu
  return preset_for(gpu), f"auto: {name}" + (f", compute capability {cap}" if cap else "")


def merge(user_flags: str, preset_flags: tuple[str, ...]) -> tuple[str, list[str], list[str]]:
  """(merged XLA_FLAGS, preset flags added, user flags that overrode a preset flag of the same name)."""
  user = user_flags.split()
  have = {flag_name(f): f for f in user}
  added = [f for f in preset_flags if flag_name(f) not in have]
  kept = [have[flag_name(f)] for f in preset_flags if flag_name(f) in have and have[flag_name(f)] != f]
  return " ".join(added + user), added, kept


def apply(preset: str, gpu=None) -> str | None:
  """Merge the preset into os.environ["XLA_FLAGS"]; a line for the log, or None when nothing changed.

  Preset flags go first and the user's after them, so even XLA's last-one-wins parsing keeps the
  user's value. Once the backend has started (maxlm used inside a process that ran JAX already) flags
  can no longer change: the preset is skipped (performance flags) and the line says so.
  """
  name, why = resolve(preset, gpu)
  flags = PRESETS[name]
  merged, added, kept = merge(os.environ.get("XLA_FLAGS", ""), flags)
  if not added:
    return None if not kept else f"xla.preset={name} ({why}): all its flags set in XLA_FLAGS already"
  if "jax" in sys.modules and backend_started():  # without jax imported no backend can have started
    return (f"xla.preset={name} ({why}) not applied: the JAX backend had started already (in-process use); "
            "set xla.preset=none to silence this")
  os.environ["XLA_FLAGS"] = merged
  line = f"xla.preset={name} ({why}): XLA_FLAGS += {' '.join(added)}"
  return line + (f" (yours kept: {' '.join(kept)})" if kept else "")
