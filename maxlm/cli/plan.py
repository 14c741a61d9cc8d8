"""Choose the memory levers of a run, measured by XLA: `maxlm plan config=FILE [key=value ...] [--devices N]`.

Compiles the train step ahead of time (abstract shapes: nothing is allocated) for settings of the levers in
`plan.levers` (model.remat, train.grad_accum, optim.offload, optim.mu_dtype, optim.nu_dtype), fastest expected
first, and reads XLA's memory analysis of each; the first that fits is chosen (maxlm/plan/levers.py says how
they are ordered and pruned). It prints a table of the candidates it compiled: per-device peak, the bytes the
analytic model says are certainly needed, and an estimated step time and tokens/s; the chosen row is
marked `*`. `plan.mode=auto` makes the trainer (and `--dry-run`) apply the same choice.

Options: `--devices N` / `--nodes M` plan for N devices over M nodes (default: the devices here). More than
are here are measured in a child process: by XLA:GPU on N compile-only GPUs of the kind `--target`
names (h200, h100, b200; default: this machine's GPU, else h200) where JAX's CUDA plugin is installed
(maxlm/plan/xla_gpu.py; scripts/setup.sh installs it), else on N simulated CPU devices (XLA:CPU's buffer
assignment with fused attention's footprint, which differs from XLA:GPU's, see maxlm/plan/measure.py); the
table's first line says which. `--device-memory-gb G` one device's memory in GB (a GPU's total before
`xla.mem_fraction`; default: the target's, this GPU's, or an H200's); `--simulate` measures on simulated CPU
devices even where the devices are here or XLA:GPU could (to compare); `--all` compiles every plausible
candidate for the table; `--json`.

Where XLA:GPU measures N > 1 compile-only GPUs, the mesh is chosen too (maxlm/plan/mesh_search.py): the lever
search runs on the `--meshes K` (default 3) most promising meshes by an analytic estimate, and the fastest by
the predicted step time (maxlm/plan/predict.py: the compiled step's collectives at NVLink and network
bandwidth, overlapped with its FLOPs) wins; the table shows each, the chosen one and the runner-up, as config
keys to paste. `--mesh-as-written` keeps the config's mesh (the lever table as before).

Exit codes: 0 with a plan; 2 when nothing fits or on a bad config (one line naming the smallest device
count that fits, when there is one).
"""

from __future__ import annotations

import json
import sys

from maxlm import plan
from maxlm.cli import plan_mesh
from maxlm.cli.grammar import SIZING, command_main, parse_options
from maxlm.config import load_config
from maxlm.tables import human_bytes
from maxlm.runtime import startup


def render(p: plan.Plan, cfg, everything: bool = False) -> str:
  """The table: every compiled candidate (every candidate with --all), the chosen one marked."""
  t = p.target
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  lines = [f"maxlm plan: {cfg.model.name} on {t.describe()}",
           f"{'':2}{'#':>4}  {'model.remat':<19}{'grad_accum':>10}  {'offload':<12}{'mu':<9}{'nu':<9}"
           f"{'certain':>11}{'measured':>12}{'step':>12}{'tok/s':>12}  status"]
  written = p.written
  shown = [(i, r) for i, r in enumerate(p.rows, 1)
           if everything or r.measured is not None or r.probed or r.estimate is not None or r is p.chosen]
  for i, r in shown:
    o, s = r.overrides, (r.seconds if r.seconds is not None else r.estimate["seconds"] if r.estimate is not None
                         else r.time["total_s"])
    how = "m" if r.seconds is not None else "p" if r.estimate is not None else "e"  # measured, probed, roofline
    timing = f"{s:>10.3g}s{how}{tokens / s:>12,.0f}" if t.gpu else f"{'-':>12}{'-':>12}"  # no CPU roofline
    status = r.status + (f": {r.note}" if r.note else "") + ("" if r.how in ("", "measured") else f" ({r.how})")
    status += f"; {r.stats['xla_log']}" if r.stats and r.stats.get("xla_log") else ""  # XLA's own warnings
    status += "; the config as written" if r.overrides == written else ""
    peak = (human_bytes(r.measured) if r.measured is not None else
            f"~{human_bytes(r.plausible)}" if r.probed and r.plausible is not None else
            f"~{human_bytes(r.estimate['bytes'])}" if r.estimate is not None else "-")  # ~: the line
    lines.append(f"{'*' if r is p.chosen else '':2}{i:>4}  {o['model.remat']:<19}{o['train.grad_accum']:>10}  "
                 f"{o['optim.offload']:<12}{o['optim.mu_dtype']:<9}{o['optim.nu_dtype']:<9}{human_bytes(r.certain):>11}"
                 f"{peak:>12}{timing}  {status}")
  counts = {k: sum(r.status == k and not r.probed for r in p.rows) for k in ("pruned", "not tried")}
  if not everything:
    lines.append(f"      not shown: {counts['pruned']} pruned by the analytic model (certain bytes + a share of the "
                 f"rough activations over the usable memory), {counts['not tried']} after the choice; --all lists "
                 "every candidate and compiles each one not pruned")
  lines.append("step / tok/s: m = measured on the devices at hand (a few steps each, the first plan.timed "
               "candidates that fit); p = extended from the 4- and 8-layer steps timed (deep unrolled models on the "
               "GPUs at hand, maxlm/plan/winner.py); e = estimated by a roofline (peak FLOP/s, HBM, link and host bandwidths: an "
               "optimistic bound, maxlm/plan/cost.py)")
  if p.chosen is not None:
    lines.append("chosen: " + " ".join(f"{k}={v}" for k, v in p.chosen.overrides.items())
                 + f"  (plan.mode=auto applies it; {p.line()})")
    lines.append("plan.mode=fit (the default) keeps the config as written where XLA measures it to fit the GPUs at "
                 "hand, else applies the choice")
  return "\n".join(lines)


def as_json(p: plan.Plan) -> str:
  rows = [{"levers": r.overrides, "status": r.status, "certain_bytes": r.certain, "measured_bytes": r.measured,
           "how": r.how, "note": r.note, "estimated_step_s": r.time["total_s"], "measured_step_s": r.seconds,
           "chosen": r is p.chosen,
           "xla": r.stats}
          for r in p.rows]
  t = p.target
  return json.dumps({"target": {"devices": t.n_devices, "nodes": t.n_nodes, "kind": t.kind,
                                "device_bytes": t.device_bytes, "mem_fraction": t.fraction, "usable_bytes": t.usable,
                                "simulated": t.simulated, "gpu_target": t.gpu_target, "measured_by": t.measured_by},
                     "chosen": p.chosen.overrides if p.chosen else None, "candidates": rows}, indent=1)


def run(argv: list[str]) -> int:
  opts, words = parse_options(argv, ("--json", "--all", "--simulate", "--mesh-as-written"),
                              {**SIZING, "--target": str, "--meshes": int})
  everything, simulate, want_json = opts.get("all", False), opts.get("simulate", False), opts.get("json", False)
  as_written, gpu, budget = opts.get("mesh_as_written", False), opts.get("target"), opts.get("meshes")
  cfg = load_config(words)
  for line in startup.begin(cfg):  # as the trainer starts; the cache keeps the compiles for the run
    print(f"maxlm: {line}", file=sys.stderr if want_json else sys.stdout, flush=True)  # stderr under --json
  memory = int(opts["device_memory_gb"] * 1e9) if "device_memory_gb" in opts else None
  target = plan.make_target(cfg, opts.get("devices"), opts.get("nodes"), memory, simulate, gpu)
  # progress on stderr (the table or JSON alone on stdout): each compile's end, and a line every 30 s during one
  target.progress = say = lambda line: print(f"maxlm: {line}", file=sys.stderr, flush=True)
  try:  # where XLA:GPU measures several compile-only GPUs the mesh is chosen too (unless --mesh-as-written)
    sized = plan.size(cfg, target, mode="auto", everything=everything, meshes=0 if as_written else int(budget or 3),
                      report=say)
  finally:
    target.close()
  p = sized.plan
  if isinstance(p, plan.MeshPlan):
    print(plan_mesh.as_json(p, target) if want_json else plan_mesh.render(p, cfg, target), flush=True)
  else:
    print(as_json(p) if want_json else render(p, cfg, everything), flush=True)
  if sized.error is not None:
    raise sized.error
  return 0


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
