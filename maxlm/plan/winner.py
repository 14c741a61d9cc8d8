"""On the GPUs at hand, a deep unrolled model: the winner chosen from shallow programs, and only the winner compiled
whole (issue 55: the 8B's first start on one H200 spent ~400 s planning: the config as written compiled, six shallow
probes, two full compiles and one timing).

For each plausible candidate, fastest by the roofline first (maxlm/plan/levers.py: its order, and its pruning by the
analytic model and by the host's RAM), the step with 4 and 8 layers per pipeline stage (maxlm/plan/probe.py) is
compiled (XLA's peak) and timed (maxlm/plan/timing.py: a few steps), and both lines are extended to the model's depth
(`estimate`): the bytes as probe.py extends them, the seconds the same way, each unrolled layer adding its work. A
candidate whose extended peak is over the usable memory by more than probe.SLACK, or whose probe runs out of memory,
is pruned. Once `plan.timed` candidates have estimates (or, with one, plan.budget_s is spent), the winner is the
fastest estimate with a margin (`order`): within TIE of the fastest, the earlier in the roofline's order wins (fewer
bfloat16 moments, less recomputation), and a candidate whose line is over the usable memory (inside the slack) comes
after every one whose line is under it. The winner alone is compiled whole to confirm that it fits (XLA's measured
peak); where it does not, the next in that order is. No step is timed whole.

The plan line says what each part cost (`Costs.line`); `start_up_seconds` says beforehand what they should cost, from
the counts of compiles and timings and their expected times.
"""

from __future__ import annotations

import dataclasses
import time

from maxlm.config import Config
from maxlm.plan import moments, probe
from maxlm.plan.cost import degrees, step_time
from maxlm.plan.levers import (START_SHARE, Plan, Row, _fits, _probed, _share, apply, candidates, certain_bytes,
                               current, host_short, label, parse_levers)
from maxlm.plan.target import Target
from maxlm.tables import human_bytes

TIE = 0.03  # estimated step times closer than this (relative) are a tie: the roofline's order decides


@dataclasses.dataclass
class Costs:
  """Seconds and counts of each part of the planning on the GPUs at hand."""
  probe_compile_s: float = 0.0
  probe_compiles: int = 0
  probe_timing_s: float = 0.0
  probe_timings: int = 0
  full_compile_s: float = 0.0
  full_compiles: int = 0
  timing_s: float = 0.0  # steps timed whole: none on this path

  def line(self) -> str:
    return (f"planning: probes {self.probe_compile_s + self.probe_timing_s:.0f} s ({self.probe_compiles} shallow "
            f"compiles {self.probe_compile_s:.0f} s, {self.probe_timings} shallow timings {self.probe_timing_s:.0f} s), "
            f"full compile {self.full_compile_s:.0f} s ({self.full_compiles}), timing {self.timing_s:.0f} s")

  def as_dict(self) -> dict:
    return dataclasses.asdict(self) | {"line": self.line()}


def start_up_seconds(estimated: int, probe_compile_s: float, probe_timing_s: float, full_compile_s: float,
                     fallbacks: int = 0) -> dict:
  """The planner's expected seconds on this path: `estimated` candidates of two shallow compiles and two shallow
  timings each, one full compile of the winner and one more per fallback (a winner that does not fit whole), no
  whole step timed: {"probes_s", "full_compile_s", "timing_s", "total_s"}."""
  probes = estimated * probe.PROBES * (probe_compile_s + probe_timing_s)
  full = (1 + fallbacks) * full_compile_s
  return {"probes_s": probes, "full_compile_s": full, "timing_s": 0.0, "total_s": probes + full}


def spend(costs: Costs, kind: str, fn, *args, clock=time.monotonic):
  """fn(*args), its seconds and one count added to `costs` (kind: probe_compile, probe_timing, full_compile)."""
  began = clock()
  try:
    return fn(*args)
  finally:
    setattr(costs, f"{kind}_s", getattr(costs, f"{kind}_s") + clock() - began)
    setattr(costs, f"{kind}s", getattr(costs, f"{kind}s") + 1)


def estimate(cfg: Config, stages: int, measure, timer, costs: Costs, clock=time.monotonic) -> dict | None:
  """{"bytes", "seconds", "depths", "peaks", "times"}: cfg's peak and step time extended to its depth from its two
  shallow programs, each compiled by `measure` and timed by `timer`; {"oom", "depths", "at"} where XLA ran out of
  memory compiling or running one; None where probes do not apply (probe.depths)."""
  ds = probe.depths(cfg, stages)
  if ds is None:
    return None
  peaks, times = [], []
  for n in ds:
    c = probe.shallow(cfg, n)
    m = spend(costs, "probe_compile", measure, c, clock=clock)
    if "oom" in m:
      return {"oom": m["oom"], "depths": ds, "at": n}
    s = spend(costs, "probe_timing", timer, c, clock=clock)
    if s is None:
      return {"oom": "ran out of device memory running the step", "depths": ds, "at": n}
    peaks.append(m["device"])
    times.append(s)
  (a, b), n = ds, cfg.model.n_layers
  return {"bytes": probe.extend((a, peaks[0]), (b, peaks[1]), n),
          "seconds": times[1] + (times[1] - times[0]) * (n - b) / (b - a), "depths": ds, "peaks": tuple(peaks),
          "times": tuple(times)}


def order(rows: list[Row], usable: int) -> list[Row]:
  """The order in which candidates with estimates are compiled whole (the module doc): those whose line is under
  the usable memory first; in each group, those within TIE of the group's fastest estimate in the given (roofline)
  order, then the rest by their estimate."""
  def ranked(group: list[Row]) -> list[Row]:
    if not group:
      return []
    best = min(r.estimate["seconds"] for r in group)
    near = [r for r in group if r.estimate["seconds"] <= best * (1 + TIE)]
    return near + sorted((r for r in group if all(r is not x for x in near)), key=lambda r: r.estimate["seconds"])
  return (ranked([r for r in rows if r.estimate["bytes"] <= usable])
          + ranked([r for r in rows if r.estimate["bytes"] > usable]))


def _confirm(cfg: Config, target: Target, ranked: list[Row], measure, known: dict, costs: Costs, report,
             clock) -> Row | None:
  """The first of `ranked` that XLA measures to fit, compiled whole (or taken from `known`)."""
  for r in ranked:
    c = apply(cfg, r.overrides)
    began = clock()
    m = known.get(tuple(r.overrides.items()))
    if m is None:
      m = spend(costs, "full_compile", measure, c, clock=clock)
    _fits(cfg, target, r, certain_bytes(c, target), m, None)
    report(f"plan: compiled {label(r.overrides)} whole: " + (r.note if r.measured is None else
           f"peak {human_bytes(r.measured)} of {human_bytes(target.usable)}, {r.status}") + f" ({clock() - began:.0f} s)")
    if r.status == "fits":
      return r
  return None


def _estimated(est: dict, n_layers: int) -> str:
  (a, b), (pa, pb), (sa, sb) = est["depths"], est["peaks"], est["times"]
  return (f"{a} and {b} layers compiled and timed ({human_bytes(pa)}, {human_bytes(pb)}; {sa:.3g} s, {sb:.3g} s): "
          f"about {human_bytes(est['bytes'])} and {est['seconds']:.3g} s a step at {n_layers}")


def search(cfg: Config, target: Target, measure, backend: str, timer, known: dict | None = None,
           probed: dict | None = None, costs: Costs | None = None, report=None, clock=time.monotonic) -> Plan:
  """The module doc's search; `known`: whole measurements made already, `probed`: estimates made already (the
  config as written, plan.mode=fit), each by lever values; `costs`: where the seconds of each part add up."""
  report, known, probed, costs = report or (lambda line: None), known or {}, probed or {}, costs or Costs()
  stages, want, budget_s = degrees(cfg, target)["pipeline"], max(1, cfg.plan.timed), cfg.plan.budget_s
  rows, estimated, shares, start, stopped = [], [], {}, clock(), None
  for o in candidates(cfg, target, backend):
    c = apply(cfg, o)
    need = certain_bytes(c, target)
    row = Row(o, "not tried", need["certain"], time=step_time(c, target))
    rows.append(row)
    if len(estimated) >= want:
      continue
    if estimated and budget_s > 0 and clock() - start > budget_s:
      stopped = stopped or clock() - start
      continue
    short = host_short(c, target)
    if short is not None:
      row.status, row.note = "too big", short
      continue
    remat, share = o["model.remat"], shares.get(o["model.remat"], START_SHARE)
    plausible = need["certain"] + int(share * need["activations"])
    if plausible > target.usable and tuple(o.items()) not in known:
      row.status, row.plausible = "pruned", plausible
      row.note = (f"certain {human_bytes(need['certain'])}" if need["certain"] > target.usable else
                  f"certain + {share:.2f} x activations = {human_bytes(plausible)}")
      continue
    began = clock()
    est = probed.get(tuple(o.items())) or estimate(c, stages, measure, timer, costs, clock)
    if "oom" in est or probe.too_big(est["bytes"], target.usable):
      _probed(row, est, c.model.n_layers)
      report(f"plan: probed {label(o)}: {row.note}, pruned ({clock() - began:.0f} s)")
      continue
    shares[remat] = _share(need, est["bytes"], shares.get(remat))
    row.estimate, row.status, row.note = est, "estimated", _estimated(est, c.model.n_layers)
    estimated.append(row)
    report(f"plan: probed {label(o)}: {row.note} ({clock() - began:.0f} s)")
    if len(estimated) == 1 and costs.probe_compiles:
      expect = start_up_seconds(want, costs.probe_compile_s / costs.probe_compiles,
                                costs.probe_timing_s / max(1, costs.probe_timings), target.clock.expect(c) or 0.0)
      report(f"plan: expected about {expect['total_s']:.0f} s of planning ({want} candidates probed, "
             f"{expect['probes_s']:.0f} s, then the winner compiled whole, {expect['full_compile_s']:.0f} s)")
  chosen = _confirm(cfg, target, order(estimated, target.usable), measure, known, costs, report, clock)
  return Plan(target, rows, chosen, apply(cfg, chosen.overrides) if chosen else cfg,
              moments.note(cfg, chosen.overrides, parse_levers(cfg.plan.levers)) if chosen else "",
              stopped=stopped, written=current(cfg), costs=costs.as_dict())
