"""A predicted step time from the collectives XLA:GPU compiled into the step (maxlm/plan/collectives.py) and the
step's FLOPs, on a documented roofline. A prediction, labelled so wherever it is shown: no step of maxlm has run
on more than one GPU yet; to be replaced by a measurement the day a machine of several GPUs is lent.

Per GPU (`ROOFLINE`; NVIDIA's datasheets, dense, no sparsity): bf16 peak; NVLink per direction (NVLink 4, H100
and H200: 900 GB/s per GPU counting both directions, so 450 GB/s each way, what a ring's send or receive gets;
NVLink 5, B200: 1.8 TB/s, 900 each way); the network per GPU (an HGX node's 8 x 400 Gb/s InfiniBand, one NIC per
GPU: 50 GB/s each way).

* compute_s: the planner's compute estimate (maxlm/plan/cost.py `step_time`: the step's FLOPs by the MFU
  convention plus what the remat policy recomputes, at the bf16 peak x the MFU measured on one H200), divided by
  1 - the GPipe bubble where the mesh has pipeline stages (a stage idles (S - 1) / (M + S - 1) of the step).
* comm_s: per collective kind, the wire bytes of groups within a node at NVLink, plus for groups across nodes
  the longer of their wire bytes at NVLink and their bytes through each GPU's NIC at the network's rate.
* overlap: XLA's latency-hiding scheduler (xla.preset) runs FSDP's gathers and scatters behind compute, so the
  step is what cannot hide plus the longer of the compute and the rest of the communication. What cannot hide:
  each micro-batch's first gather and last scatter (the largest gather and scatter in the inventory, once per
  micro-batch; once per step with pipeline stages), and with tensor parallelism its all-reduces (activations:
  on the critical path).

tokens/s per GPU = global batch x sequence / step / devices.
"""

from __future__ import annotations

import dataclasses

from maxlm.config import Config
from maxlm.pipeline import bubble_fraction
from maxlm.plan.cost import degrees, step_time
from maxlm.plan.measure import Target


@dataclasses.dataclass(frozen=True)
class Roofline:
  bf16: float  # dense bf16 FLOP/s
  nvlink: float  # bytes/s per direction per GPU
  network: float  # bytes/s per direction per GPU (its NIC)


# matched by substring of the device kind, in this order
ROOFLINE = (("B200", Roofline(2.25e15, 900e9, 50e9)), ("H200", Roofline(989e12, 450e9, 50e9)),
            ("H100", Roofline(989e12, 450e9, 50e9)))


def roofline(kind: str) -> Roofline:
  """The kind's row; an H200's where the kind is unknown."""
  for name, row in ROOFLINE:
    if name.lower() in kind.lower():
      return row
  return dict(ROOFLINE)["H200"]


def comm_seconds(inventory: dict, hw: Roofline) -> dict[str, float]:
  """Seconds per collective kind (see the module doc)."""
  out = {}
  for kind, row in inventory.items():
    if not isinstance(row, dict):
      continue
    out[kind] = row["ici_wire"] / hw.nvlink + max(row["dcn_wire"] / hw.nvlink, row["network"] / hw.network)
  return out


def _largest(ops: list[dict], kind: str, hw: Roofline) -> float:
  """Seconds of the largest single collective of a kind (the one a micro-batch cannot hide)."""
  times = [o["wire"] / hw.nvlink if o["nodes"] <= 1 else max(o["wire"] / hw.nvlink, o["network"] / hw.network)
           for o in ops if o["kind"] == kind]
  return max(times, default=0.0)


def predict(cfg: Config, target: Target, inventory: dict) -> dict:
  """{"compute_s", "comm_s", "exposed_s", "step_s", "tokens_per_s_per_gpu", "per_kind_s"}: predicted, for the
  compiled step whose collectives `inventory` lists (collectives.inventory, with its "ops")."""
  hw = roofline(target.kind)
  deg = degrees(cfg, target)
  bubble = bubble_fraction(deg["pipeline"], cfg.train.grad_accum) if deg["pipeline"] > 1 else 0.0
  compute = step_time(cfg, target)["compute_s"] / (1 - bubble)
  per_kind = comm_seconds(inventory, hw)
  comm = sum(per_kind.values())
  ops = inventory.get("ops", [])
  micro = cfg.train.grad_accum if deg["pipeline"] <= 1 else 1  # a pipeline overlaps its micro-batches
  exposed = micro * (_largest(ops, "all-gather", hw) + _largest(ops, "reduce-scatter", hw))
  if deg["tensor"] > 1:
    exposed += per_kind.get("all-reduce", 0.0)
  step = exposed + max(compute, comm - exposed)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  return {"compute_s": compute, "comm_s": comm, "exposed_s": exposed, "step_s": step, "bubble": bubble,
          "tokens_per_s_per_gpu": tokens / step / target.n_devices, "per_kind_s": per_kind}
