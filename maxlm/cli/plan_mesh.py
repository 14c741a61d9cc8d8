"""`maxlm plan --devices N [--nodes M]` on XLA:GPU's compile-only GPUs: the mesh the planner chooses
(maxlm/plan/mesh_search.py), the runner-up, and each candidate compiled, with its levers, its measured peak per
device and its predicted step time (maxlm/plan/predict.py: a prediction, never measured here)."""

from __future__ import annotations

import json

from maxlm import plan
from maxlm.tables import human_bytes

GIB = 2 ** 30


def _settings(o: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in o.items())


def render(mp: plan.MeshPlan, cfg, target: plan.Target) -> str:
  lines = [f"maxlm plan: the mesh of {cfg.model.name} on {target.describe()}",
           f"  {'mesh':<58}{'est. step':>10}  {'levers (remat, accum, offload, mu, nu)':<50}{'peak':>11}"
           f"{'predicted':>11}{'tok/s/GPU':>11}  status"]
  rank = {"chosen": 0, "runner-up": 1}
  done = sorted((r for r in mp.rows if r.plan is not None),
                key=lambda r: (rank.get(r.status, 2), r.predicted["step_s"] if r.predicted else float("inf")))
  shown = done + sorted(
      (r for r in mp.rows if r.plan is None and r.estimate_s is not None), key=lambda r: r.estimate_s)[:5]
  for r in shown:
    c = r.plan.chosen if r.plan is not None else None
    levers = ", ".join(str(v) for v in c.overrides.values()) if c else "-"
    peak = human_bytes(c.measured) if c else "-"
    pred = f"{r.predicted['step_s']:>10.3g}s{r.predicted['tokens_per_s_per_gpu']:>11,.0f}" if r.predicted else \
        f"{'-':>11}{'-':>11}"
    est = f"{r.estimate_s:>9.3g}s" if r.estimate_s is not None else f"{'-':>10}"
    mark = {"chosen": "*", "runner-up": "2"}.get(r.status, "")
    status = r.status + ("; the config's mesh" if r.written else "")
    lines.append(f"{mark:2}{r.label:<58}{est}  {levers:<50}{peak:>11}{pred}  {status}")
  skipped = sum(r.status == "certain bytes too big" for r in mp.rows)
  rest = sum(r.plan is None and r.estimate_s is not None for r in mp.rows) - sum(r.plan is None for r in shown)
  lines.append(f"  {len(mp.rows)} meshes: {skipped} need more than a device holds (certain bytes, every lever at its "
               f"most saving); {max(0, rest)} more not compiled, slower by the estimate")
  warned = [r for m in mp.rows if m.plan is not None for r in m.plan.rows if (r.stats or {}).get("xla_log")]
  if warned:  # XLA's own warnings (maxlm/plan/xla_log.py), caught during the compiles
    lines.append(f"  XLA warned compiling {len(warned)} candidate(s), e.g. {warned[0].stats['xla_log']} "
                 "(--json: each candidate's xla_log)")
  lines.append("est. step: the analytic estimate that orders the meshes; predicted: from the compiled step's "
               "collectives and FLOPs (maxlm/plan/predict.py): a roofline bound (every FLOP at the peak), not a "
               "measurement")
  for name, r in (("chosen", mp.chosen), ("runner-up", mp.runner_up)):
    if r is not None:
      lines.append(f"{name}: {_settings(r.overrides)} {_settings(r.plan.chosen.overrides)} (predicted "
                   f"{r.predicted['step_s']:.3g} s per step, {r.predicted['tokens_per_s_per_gpu']:,.0f} tokens/s "
                   f"per GPU; peak {human_bytes(r.plan.chosen.measured)} per device)")
  if mp.chosen is None:
    lines.append("chosen: none (no compiled mesh fits)")
  return "\n".join(lines)


def as_json(mp: plan.MeshPlan, target: plan.Target) -> str:
  def row(r):
    c = r.plan.chosen if r.plan is not None else None
    return {"mesh": r.overrides, "estimate_s": r.estimate_s, "status": r.status, "as_written": r.written,
            "levers": c.overrides if c else None, "measured_bytes": c.measured if c else None,
            "predicted": r.predicted, "collectives": (c.stats or {}).get("collectives") if c else None,
            "xla_log": [x.stats["xla_log"] for x in (r.plan.rows if r.plan else []) if (x.stats or {}).get("xla_log")]}
  return json.dumps({"target": {"devices": target.n_devices, "nodes": target.n_nodes, "kind": target.kind,
                                "usable_bytes": target.usable, "measured_by": target.measured_by},
                     "chosen": row(mp.chosen) if mp.chosen else None,
                     "runner_up": row(mp.runner_up) if mp.runner_up else None,
                     "meshes": [row(r) for r in mp.rows if r.plan is not None]}, indent=1)
