"""A predicted step time: the collectives XLA:GPU compiled into the step (maxlm/plan/collectives.py) at the links'
bandwidths, and the planner's roofline (maxlm/plan/cost.py `step_time`) for everything else. A prediction,
labelled so wherever it is shown: no step of maxlm has run on more than one GPU yet; to be replaced by a
measurement the day a machine of several GPUs is lent.

Every figure is cost.py's (`hardware`: NVIDIA's datasheets, dense, no sparsity): the bf16 peak, HBM, NVLink per
direction (NVLink 4, H100 and H200: 900 GB/s per GPU counting both directions, so 450 GB/s each way, what a
ring's send or receive gets; NVLink 5, B200: 900 each way), the network per GPU (an HGX node's 400 Gb/s
InfiniBand NIC per GPU: 50 GB/s each way; 800 Gb/s on B200: 100). None is fitted to a run. Like cost.py's, the
result is a bound: real steps are slower, by factors that differ between settings.

* compute_s: cost.step_time's compute: the step's FLOPs (the MFU convention) plus every FLOP the remat policy
  recomputes, at the bf16 peak; with pipeline stages every stage computes at each of the M + S - 1 ticks (the
  GPipe bubble, bubble_s of it) and the LM head once, its length split over the stages.
* memory_s: cost.step_time's terms that no collective carries, not overlapped (as there): per extra
  micro-batch the weights read again and the gradient sum (accum_s), the optimizer update (optimizer_s), and the
  moments' trip to the host with optim.offload=host (offload_s).
* comm_s: per collective kind, the wire bytes of groups within a node at NVLink, plus for groups across nodes
  the longer of their wire bytes at NVLink and their bytes through each GPU's NIC at the network's rate. This
  replaces cost.py's analytic FSDP, data-parallel, context and pipeline traffic: the compiled step has them all.
  The context exchange is there because the planner's attention stand-in makes it (maxlm/plan/standins.py): the
  pure-JAX context-parallel attention's collectives (maxlm/parallel/context.py: the ring's permutes of K/V, the
  all-gather's gathers and float32 reduce-scatters, each forward exchange run again in the backward as JAX's AD
  of the shard_map recomputes it; tests/test_plan_standins.py counts them), not TE's cuDNN strategies, whose
  exchange was never compiled here (before 2026-12-07 the stand-in had none: the ring's 0 permutes).
* overlap: XLA's latency-hiding scheduler (xla.preset) runs FSDP's gathers and scatters behind compute, so the
  step is what cannot hide, plus the longer of the compute and the rest of the communication, plus memory_s.
  What cannot hide: each micro-batch's first gather and last scatter (the largest gather and scatter in the
  inventory, once per micro-batch; once per step with pipeline stages); with tensor parallelism its all-reduces
  (activations: on the critical path); with pipeline stages the hand-offs between stages and the sum of the last
  stage's output (collective-permutes and all-reduces; cost.py puts them between ticks too; a data axis's
  gradient all-reduce is then counted as exposed with them: high by at most that).

tokens/s per GPU = global batch x sequence / step / devices.
"""

from __future__ import annotations

from maxlm.config import Config
from maxlm.plan.cost import degrees, hardware, step_time
from maxlm.plan.target import Target


def comm_seconds(inventory: dict, link: float, network: float) -> dict[str, float]:
  """Seconds per collective kind (see the module doc); link, network: bytes/s per direction per GPU."""
  out = {}
  for kind, row in inventory.items():
    if not isinstance(row, dict):
      continue
    out[kind] = row["ici_wire"] / link + max(row["dcn_wire"] / link, row["network"] / network)
  return out


def _largest(ops: list[dict], kind: str, link: float, network: float) -> float:
  """Seconds of the largest single collective of a kind (the one a micro-batch cannot hide)."""
  times = [o["wire"] / link if o["nodes"] <= 1 else max(o["wire"] / link, o["network"] / network)
           for o in ops if o["kind"] == kind]
  return max(times, default=0.0)


def predict(cfg: Config, target: Target, inventory: dict) -> dict:
  """{"compute_s", "bubble_s", "memory_s", "comm_s", "exposed_s", "step_s", "tokens_per_s_per_gpu",
  "per_kind_s"}: predicted, for the compiled step whose collectives `inventory` lists (collectives.inventory,
  with its "ops")."""
  _, _, link, _, network = hardware(target.kind)
  deg = degrees(cfg, target)
  est = step_time(cfg, target)
  compute = est["compute_s"]
  memory = est["accum_s"] + est["optimizer_s"] + est["offload_s"]
  per_kind = comm_seconds(inventory, link, network)
  comm = sum(per_kind.values())
  ops = inventory.get("ops", [])
  micro = cfg.train.grad_accum if deg["pipeline"] <= 1 else 1  # a pipeline overlaps its micro-batches
  exposed = micro * (_largest(ops, "all-gather", link, network) + _largest(ops, "reduce-scatter", link, network))
  if deg["tensor"] > 1 or deg["pipeline"] > 1:
    exposed += per_kind.get("all-reduce", 0.0)
  if deg["pipeline"] > 1:
    exposed += per_kind.get("collective-permute", 0.0)
  step = exposed + max(compute, comm - exposed) + memory
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  return {"compute_s": compute, "bubble_s": est["bubble_s"], "memory_s": memory, "comm_s": comm,
          "exposed_s": exposed, "step_s": step, "tokens_per_s_per_gpu": tokens / step / target.n_devices,
          "per_kind_s": per_kind}
