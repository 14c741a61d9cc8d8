"""Convergence suites: `configs/convergence/<name>.yml` read and checked into `Suite` / `Case`.

A suite file::

  seeds: 3                        # seeds `update-golden` records by default (0..seeds-1)
  run_seed: 0                     # the seed a nightly `run` uses (must be one of the recorded ones)
  band: {k: 4, floor_abs: 0.03, floor_rel: 0}   # see bands.py; a case may override any of them
  smooth_window: 50               # steps averaged by the `loss_smooth` metric
  overrides: {train.log_every: 5} # applied to every case, before the case's own
  cases:
    - name: tiny_te
      config: tiny.yml              # omitted: the defaults (what `python -m maxlm.train` runs)
      overrides: {model.backend: te, train.steps: 200}
      metrics: {loss_smooth: [100, 200], eval_loss: [200]}
      margin: {below_bigram: 0.3}   # optional: final eval_loss at least 0.3 nats under the bigram baseline
      golden: false                 # optional: no golden band for this case, only its margin
  rules:                          # optional: cases compared with each other at the run seed
    - {case: fp8_delayed, reference: bf16, metric: loss_smooth, step: 300, max_rel: 0.01}

Anything else, or a wrong type, is a `SuiteError` (a one-line setup error, exit 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from maxlm.config.files import CONFIG_DIR
from maxlm.tools.convergence.bands import BandSpec
from maxlm.errors import BadInput

SUITE_DIR = CONFIG_DIR / "convergence"
METRICS = ("loss_smooth", "loss", "eval_loss", "grad_norm")
PATH_KEYS = ("data.paths", "data.eval_paths")


class SuiteError(BadInput, ValueError):
  """A suite or golden file that cannot be used (setup error: exit 2)."""


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  config: str
  overrides: tuple[str, ...]  # suite-wide then the case's own, as key=value words
  metrics: dict[str, tuple[int, ...]]  # metric -> steps checked
  band: BandSpec
  margin: float | None = None  # final eval_loss must be this far below the bigram baseline
  golden: bool = True  # false: no golden band, only the margin is checked (a run too long to record 3 times)
  here: Path = Path(".")  # the suite file's directory: data paths in overrides are relative to it

  def definition(self) -> dict[str, Any]:
    """What a golden was recorded for; a golden of another definition is stale."""
    return {"config": self.config, "overrides": list(self.overrides),
            "metrics": {m: list(s) for m, s in self.metrics.items()}}

  def args(self, seed: int, extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m maxlm.train` words for this case at `seed` (user overrides last but seeds after them)."""
    base = [f"config={self.config}"] if self.config else []
    return [*base, *(self._local(w) for w in self.overrides), *extra, f"train.seed={seed}", f"data.seed={seed}"]

  def _local(self, word: str) -> str:
    """data.paths=data/corpus.txt -> the absolute path when it exists next to the suite file."""
    key, _, value = word.partition("=")
    if key in PATH_KEYS and value and not Path(value).is_absolute() and (self.here / value).exists():
      return f"{key}={(self.here / value).resolve()}"
    return word


@dataclasses.dataclass(frozen=True)
class Rule:
  case: str
  reference: str
  metric: str
  step: int
  max_rel: float


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  path: Path
  seeds: int
  run_seed: int
  smooth_window: int
  cases: tuple[Case, ...]
  rules: tuple[Rule, ...]

  def golden_path(self, case: Case) -> Path:
    """<the suite file's directory>/golden/<suite>/<case>.json (configs/convergence/golden/... for the shipped ones)."""
    return self.path.parent / "golden" / self.name / f"{case.name}.json"

  def select(self, names: list[str] | None) -> "Suite":
    if not names:
      return self
    known = {c.name for c in self.cases}
    for n in names:
      if n not in known:
        raise SuiteError(f"suite '{self.name}' has no case {n!r} (cases: {', '.join(sorted(known))})")
    return dataclasses.replace(self, cases=tuple(c for c in self.cases if c.name in names),
                               rules=tuple(r for r in self.rules if r.case in names and r.reference in names))


def resolve_suite_path(name: str) -> Path:
  for cand in (Path(name), SUITE_DIR / name, SUITE_DIR / f"{name}.yml"):
    if cand.is_file():
      return cand
  known = sorted(p.stem for p in SUITE_DIR.glob("*.yml"))
  raise SuiteError(f"suite {name!r} not found (looked for a file and in {SUITE_DIR}; suites: {', '.join(known)})")


def _need(cond: bool, where: str, msg: str) -> None:
  if not cond:
    raise SuiteError(f"{where}: {msg}")


def _words(where: str, overrides: Any) -> tuple[str, ...]:
  if overrides is None:
    return ()
  _need(isinstance(overrides, dict), where, "'overrides' must be a mapping of config keys to values")
  words = []
  for k, v in overrides.items():
    value = "true" if v is True else "false" if v is False else v
    words.append(f"{k}={value}")
  return tuple(words)


def _band(where: str, raw: Any, base: BandSpec) -> BandSpec:
  if raw is None:
    return base
  _need(isinstance(raw, dict) and set(raw) <= {"k", "floor_abs", "floor_rel"}, where,
        "'band' takes k, floor_abs, floor_rel")
  vals = {}
  for key, v in raw.items():
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, where,
          f"band.{key} must be a number >= 0, got {v!r}")
    vals[key] = float(v)
  return dataclasses.replace(base, **vals)


def _int(where: str, key: str, v: Any, lo: int = 0) -> int:
  _need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, where, f"'{key}' must be an integer >= {lo}, "
        f"got {v!r}")
  return v


def _case(where: str, raw: Any, common: tuple[str, ...], band: BandSpec, here: Path) -> Case:
  _need(isinstance(raw, dict), where, "each case must be a mapping")
  allowed = {"name", "config", "overrides", "metrics", "band", "margin", "golden"}
  _need(set(raw) <= allowed, where, f"unknown case keys {sorted(set(raw) - allowed)} (allowed: {sorted(allowed)})")
  name = raw.get("name")
  _need(isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum(), where,
        f"case 'name' must be a plain word, got {name!r}")
  where = f"{where} ({name})"
  config = raw.get("config", "")
  _need(isinstance(config, str), where, "case 'config' must be a config file name (omit it for the defaults)")
  metrics = raw.get("metrics")
  _need(isinstance(metrics, dict) and bool(metrics), where, f"case needs 'metrics' (some of {', '.join(METRICS)})")
  checked = {}
  for m, steps in metrics.items():
    _need(m in METRICS, where, f"unknown metric {m!r} (one of {', '.join(METRICS)})")
    _need(isinstance(steps, list) and bool(steps), where, f"metrics.{m} must be a list of steps")
    checked[m] = tuple(sorted({_int(where, f"metrics.{m}", s, 1) for s in steps}))
  margin = raw.get("margin")
  if margin is not None:
    _need(isinstance(margin, dict) and set(margin) == {"below_bigram"}, where, "'margin' takes below_bigram")
    margin = margin["below_bigram"]
    _need(isinstance(margin, (int, float)) and not isinstance(margin, bool), where, "margin.below_bigram must be a number")
    _need("eval_loss" in checked, where, "a margin needs eval_loss among the metrics")
  has_golden = raw.get("golden", True)
  _need(isinstance(has_golden, bool), where, "'golden' must be true or false")
  _need(has_golden or margin is not None, where, "a case without a golden needs a margin (else nothing is checked)")
  return Case(name, config, common + _words(where, raw.get("overrides")), checked,
              _band(where, raw.get("band"), band), None if margin is None else float(margin), has_golden, here)


def load_suite(name: str) -> Suite:
  path = resolve_suite_path(name)
  try:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
    raise SuiteError(f"suite file '{path}' cannot be read: {str(e).splitlines()[0]}") from None
  where = f"suite file '{path}'"
  _need(isinstance(raw, dict), where, "must be a mapping")
  allowed = {"description", "seeds", "run_seed", "band", "smooth_window", "overrides", "cases", "rules"}
  _need(set(raw) <= allowed, where, f"unknown keys {sorted(set(raw) - allowed)} (allowed: {sorted(allowed)})")
  seeds = _int(where, "seeds", raw.get("seeds", 3), 1)
  run_seed = _int(where, "run_seed", raw.get("run_seed", 0))
  _need(run_seed < seeds, where, f"run_seed ({run_seed}) must be one of the recorded seeds 0..{seeds - 1}")
  band = _band(where, raw.get("band"), BandSpec())
  common = _words(where, raw.get("overrides"))
  cases_raw = raw.get("cases")
  _need(isinstance(cases_raw, list) and bool(cases_raw), where, "needs a non-empty list 'cases'")
  cases = tuple(_case(f"{where} case {i + 1}", c, common, band, path.parent) for i, c in enumerate(cases_raw))
  names = [c.name for c in cases]
  _need(len(set(names)) == len(names), where, f"case names repeat: {names}")
  rules = []
  for i, r in enumerate(raw.get("rules") or []):
    w = f"{where} rule {i + 1}"
    _need(isinstance(r, dict) and set(r) == {"case", "reference", "metric", "step", "max_rel"}, w,
          "a rule has exactly case, reference, metric, step, max_rel")
    _need(r["case"] in names and r["reference"] in names, w, "case and reference must name cases of the suite")
    case = cases[names.index(r["case"])]
    ref = cases[names.index(r["reference"])]
    for c in (case, ref):
      _need(r["step"] in c.metrics.get(r["metric"], ()), w, f"case {c.name} does not check {r['metric']} at step "
            f"{r['step']}")
    _need(isinstance(r["max_rel"], (int, float)) and r["max_rel"] > 0, w, "max_rel must be a number > 0")
    rules.append(Rule(r["case"], r["reference"], r["metric"], int(r["step"]), float(r["max_rel"])))
  window = _int(where, "smooth_window", raw.get("smooth_window", 1), 1)
  return Suite(path.stem, path, seeds, run_seed, window, cases, tuple(rules))
