"""The planner's choice of mesh for N devices over M nodes: pipeline x data x fsdp x context x tensor, each
intra-node (NVLink) or inter-node (network), chosen by the predicted step time of the compiled step among the
meshes whose levers fit (maxlm/plan/levers.py on each), XLA:GPU measuring both (maxlm/plan/xla_gpu.py).
Within TIE (2%) of the fastest the config's own mesh wins, then the fewer bfloat16 moments.

Candidates (`meshes`): tensor and context inside a node (their exchanges are per layer and on the critical
path: NVLink), powers of two dividing the node's devices, tensor dividing the heads and KV heads, context
dividing data.seq_len into 2 x context chunks; pipeline stages across nodes (point to point, the least traffic:
mesh.dcn_pipeline), dividing the nodes and the layers (the stack is then scanned, as the pipeline needs); the
devices left in a node go to fsdp or to data, those left across nodes the same; context and pipeline are not
combined (maxlm/parallel/pipelining.py refuses them together). The global batch must split over data x fsdp.

Order: an analytic estimate (`estimate`: the planner's step time (cost.py, which counts the context axis's
exchange and the pipeline's bubble) for the mesh's first plausible lever setting, with the tensor-parallel
all-reduces per layer at NVLink added), only to decide which meshes to compile: the `budget` first of those
whose certain bytes fit. Each of those gets the lever search (compiled), then the prediction of
maxlm/plan/predict.py from its compiled collectives; the fastest predicted wins (within TIE: see above), the
next is the runner-up. Deterministic: exact ties go to the earlier candidate.
"""

from __future__ import annotations

import dataclasses
import time

from maxlm.config import Config, ConfigError
from maxlm.layers import resolve_backend
from maxlm.parallel.mesh import mesh_shape
from maxlm.parallel.pipelining import repeats as pipeline_repeats
from maxlm.plan import heartbeat, moments
from maxlm.plan.levers import apply, candidates, certain_bytes, most_saving
from maxlm.plan.cost import TIE, degrees, hardware, step_time  # TIE: predictions closer are a tie
from maxlm.plan.target import Target

MESH_KEYS = ("mesh.pipeline", "mesh.data", "mesh.fsdp", "mesh.context", "mesh.tensor", "mesh.dcn_pipeline",
             "mesh.dcn_data", "mesh.dcn_fsdp", "mesh.dcn_context", "mesh.dcn_tensor")


def _pow2_divisors(n: int) -> list[int]:
  return [d for d in (2 ** i for i in range(n.bit_length())) if n % d == 0]


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: Config, n_devices: int, n_nodes: int) -> list[dict]:
  """Every candidate mesh (see the module doc) as config overrides, in a fixed order."""
  m, per_node = cfg.model, n_devices // n_nodes
  out = []
  for tensor in _pow2_divisors(per_node):
    if m.n_heads % tensor or m.n_kv_heads % tensor:
      continue
    for context in _pow2_divisors(per_node // tensor):
      if cfg.data.seq_len % (2 * context):
        continue
      rest = per_node // (tensor * context)
      for pipeline in _divisors(n_nodes):
        # the stack splits into S stages of V chunks each (V: train.pipeline_repeats under circular, else 1)
        if m.n_layers % (pipeline * (pipeline_repeats(cfg.train) if pipeline > 1 else 1)) or (
            pipeline > 1 and context > 1):
          continue
        across = n_nodes // pipeline
        for data, fsdp in dict.fromkeys(((1, rest), (rest, 1))):
          for dcn_data, dcn_fsdp in dict.fromkeys(((1, across), (across, 1))):
            if cfg.data.global_batch_size % (data * fsdp * dcn_data * dcn_fsdp):
              continue
            o = dict(zip(MESH_KEYS, (1, data, fsdp, context, tensor, pipeline, dcn_data, dcn_fsdp, 1, 1)))
            if pipeline > 1:
              o["model.scan_layers"] = True  # the pipeline splits the scanned stack
            out.append(o)
  return out


def label(o: dict) -> str:
  """'pipeline 1 x data 1 x fsdp 8 x context 1 x tensor 1 (intra-node) | ... (inter-node)', nonzero axes only."""
  def part(prefix):
    axes = [(k.split(".")[-1].removeprefix("dcn_"), v) for k, v in o.items() if k.startswith(f"mesh.{prefix}")
            and (prefix or not k.startswith("mesh.dcn_")) and v > 1]
    return " x ".join(f"{a} {v}" for a, v in axes) or "1"
  return f"node: {part('')}; across nodes: {part('dcn_')}"


def extra_seconds(cfg: Config, target: Target) -> float:
  """What cost.step_time leaves out of a mesh: the tensor-parallel all-reduces of the activations (4 per layer:
  2 forward, 2 backward, on [rows, T / context, D] of the compute dtype; a ring moves 2 (t - 1) / t of each),
  at NVLink (cost.step_time counts the context axis's K/V exchange and the pipeline's bubble itself)."""
  m, d = cfg.model, cfg.data
  deg = degrees(cfg, target)
  t = deg["tensor"]
  if t == 1:
    return 0.0
  link = hardware(target.kind)[2]
  rows = d.global_batch_size / (deg["data"] * deg["fsdp"])
  tokens = rows * d.seq_len / deg["context"]
  return 4 * m.n_layers * tokens * m.d_model * 2 * 2 * (t - 1) / t / (deg["pipeline"] * link)


def estimate(cfg: Config, target: Target) -> tuple[float, dict] | None:
  """(estimated seconds, levers) of the mesh of `cfg` at its first lever setting that the analytic model finds
  plausible (certain bytes + half the rough activations within the usable memory); None where none is."""
  try:
    rows = candidates(cfg, target, resolve_backend(cfg.model.backend))
  except ConfigError:
    return None
  for o in rows:
    c = apply(cfg, o)
    need = certain_bytes(c, target)
    if need["certain"] + need["activations"] // 2 <= target.usable:
      return step_time(c, target)["total_s"] + extra_seconds(c, target), o
  return None


@dataclasses.dataclass
class MeshRow:
  overrides: dict
  estimate_s: float | None  # the analytic estimate (ordering only)
  status: str  # "chosen", "runner-up", "compiled", "nothing fits", "not compiled", "certain bytes too big"
  plan: object = None  # the lever search's Plan, where compiled
  predicted: dict | None = None  # maxlm/plan/predict.py's, where a plan fits
  written: bool = False  # the config's own mesh

  @property
  def label(self) -> str:
    return label(self.overrides)


@dataclasses.dataclass
class MeshPlan:
  rows: list[MeshRow]
  chosen: MeshRow | None
  runner_up: MeshRow | None


def _shape(cfg: Config, target: Target) -> tuple | None:
  try:
    ici, dcn = mesh_shape(cfg.mesh, target.n_devices, target.n_nodes)
  except ConfigError:
    return None
  return tuple(ici), tuple(dcn)


def _bf16_moments(cfg: Config) -> int:
  """How many of the Adam moments (maxlm/plan/moments.py KEYS) the config keeps in bfloat16."""
  return sum(getattr(cfg.optim, k.split(".")[1]) == "bfloat16" for k in moments.KEYS)


def search(cfg: Config, target: Target, plan_fn, predict_fn, budget: int = 3, estimate_fn=None,
           report=None) -> MeshPlan:
  """plan_fn(cfg) -> the lever search's Plan (chosen row's stats carry the compiled collectives);
  predict_fn(cfg, stats) -> predict.predict's dict; estimate_fn(cfg, target) -> `estimate`'s (the default).
  Meshes are compiled in the estimate's order until `budget` of them fit; the config's own mesh, where it is a
  candidate, is compiled too (marked "as written"). report(line): a line as each mesh's lever search begins
  and ends."""
  estimate_fn, report = estimate_fn or estimate, report or (lambda line: None)
  rows, written, began = [], _shape(cfg, target), time.monotonic()
  every = meshes(cfg, target.n_devices, target.n_nodes)
  with heartbeat.beating(report, f"estimating {len(every)} meshes (nothing compiled yet)", target.heartbeat_s):
    for o in every:
      c = apply(cfg, o)
      try:
        levers = most_saving(c, target)
      except ConfigError:
        levers = None
      if levers is None or certain_bytes(apply(c, levers), target)["certain"] > target.usable:
        rows.append(MeshRow(o, None, "certain bytes too big"))
        continue
      est = estimate_fn(c, target)
      rows.append(MeshRow(o, est[0] if est else None, "not compiled"))
  report(f"plan: {len(every)} meshes estimated ({time.monotonic() - began:.0f} s); the lever search on the fastest "
         f"until {budget} fit, and on the config's own")
  order = sorted((r for r in rows if r.estimate_s is not None), key=lambda r: r.estimate_s)
  fitting = 0
  for r in order:
    as_written = _shape(apply(cfg, r.overrides), target) == written
    if fitting >= budget and not as_written:
      continue
    c, began = apply(cfg, r.overrides), time.monotonic()
    report(f"plan: mesh {label(r.overrides)} (estimated {r.estimate_s:.3g} s a step"
           + ("; the config's mesh" if as_written else f"; {fitting} of {budget} meshes fit so far") + "): its levers")
    r.plan = plan_fn(c)
    r.written = as_written
    if r.plan.chosen is None:
      r.status = "nothing fits"
      report(f"plan: mesh {label(r.overrides)}: nothing fits ({time.monotonic() - began:.0f} s)")
      continue
    fitting += 1
    r.status = "compiled"
    r.predicted = predict_fn(r.plan.cfg, r.plan.chosen.stats)
    levers = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r.plan.chosen.overrides.items())
    report(f"plan: mesh {label(r.overrides)}: {levers} fits, predicted {r.predicted['step_s']:.3g} s a step "
           f"({time.monotonic() - began:.0f} s)")
  done = sorted((r for r in order if r.predicted), key=lambda r: r.predicted["step_s"])
  if done:  # within TIE of the fastest: the config's own mesh first, then the fewer bfloat16 moments, then speed
    best = done[0].predicted["step_s"]
    near = [r for r in done if r.predicted["step_s"] <= best * (1 + TIE)]
    near.sort(key=lambda r: (not r.written, _bf16_moments(r.plan.cfg), r.predicted["step_s"]))
    done = near + [r for r in done if r not in near]
  chosen, runner = (done + [None, None])[:2]
  if chosen:
    chosen.status = "chosen"
  if runner:
    runner.status = "runner-up"
  return MeshPlan(rows, chosen, runner)
