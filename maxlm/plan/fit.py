"""Does it fit? One sizing of a run (`Sizing`), made by `size` and shown by four doors: the dry run
(maxlm/cli/dryrun.py: the analytic bytes, the host check, the verdict and plan.mode's line), `maxlm plan`
(maxlm/cli/plan.py: the candidates the search saw), `--compile-only` (maxlm/cli/train.py: XLA's bytes of the step
it compiled) and plan.mode=fit's checks before a run (`Sizing.check`, maxlm/plan/decision.py).

`size` applies plan.mode (`by_mode`): off = the config as written; auto = the search's choice (`search`); fit (the
default) = on the GPUs at hand the config as written when XLA measures it to fit (one compile; none where the bytes it
certainly needs exceed a device), else the search's choice; on a CPU or for other devices, as written. Then it sizes
the config that came out: maxlm/plan/memory.py's analytic bytes per device, and what optim.offload pins against the
host's RAM.

`search` is what a tool calls: the lever search (maxlm/plan/levers.py) on a target (maxlm/plan/target.py), a deep
offloaded candidate on XLA:GPU's compile-only GPUs first probed shallow (maxlm/plan/probe.py `measuring`), timed on
the GPUs at hand; with `meshes` > 0 on several compile-only GPUs the mesh is chosen too (maxlm/plan/mesh_search.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax

from maxlm.build import memory_stats
from maxlm.config import Config, ConfigError
from maxlm.layers import resolve_backend
from maxlm.plan import levers, memory, mesh_search, predict, probe, winner
from maxlm.plan.cost import degrees
from maxlm.plan.levers import Plan, certain_bytes, current, host_need, host_short, kept, kept_line
from maxlm.plan.no_fit import kept_message, no_fit_message
from maxlm.plan.target import Target, make_target
from maxlm.plan.xla_gpu import cond_copies
from maxlm.runtime.devices import device_memory_bytes, is_gpu, local_device
from maxlm.tables import human_bytes

NO_GPU_HINT = "no GPU here: `maxlm plan config=... --devices N --simulate` sizes it for N H200s"


def gpu_here() -> bool:
  """This process's devices are GPUs (or stand for them: the test switch, maxlm/runtime/devices.py)."""
  return is_gpu(local_device())


@dataclasses.dataclass
class Sizing:
  """One answer to "does it fit?" (the module doc says who shows it)."""
  cfg: Config  # the config sized: as written, or with the levers plan.mode chose
  n_devices: int
  n_nodes: int
  device_bytes: int | None  # one device's memory the analytic bytes are held against (None: not known)
  analytic: dict  # maxlm/plan/memory.py `estimate`: bytes per device of each part, lower_bound and total
  measured: dict | None = None  # XLA's bytes (maxlm.build.memory_stats) where XLA measured the config as written
  host: dict | None = None  # optim.offload's pinned memory against the host: ram_per_device, pinned, copies, short
  plan: Plan | mesh_search.MeshPlan | None = None  # the search, where one ran: the candidates it saw
  line: str | None = None  # what plan.mode did, in one line (None: nothing)
  error: ConfigError | None = None  # nothing fits: the one line (each door raises it once it has shown its view)
  how: str = ""  # how the levers came: "as written, measured to fit by plan.mode=fit", "chosen by plan.mode=auto"

  @property
  def candidates(self) -> list:
    return self.plan.rows if self.plan is not None else []

  @property
  def verdict(self) -> str:
    """Against one device, by the analytic bytes: "fits" (the total), "lower bound fits" (what is certainly held
    does, the total does not), "does not fit" (what is certainly held does not), "unknown" (no device size)."""
    if not self.device_bytes:
      return "unknown"
    if self.analytic["total"] <= self.device_bytes:
      return "fits"
    return "lower bound fits" if self.analytic["lower_bound"] <= self.device_bytes else "does not fit"

  def check(self) -> None:
    """plan.mode=fit's checks before a run, as one line (ConfigError): nothing fits; or, where the planner set
    nothing, what optim.offload pins exceeds the host's RAM, or the bytes the step certainly needs exceed a device
    (on a CPU with the hint how to size it for GPUs)."""
    if self.error is not None:
      raise self.error
    if self.line is not None:
      return
    if self.host is not None and self.host["short"] is not None:
      less = ("optim.offload=host (the moments only) or none" if self.cfg.optim.offload == "host_params" else
              "optim.offload=none")
      raise ConfigError(f"config key 'optim.offload': {self.host['short']}; use more devices (the state shards over "
                        f"fsdp), {less}, or a node with more RAM")
    if self.device_bytes:
      try:
        memory.check_fits(self.cfg, self.n_devices, self.device_bytes, n_nodes=self.n_nodes)
      except ConfigError as e:
        if gpu_here():
          raise
        raise ConfigError(f"{e}; {NO_GPU_HINT}") from None


def shallow_first(cfg: Config, target: Target) -> bool:
  """Whether the search chooses its winner from shallow programs (maxlm/plan/winner.py): on the GPUs at hand of one
  process (where steps are timed), a model deep and unrolled enough to probe."""
  return levers.timer(cfg, target) is not None and probe.depths(cfg, degrees(cfg, target)["pipeline"]) is not None


def search(cfg: Config, target: Target, everything: bool = False, meshes: int = 0, known: dict | None = None,
           report=None, probed: dict | None = None, costs: winner.Costs | None = None) -> Plan | mesh_search.MeshPlan:
  """The fastest setting of plan.levers that fits `target` (see the module doc); `known`: measurements made already,
  by lever values (`probed`: shallow estimates, `costs`: the planning's parts so far, maxlm/plan/winner.py);
  everything: every plausible candidate compiled (for `maxlm plan --all`); report(line): a line as each compile and
  timing ends."""
  levers.parse_levers(cfg.plan.levers)
  if not everything and shallow_first(cfg, target):  # only the winner compiled whole, nothing timed whole
    return winner.search(cfg, target, target.measure, resolve_backend(cfg.model.backend), levers.timer(cfg, target),
                         known, probed, costs, report)
  measure = probe.measuring(target, report)
  if meshes > 0 and target.gpu_target and target.n_devices > 1:
    return mesh_search.search(
        cfg, target, lambda c: levers.search(c, target, measure, resolve_backend(c.model.backend), report=report),
        lambda c, stats: predict.predict(c, target, stats["collectives"]), meshes, report=report)
  return levers.search(cfg, target, measure, resolve_backend(cfg.model.backend), everything, known=known,
                       timer=levers.timer(cfg, target), timed=cfg.plan.timed, report=report)


def no_fit_error(cfg: Config, p: Plan, target, note: str = "", known: dict | None = None, report=None) -> ConfigError:
  """The one line when the search `p` found nothing that fits. Where plan.levers keeps lever keys as written (the
  user's own), the search runs again with every lever free (by the roofline's order, untimed; what `p` measured
  is reused), and the line names the kept keys to change and the fastest setting that fits (no_fit.kept_message);
  when nothing fits with every lever either, or nothing was kept, the no-fit line of that search."""
  if isinstance(p, mesh_search.MeshPlan):
    return ConfigError(f"no mesh of {target.n_devices} devices over {target.n_nodes} node(s) fits: see the table")
  if not kept(cfg):
    return ConfigError(no_fit_message(cfg, p, note))
  wide = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, levers="all"))
  known = {**(known or {}), **{tuple(r.overrides.items()): r.stats for r in p.rows if r.stats is not None}}
  if report is not None:
    report(f"plan: nothing fits with the lever keys kept as written ({kept_line(cfg)}); searching with every lever "
           "free to say what would")
  q = levers.search(wide, target, target.measure, resolve_backend(cfg.model.backend), known=known, report=report)
  if q.chosen is None:
    return ConfigError(no_fit_message(wide, q, "; ".join(filter(None, (
        note, f"every lever tried, the ones plan.levers keeps ({kept_line(cfg)}) too")))))
  return ConfigError(kept_message(cfg, p, q, note))


@dataclasses.dataclass
class Decision:
  """What plan.mode made of a config (`by_mode`)."""
  cfg: Config
  line: str | None = None
  plan: Plan | mesh_search.MeshPlan | None = None
  measured: dict | None = None
  error: ConfigError | None = None


def _written_fits(cfg: Config, target: Target, known: dict, probed: dict, costs: winner.Costs,
                  report) -> tuple[dict | None, str]:
  """plan.mode=fit's one compile of the config as written (none where the bytes it certainly needs exceed a device,
  or what it pins the host; none either where the search chooses from shallow programs and the config's own extend
  over the usable memory: its estimate is kept in `probed` for the search): (XLA's measurement or None, why it does
  not fit as written)."""
  certain, short = certain_bytes(cfg, target)["certain"], host_short(cfg, target)
  why = short or f"certainly needs {human_bytes(certain)}"
  if certain > target.usable or short is not None:
    return None, why
  began, key = time.monotonic(), tuple(current(cfg).items())
  if shallow_first(cfg, target):
    est = probed[key] = winner.estimate(cfg, degrees(cfg, target)["pipeline"], target.measure,
                                        levers.timer(cfg, target), costs)
    if "oom" in est or est["bytes"] > target.usable:
      if report is not None:
        report(f"plan: probed the config as written: {est.get('oom') or human_bytes(est['bytes'])} at "
               f"{cfg.model.n_layers} layers ({time.monotonic() - began:.0f} s)")
      return None, (f"ran XLA out of memory at {est['at']} layers" if "oom" in est else
                    f"is extended to {human_bytes(est['bytes'])} from its {est['depths'][0]}- and "
                    f"{est['depths'][1]}-layer programs")
  m = known[key] = winner.spend(costs, "full_compile", target.measure, cfg)
  if report is not None:
    report("plan: compiled the config as written: " + ("XLA ran out of memory" if "oom" in m else
           f"peak {human_bytes(m['device'])} of {human_bytes(target.usable)}") + f" ({time.monotonic() - began:.0f} s)")
  return m, "ran XLA out of memory compiling" if "oom" in m else f"peaks at {human_bytes(m['device'])}"


def by_mode(cfg: Config, target: Target | None = None, n_devices: int | None = None, n_nodes: int | None = None,
            device_memory: int | None = None, mode: str | None = None, everything: bool = False, meshes: int = 0,
            on_measure=None, report=None) -> Decision:
  """plan.mode (or `mode`) applied to cfg on `target` (default: the devices at hand, or n_devices over n_nodes,
  made here and closed after; see the module doc). `on_measure` is told before each compile (the start-up
  watchdog's sign of progress), `report(line)` after each compile and timing."""
  mode = mode or cfg.plan.mode
  if mode == "off" or (mode != "auto" and (target is not None or n_devices or n_nodes or not gpu_here())):
    return Decision(cfg)  # fit on a CPU or for other devices: the config as written (`maxlm plan` plans for those)
  own = target is None
  target = target or make_target(cfg, n_devices, n_nodes, device_memory)
  target.on_measure = on_measure or target.on_measure
  try:
    if mode == "auto":
      p = search(cfg, target, everything, meshes, report=report)
      if p.chosen is None:
        return Decision(cfg, plan=p, error=no_fit_error(cfg, p, target, report=report))
      return (Decision(p.chosen.plan.cfg, p.chosen.plan.line(), p) if isinstance(p, mesh_search.MeshPlan) else
              Decision(p.cfg, p.line(), p))
    known, probed, costs = {}, {}, winner.Costs()
    m, why = _written_fits(cfg, target, known, probed, costs, report)
    if m is not None and "oom" not in m and m["device"] <= target.usable:
      spent = f"; {costs.line()}" if costs.probe_compiles else ""
      return Decision(cfg, f"plan: the config fits as written (peak {human_bytes(m['device'])} of "
                           f"{human_bytes(target.usable)} usable per device, measured by XLA; plan.mode=fit keeps it)"
                           + spent, measured=m)
    p = search(cfg, target, known=known, report=report, probed=probed, costs=costs)
    if p.chosen is None:
      return Decision(cfg, plan=p, measured=m,
                      error=no_fit_error(cfg, p, target, f"as written the config {why} per device", known, report))
    return Decision(p.cfg, f"{p.line()}; as written the config {why} per device", p, m)
  finally:
    if own:
      target.close()


def size(cfg: Config, target: Target | None = None, *, devices: int | None = None, nodes: int | None = None,
         device_memory: int | None = None, mode: str | None = None, everything: bool = False, meshes: int = 0,
         state_of=None, compiled=None, on_measure=None, report=None) -> Sizing:
  """The Sizing of cfg on `target`, or on the devices at hand (none of devices / nodes given), or on `devices` over
  `nodes` (a target is made only where something is measured). plan.mode (or `mode`) is applied first (`by_mode`);
  `compiled`: a step compiled already (--compile-only), whose XLA bytes are taken and nothing is planned.
  device_memory: one device's bytes (default: the target's, or this device's when at hand). state_of(cfg, n_devices,
  n_nodes) -> {"params", "optimizer", "fp8_meta"}: bytes per device read off the sized config's abstract state (the
  dry run), taken in place of the formulas (fp8_meta None: its formula). Nothing fits: Sizing.error holds the one line (not raised)."""
  levers.parse_levers(cfg.plan.levers)
  local = target is None and devices is None and nodes is None
  if target is not None:
    n, n_nodes, device_bytes = target.n_devices, target.n_nodes, device_memory or target.device_bytes
  elif local:
    n, n_nodes, device_bytes = jax.device_count(), jax.process_count(), device_memory or device_memory_bytes()
  else:
    n_nodes = nodes or 1
    n, device_bytes = devices or n_nodes * jax.local_device_count(), device_memory
  d = (Decision(cfg, measured=memory_stats(compiled)) if compiled is not None else
       by_mode(cfg, target, devices, nodes, device_memory, mode, everything, meshes, on_measure, report))
  out = d.cfg
  state = state_of(out, n, n_nodes) if state_of is not None else None
  if state is not None and state["fp8_meta"] is None:  # not read off the state (the FP8 recipe does not run here)
    state["fp8_meta"] = memory.fp8_meta_bytes(out.model)
  analytic = memory.estimate(out, n, n_nodes, state=state)
  host = None
  if local and out.optim.offload != "none" and gpu_here():  # what the offload pins, against this host
    t = make_target(out)
    if t.host_bytes:
      host = {"ram_per_device": t.host_bytes, "pinned": host_need(out, t), "copies": 2 if cond_copies() else 1,
              "short": host_short(out, t)}
  how = ((f"as written, measured to fit by plan.mode={cfg.plan.mode}" if out is cfg else
          f"chosen by plan.mode={mode or cfg.plan.mode}") if d.line else f"plan.mode={cfg.plan.mode}")
  return Sizing(out, n, n_nodes, device_bytes, analytic, d.measured, host, d.plan, d.line, d.error, how)
