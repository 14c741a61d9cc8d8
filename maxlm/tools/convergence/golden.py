"""Golden files (one JSON per case: per-step values of every recorded seed and the band) and the
comparison of a run with them.

configs/convergence/golden/<suite>/<case>.json::

  {"suite", "case", "definition": {config, overrides, metrics}, "band": {k, floor_abs, floor_rel},
   "seeds": [0, 1, 2], "recorded": {commit, date, environment},
   "checks": {metric: {step: {"values": [per seed], "mean", "std", "lo", "hi"}}},
   "curves": {metric: {"steps": [...], "values": [[per seed] per step], "mean": [...], "lo": [...], "hi": [...]}}}

`checks` are what a run is judged on; `curves` (every logged step, same band arithmetic) are drawn.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from maxlm.data import resolve_type
from maxlm.tools.convergence.bands import band, verdict
from maxlm.tools.convergence.suite import Case, Suite, SuiteError


def build_golden(suite: Suite, case: Case, runs: list, recorded: dict[str, Any],
                 resolved: dict[str, str] | None = None) -> dict[str, Any]:
  """The golden of `case` from its runs at every seed (CaseRun-like: .seed, .curves, .ok); `resolved` is
  the flat resolved config (for the report's note when today's defaults differ)."""
  for r in runs:
    if not r.ok:
      raise SuiteError(f"case {case.name} seed {r.seed} failed ({r.error}); no golden recorded")
  checks: dict[str, dict[str, Any]] = {}
  for metric, steps in case.metrics.items():
    checks[metric] = {}
    for s in steps:
      vals = [r.curves[metric].get(s) for r in runs]
      if any(v is None for v in vals):
        raise SuiteError(f"case {case.name}: {metric} was not logged at step {s} by every seed (check "
                         f"train.log_every / train.eval_every against the steps in the suite)")
      try:
        b = band(vals, case.band)
      except ValueError as e:
        raise SuiteError(f"case {case.name}: {metric} at step {s}: {e}") from None
      checks[metric][str(s)] = {"values": vals, **dataclasses.asdict(b)}
  curves: dict[str, dict[str, list]] = {}
  for metric in case.metrics:
    common = sorted(set.intersection(*(set(r.curves[metric]) for r in runs)))
    rows = [[r.curves[metric][s] for r in runs] for s in common]
    finite = [(s, v) for s, v in zip(common, rows) if all(math.isfinite(x) for x in v)]
    bands = [band(v, case.band) for _, v in finite]
    curves[metric] = {"steps": [s for s, _ in finite], "values": [v for _, v in finite],
                      "mean": [b.mean for b in bands], "lo": [b.lo for b in bands], "hi": [b.hi for b in bands]}
  return {"suite": suite.name, "case": case.name, "definition": case.definition(),
          "band": dataclasses.asdict(case.band), "seeds": [r.seed for r in runs], "recorded": recorded,
          "resolved": resolved or {}, "checks": checks, "curves": curves}


def dump(golden: dict[str, Any]) -> str:
  return json.dumps(golden, indent=1, sort_keys=False) + "\n"


def load_golden(suite: Suite, case: Case) -> dict[str, Any]:
  """The case's golden, checked against the case's definition; an empty one (no checks) for golden: false."""
  if not case.golden:
    return {"checks": {}, "curves": {}}
  path = suite.golden_path(case)
  if not path.is_file():
    raise SuiteError(f"no golden for case {case.name} ({path}); record it with `maxlm convergence update-golden "
                     f"suite={suite.name} seeds={suite.seeds}` and review the diff")
  try:
    g = json.loads(path.read_text())
    checks = g["checks"]
    definition = g["definition"]
    seeds = g["seeds"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SuiteError(f"golden file '{path}' is unreadable: {e}") from None
  if definition != case.definition():
    raise SuiteError(f"golden file '{path}' was recorded for another definition of case {case.name} (config, "
                     f"overrides or checked steps changed); re-record it with update-golden")
  if suite.run_seed not in seeds:
    raise SuiteError(f"golden file '{path}' has no run at seed {suite.run_seed} (seeds {seeds})")
  for metric, steps in case.metrics.items():
    for s in steps:
      if str(s) not in checks.get(metric, {}):
        raise SuiteError(f"golden file '{path}' has no {metric} at step {s}")
  return g


@dataclasses.dataclass
class Check:
  case: str
  metric: str
  step: int
  value: float | None
  lo: float
  hi: float
  mean: float
  verdict: str  # pass / above / below / missing / nonfinite / skipped
  note: str = ""

  @property
  def failed(self) -> bool:
    return self.verdict not in ("pass", "skipped")


def compare(case: Case, golden: dict[str, Any], run) -> list[Check]:
  """Every checked (metric, step) of `run` against the golden band; steps past the run's train.steps
  (a deliberately shortened run) are skipped, anything else not logged is a failure."""
  out = []
  if not case.golden:
    return out
  for metric, steps in case.metrics.items():
    for s in steps:
      g = golden["checks"][metric][str(s)]
      if s > run.steps:
        out.append(Check(case.name, metric, s, None, g["lo"], g["hi"], g["mean"], "skipped",
                         f"the run ends at step {run.steps}"))
        continue
      v = run.curves[metric].get(s)
      note = "" if run.ok else f"run failed (exit {run.returncode}): {run.error}"
      out.append(Check(case.name, metric, s, v, g["lo"], g["hi"], g["mean"], verdict(v, g["lo"], g["hi"]), note))
  return out


def summary_lines(golden: dict[str, Any] | None) -> list[str]:
  """A golden's checks as text lines, for `update-golden`'s diff."""
  if golden is None:
    return []
  lines = []
  for metric, steps in golden["checks"].items():
    for s, g in steps.items():
      half = (g["hi"] - g["lo"]) / 2
      lines.append(f"{golden['case']} {metric} step {s}: {g['mean']:.4f} +- {half:.4f} (std {g['std']:.4f}, "
                   f"seeds {', '.join(f'{v:.4f}' for v in g['values'])})")
  return lines


def read_existing(path: Path) -> dict[str, Any] | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def flat_config(cfg) -> dict[str, str]:
  """A Config as the trainer records it (data.type=auto made concrete) as {dotted key: value text}, without
  what differs between seeds and output places."""
  cfg = dataclasses.replace(cfg, data=resolve_type(cfg.data))
  out = {}

  def walk(prefix: str, obj) -> None:
    for f in dataclasses.fields(obj):
      v = getattr(obj, f.name)
      if dataclasses.is_dataclass(v):
        walk(f"{prefix}{f.name}.", v)
      else:
        out[prefix + f.name] = str(v)

  walk("", cfg)
  for k in ("output_dir", "run_name", "train.seed", "data.seed"):
    out.pop(k, None)
  return out


# Recorded values that a later default replaced without changing what a case trains, by key: plan.levers was `all`
# by default until issue 55 made it `auto` (the levers a case does not write). Every golden recorded before says
# `all`; on CPU nothing is planned, and on the H200 every case of the gpu suite fits as written (plan.mode=fit keeps
# it), so the same run trains either way. A recording made since has the new value and is compared as any other.
OLD_DEFAULTS = {"plan.levers": "all"}


def config_changes(golden: dict[str, Any], now: dict[str, str]) -> list[str]:
  """'key: golden -> now' for every resolved key that differs from the golden's recording (an old default of
  OLD_DEFAULTS aside)."""
  then = golden.get("resolved") or {}  # keys added since the recording are left out: they were not there
  return [f"{k}: {then[k]} -> {now.get(k, '(removed)')}" for k in sorted(then)
          if then[k] != now.get(k) and OLD_DEFAULTS.get(k) != then[k]]
