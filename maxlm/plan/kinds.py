"""The GPU kinds the planner knows, one table: the device kind JAX reports, the XLA:GPU description it compiles for
(gpu_targets/*.txtpb), one GPU's memory as JAX counts it, its compute capability (for xla.preset), and a compile-only
target's assumed host RAM per GPU. Keyed by `maxlm plan --target`'s value (h200, h100, b200)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

HERE = Path(__file__).resolve().parent / "gpu_targets"


@dataclasses.dataclass(frozen=True)
class GpuKind:
  key: str  # --target's value
  kind: str  # the device kind JAX reports on that GPU
  file: str  # in gpu_targets/
  memory: int  # bytes of one GPU as JAX counts them (before xla.mem_fraction)
  capability: str  # compute capability, for xla.preset
  source: str  # where `memory` comes from

  def config_text(self) -> str:
    return (HERE / self.file).read_text()


GIB = 2 ** 30
# A compile-only target's host RAM per GPU, for optim.offload's pinned host memory: a DGX node's (H100, H200 and
# B200 alike: 2 TB for 8 GPUs, NVIDIA's datasheets; B200's can be 4 TB), assumed and said so
NODE_HOST_PER_GPU = 2 * 1024 * GIB // 8
NODE_HOST = "assumed: a DGX node's 2 TB of RAM for 8 GPUs"
KINDS = {
    "h200": GpuKind("h200", "NVIDIA H200", "h200.txtpb", int(139.87 * GIB), "9.0",
                    "JAX on an H200: bytes_limit 104.9 GiB at XLA's default fraction 0.75"),
    "h100": GpuKind("h100", "NVIDIA H100 80GB HBM3", "h100.txtpb", int(79.2 * GIB), "9.0",
                    "JAX on an H100 80GB (benchmarks/results/2026-12-05-llama70b_one_h100.txt, 79.2 GiB)"),
    "b200": GpuKind("b200", "NVIDIA B200", "b200.txtpb", 191514411008, "10.0",
                    "XLA's B200 spec (device_memory_size); not checked on a B200"),
}


def kind_for(device_kind: str) -> str | None:
  """The key of KINDS matching a device kind reported by JAX ("NVIDIA H100 80GB HBM3" -> "h100")."""
  text = device_kind.lower()
  for key in KINDS:
    if key in text and not ("gh200" in text or "gb200" in text):
      return key
  return None

