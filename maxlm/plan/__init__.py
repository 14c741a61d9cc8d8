"""The memory planner: the fastest setting of the memory levers whose train step fits, as measured by XLA.

Levers (each a plain config key; `plan.levers` lists those the planner may set): `model.remat`, `train.grad_accum`
(micro-batches at the same global batch), `optim.offload` (none | host | host_params), `optim.mu_dtype` and
`optim.nu_dtype` (float32 | bfloat16; a bfloat16 nu only with a bfloat16 mu). The search tries their settings
fastest expected first and compiles the train step of each plausible one ahead of time on abstract shapes (XLA's
`memory_analysis()`, nothing allocated); the first whose measured peak fits the usable memory wins (on the GPUs at
hand, the fastest timed of the first `plan.timed` that fit).

The face (the commands import nothing else of the planner):
* `for_run(cfg, say, watch) -> (cfg, how)`: what a run calls, before its trainer is built: plan.mode applied once by
  process 0, whose decision every process runs.
* `size(cfg, target) -> Sizing`: does it fit? The analytic bytes, XLA's where it measured, the host check, the
  verdict and the candidates seen; the dry run, `maxlm plan`, `--compile-only` and plan.mode=fit's checks each
  show a Sizing.
* `search(cfg, target) -> Plan` (or a MeshPlan where the mesh is chosen too): what a tool calls.
* `make_target(cfg, ...) -> Target`: the devices a plan is for (at hand, simulated, or XLA:GPU's compile-only).
* `oom_message(...)`: the run's out-of-memory line.

Inside, one job per file: decision.py (the run's decision: plan.mode, kept across starts), fit.py (the Sizing,
plan.mode applied, the search's entry), levers.py (the levers, their order, the search, its lines), winner.py (on
the GPUs at hand, the winner from shallow programs, only it compiled whole), no_fit.py (the line when nothing fits),
oom.py (the out-of-memory line), moments.py (the moment dtypes), memory.py (the analytic bytes), cost.py (the
roofline step time), probe.py (shallow probes), timing.py (step times measured), measure.py (XLA's bytes of a
compiled step), target.py (the target and its simulator), kinds.py (the GPU kinds, a table),
xla_gpu.py (XLA:GPU's compile-only GPUs), standins.py (a GPU's step on XLA:CPU), collectives.py and predict.py (the
compiled step's collectives, a predicted step time), mesh_search.py (the mesh), clock.py, heartbeat.py and
xla_log.py (the start-up watchdog's expectations, progress lines, XLA's own warnings).

* Usable memory: device memory x `xla.mem_fraction` (0.95 on a GPU by default; XLA's own default is 0.75),
  less a margin of 2%: XLA's estimate equalled the allocator's measured peak on the H200 (41.8 and 38.7 GB,
  benchmarks/README.md), and the margin covers fragmentation of XLA's memory pool.
"""

from __future__ import annotations

import jax

from maxlm.config import Config
from maxlm.metrics import echo
from maxlm.plan.decision import decide, view
from maxlm.plan.fit import Sizing, search, size
from maxlm.plan.levers import Plan, apply, current
from maxlm.plan.mesh_search import MeshPlan
from maxlm.plan.oom import oom_message
from maxlm.plan.target import Target, make_target
from maxlm.runtime import agree, watchdog
from maxlm.tables import human_bytes

__all__ = ["MeshPlan", "Plan", "Sizing", "Target", "for_run", "make_target", "oom_message", "search", "size"]


def for_run(cfg: Config, say=None, watch=None) -> tuple[Config, str]:
  """(the run's config by plan.mode, how its levers came), decided once for the run, before the trainer is built:
  by process 0, whose decision every process applies (maxlm/runtime/agree.py), so that all run one program. A
  process whose own view of its devices differs from process 0's says so in one warning line. `say` prints the
  plan's line (process 0's), and as it plans a line for each compile and timing; `watch` is the start-up
  watchdog: each of the planner's compiles is a phase whose limit comes from the compiles before it (maxlm/plan/clock.py,
  maxlm/runtime/watchdog.py `planned_compile_limit`; the first: train.watchdog_first_step_s)."""
  watch = watch or watchdog.OFF
  limit = watchdog.start_up_limit(cfg.train)

  def measuring(expected: float | None) -> None:  # process 0, before each compile: a new phase, a sign of life
    agree.progress("plan")
    watch.arm("start-up: plan (a compile)", limit=watchdog.planned_compile_limit(cfg.train, expected))
  progress = (lambda line: say(f"maxlm: {line}")) if say is not None else None  # each compile and timing, as it ends
  got = agree.decide("plan", lambda: decide(cfg, measuring, progress), watch, "start-up: plan", limit)
  out = cfg if got["levers"] == current(cfg) else apply(cfg, got["levers"])
  mine = view() if jax.process_index() > 0 and cfg.plan.mode != "off" else got["view"]
  if mine != got["view"]:
    echo(f"maxlm: warning: plan: this process sees {mine[0]} with {human_bytes(mine[1] or 0)}, process 0 "
         f"{got['view'][0]} with {human_bytes(got['view'][1] or 0)}; every process runs process 0's plan "
         f"({', '.join(f'{k}={v}' for k, v in got['levers'].items())})")
  if say is not None and got["line"] is not None:
    say(f"maxlm: {got['line']}")
  return out, got["how"]
