"""`maxlm convergence run | redraw | update-golden | baseline`: arguments, setup checks, exit codes."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from maxlm.cli.grammar import UsageError, command_main, parse_args
from maxlm.config import ConfigError, load_config
from maxlm.config.files import CONFIG_DIR
from maxlm.tools import convergence
from maxlm.tools.convergence import golden as goldens
from maxlm.tools.convergence import report
from maxlm.tools.convergence.bands import verdict, within_relative
from maxlm.tools.convergence.golden import Check
from maxlm.tools.convergence.runner import run_all
from maxlm.tools.convergence.suite import Case, Suite, SuiteError, load_suite
from maxlm.data import DataError

EXIT_FAIL = 1  # a check failed; bad input (a UsageError or SuiteError) exits 2
ROOT = CONFIG_DIR.parent.parent  # the checkout (for the commit a report records)


# subcommand -> (its key=value arguments, its --flags, whether it takes config overrides, its required keys)
SUBCOMMANDS = {
  "run": ({"suite": str, "out": str, "cases": str, "jobs": int, "steps": int}, {"--no-plot"}, True, ("suite",)),
  "redraw": ({"out": str}, set(), False, ("out",)),
  "update-golden": ({"suite": str, "seeds": int, "cases": str, "jobs": int, "out": str}, set(), False, ("suite",)),
  "baseline": ({"config": str}, set(), True, ()),
}
_OLD = ("suite", "out", "cases", "jobs", "steps", "seeds")  # `--suite cpu`: the spelling before the one grammar


def _arguments(argv: list[str]) -> tuple[str, SimpleNamespace]:
  """(subcommand, its arguments with their defaults), or a UsageError naming the culprit."""
  if not argv or argv[0] not in SUBCOMMANDS:
    got = f"unknown subcommand {argv[0]!r}" if argv else "no subcommand given"
    raise UsageError(f"convergence: {got} (subcommands: {', '.join(SUBCOMMANDS)}; see maxlm convergence --help)")
  sub, rest = argv[0], argv[1:]
  keys, known_flags, takes_overrides, required = SUBCOMMANDS[sub]
  for word in rest:
    old = word.split("=", 1)[0]
    if old.startswith("--") and old[2:] in _OLD:
      raise UsageError(f"convergence {sub}: {old} is now {old[2:]}=VALUE (e.g. maxlm convergence run suite=cpu "
                       f"jobs=2; see maxlm convergence --help)")
  own, overrides, flags = parse_args(rest, keys)
  if overrides and not takes_overrides:
    raise UsageError(f"convergence {sub}: {overrides[0].split('=', 1)[0]} is a config key; {sub} takes none")
  if flags - known_flags:
    raise UsageError(f"convergence {sub}: unknown option {sorted(flags - known_flags)[0]} "
                     f"(options: {', '.join(sorted(known_flags | {'--help'}))})")
  missing = [k for k in required if not own.get(k)]
  if missing:
    raise UsageError(f"convergence {sub}: {missing[0]}=... is required (see maxlm convergence --help)")
  for key in ("jobs", "steps"):
    if own.get(key, 1) < 1:
      raise UsageError(f"convergence {sub}: {key}= must be at least 1, got {own[key]}")
  if "config" in own:  # baseline: config=FILE first, as for train
    overrides = [f"config={own['config']}", *overrides]
  return sub, SimpleNamespace(suite=own.get("suite"), out=Path(own["out"]) if own.get("out") else None,
                              cases=own.get("cases", ""), jobs=own.get("jobs", 1), steps=own.get("steps"),
                              seeds=own.get("seeds"), no_plot="--no-plot" in flags, overrides=overrides)


def echo(line: str) -> None:
  print(line, flush=True)


def _need_matplotlib() -> None:
  if importlib.util.find_spec("matplotlib") is None:
    raise SuiteError("matplotlib is not installed; the report's loss_curves.png needs it "
                     "(pip install 'maxlm[viz]', or `make setup`)")


def _case_config(case: Case, seed: int, extra: tuple[str, ...], out: Path):
  try:
    return load_config(case.args(seed, extra) + [f"output_dir={out}", f"run_name={case.name}-seed{seed}"])
  except ConfigError as e:
    raise SuiteError(f"case {case.name}: {e}") from None


def _margin_check(case: Case, cfg, run) -> Check:
  """Final eval_loss at least `case.margin` nats below the tuned bigram baseline of the same split."""
  from maxlm.tools.convergence.baseline import data_baselines  # noqa: PLC0415 (lazy: reads and tokenizes the corpus)
  try:
    base = data_baselines(cfg.data, cfg.model.vocab_size)
  except DataError as e:
    raise SuiteError(f"case {case.name}: bigram baseline: {e}") from None
  step = max(case.metrics["eval_loss"])
  value = run.curves["eval_loss"].get(step) if step <= run.steps else None
  hi = base.bigram - case.margin
  if step > run.steps:
    return Check(case.name, f"eval_loss - bigram <= -{case.margin}", step, None, float("-inf"), hi, hi, "skipped",
                 f"the run ends at step {run.steps}")
  return Check(case.name, f"eval_loss - bigram <= -{case.margin}", step, value, float("-inf"), hi, hi,
               verdict(value, float("-inf"), hi), base.describe())


def _rule_checks(suite: Suite, runs: dict) -> list[Check]:
  out = []
  for rule in suite.rules:
    a, ref = runs[rule.case], runs[rule.reference]
    if rule.step > min(a.steps, ref.steps):
      continue
    va, vr = a.curves[rule.metric].get(rule.step), ref.curves[rule.metric].get(rule.step)
    ok = va is not None and vr is not None and within_relative(va, vr, rule.max_rel)
    lo, hi = (vr * (1 - rule.max_rel), vr * (1 + rule.max_rel)) if vr is not None else (float("nan"),) * 2
    v = "pass" if ok else ("missing" if va is None or vr is None else "above" if va > hi else "below")
    out.append(Check(rule.case, f"{rule.metric} within {100 * rule.max_rel:g}% of {rule.reference}", rule.step,
                     va, lo, hi, vr if vr is not None else float("nan"), v))
  return out


def cmd_run(args) -> int:
  if not args.no_plot:
    _need_matplotlib()
  suite = load_suite(args.suite).select([c for c in args.cases.split(",") if c])
  out = (args.out or Path("runs") / "convergence" / suite.name).resolve()
  extra = tuple(args.overrides)
  seed = suite.run_seed
  plan = []
  for case in suite.cases:  # every setup error before anything is run or written
    g = goldens.load_golden(suite, case)
    cfg = _case_config(case, seed, extra, out / "runs")
    words = extra
    if args.steps is not None and args.steps < cfg.train.steps:  # shortened: same schedule, fewer steps
      words = extra + (f"train.steps={args.steps}", f"optim.decay_steps={cfg.optim.decay_steps or cfg.train.steps}")
      cfg = _case_config(case, seed, words, out / "runs")
    plan.append((case, g, cfg, words))
  notes = {}
  for case, g, _, _ in plan:  # the suite as written (no user overrides) against the golden's recording
    changes = goldens.config_changes(g, goldens.flat_config(_case_config(case, seed, (), out / "runs")))
    if changes:
      notes[case.name] = changes
      echo(f"maxlm convergence: note: case {case.name} resolves differently from its golden: {'; '.join(changes)}")
  out.mkdir(parents=True, exist_ok=True)
  for stale in ("report.md", "results.json", "junit.xml", "loss_curves.png"):
    (out / stale).unlink(missing_ok=True)
  t0 = time.perf_counter()
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  echo(f"maxlm convergence: suite {suite.name}, {len(plan)} case(s) at seed {seed}"
       + (f", overrides {' '.join(extra)}" if extra else "") + f"; report in {out}")
  tasks = [(case, seed, cfg.train.steps, words) for case, _, cfg, words in plan]
  runs = run_all(tasks, out / "runs", suite.smooth_window, args.jobs, echo)
  by_case = {r.case: r for r in runs}
  checks: list[Check] = []
  for case, g, cfg, _ in plan:
    checks += goldens.compare(case, g, by_case[case.name])
    if case.margin is not None:
      checks.append(_margin_check(case, cfg, by_case[case.name]))
  checks += _rule_checks(suite, by_case)
  for r in runs:  # a run that crashed fails its case even where nothing was compared
    if not r.ok and not any(c.case == r.case and c.failed for c in checks):
      checks.append(Check(r.case, "run", r.steps, None, 0, 0, 0, "missing", f"exit {r.returncode}: {r.error}"))
  failed = report.failing_cases(checks)
  meta = {"commit": report.commit(ROOT), "date": date, "overrides": list(extra), "config_changes": notes,
          "environment": report.environment(report.device_from_log(out / "runs" / f"{runs[0].case}-seed{seed}.log"))}
  run_rows = [{"case": r.case, "seed": r.seed, "returncode": r.returncode, "seconds": r.seconds,
               "run_dir": str(r.run_dir), "error": r.error} for r in runs]
  panels = []
  for case, g, _, _ in plan:
    run = by_case[case.name]
    mine = [c for c in checks if c.case == case.name]
    panels.append({"case": case.name, "golden": g["curves"], "failed": case.name in failed,
                   "run": {m: run.curves[m] for m in (g["curves"] or case.metrics)},
                   "failures": [(c.metric, c.step, c.value) for c in mine if c.failed],
                   "limits": [(c.hi, f"bigram - {case.margin:g}") for c in mine if c.metric.startswith("eval_loss -")]})
  title = f"convergence suite {suite.name} @ {meta['commit'][:12]}"
  if not args.no_plot:
    _draw(out, panels, title)
  report.write_report(out, suite.name, checks, run_rows, meta, "loss_curves.png")
  report.write_junit(out, suite.name, checks, {r.case: r.seconds for r in runs})
  report.write_results(out, {"suite": suite.name, **meta, "seconds": time.perf_counter() - t0,
                             "passed": not failed, "failed_cases": failed, "runs": run_rows,
                             "checks": [dataclasses.asdict(c) for c in checks], "plot": {"title": title,
                                                                                         "panels": panels}})
  for c in checks:
    if c.failed:
      echo(f"maxlm convergence: FAIL {c.case}: {c.metric} at step {c.step} = {report.num(c.value)}, "
           f"band {report.band_text(c)}" + (f" ({c.note})" if c.note else ""))
  if failed:
    echo(f"maxlm convergence: suite {suite.name} FAILED: {', '.join(failed)} (report {out / 'report.md'})")
    return EXIT_FAIL
  echo(f"maxlm convergence: suite {suite.name} passed: {len(checks)} checks in {len(plan)} case(s) "
       f"(report {out / 'report.md'})")
  return 0


def _draw(out: Path, panels: list, title: str) -> None:
  from maxlm.tools.convergence import plot  # noqa: PLC0415 (lazy: imports matplotlib)
  plot.draw(out / "loss_curves.png", panels, title)


def cmd_redraw(args) -> int:
  _need_matplotlib()
  try:
    saved = json.loads((args.out / "results.json").read_text())["plot"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SuiteError(f"no usable results.json in {args.out}: {e}") from None
  for p in saved["panels"]:  # JSON made the step keys strings
    p["run"] = {m: {int(k): v for k, v in curve.items()} for m, curve in p["run"].items()}
  _draw(args.out, saved["panels"], saved["title"])
  echo(f"maxlm convergence: wrote {args.out / 'loss_curves.png'}")
  return 0


def cmd_update_golden(args) -> int:
  suite = load_suite(args.suite).select([c for c in args.cases.split(",") if c])
  n = suite.seeds if args.seeds is None else args.seeds
  if n < 2:
    raise SuiteError(f"seeds={n}: must be at least 2 (a band needs a spread)")
  if suite.run_seed >= n:
    raise SuiteError(f"seeds={n} does not include the suite's run_seed {suite.run_seed}")
  tmp = None
  if args.out is None:
    tmp = tempfile.TemporaryDirectory(prefix=f"maxlm-golden-{suite.name}-")
  out = (args.out or Path(tmp.name)).resolve()
  tasks, resolved = [], {}
  skipped = [c.name for c in suite.cases if not c.golden]
  suite = dataclasses.replace(suite, cases=tuple(c for c in suite.cases if c.golden))
  if skipped:
    echo(f"maxlm convergence: no golden for {', '.join(skipped)} (golden: false; only its margin is checked)")
  if not suite.cases:
    raise SuiteError("none of the selected cases has a golden to record")
  for case in suite.cases:
    for seed in range(n):
      cfg = _case_config(case, seed, (), out)
      tasks.append((case, seed, cfg.train.steps, ()))
      resolved[case.name] = goldens.flat_config(cfg)
  recorded = {"commit": report.commit(ROOT),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  echo(f"maxlm convergence: recording {len(suite.cases)} golden(s) of suite {suite.name} from seeds 0..{n - 1}")
  try:
    runs = run_all(tasks, out, suite.smooth_window, args.jobs, echo)
    device = report.device_from_log(out / f"{runs[0].case}-seed0.log")
    changed = 0
    for case in suite.cases:
      new = goldens.build_golden(suite, case, [r for r in runs if r.case == case.name],
                                 {**recorded, "environment": report.environment(device)}, resolved[case.name])
      path = suite.golden_path(case)
      old = goldens.read_existing(path)
      diff = list(difflib.unified_diff(goldens.summary_lines(old), goldens.summary_lines(new),
                                       f"{path} (old)", f"{path} (new)", lineterm=""))
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(goldens.dump(new))
      changed += bool(diff)
      echo("\n".join(diff) if diff else f"{path}: checks unchanged")
  finally:
    if tmp is not None:
      tmp.cleanup()
  echo(f"maxlm convergence: wrote {len(suite.cases)} golden(s), {changed} with changed checks; review with git diff")
  return 0


def cmd_baseline(args) -> int:
  from maxlm.tools.convergence.baseline import data_baselines  # noqa: PLC0415 (lazy: imports the data pipeline)
  try:
    cfg = load_config(args.overrides)
  except ConfigError as e:
    raise SuiteError(str(e)) from None
  try:
    echo(data_baselines(cfg.data, cfg.model.vocab_size).describe())
  except DataError as e:
    raise SuiteError(str(e)) from None
  return 0


def run(argv: list[str]) -> int:
  sub, args = _arguments(argv)
  commands = {"run": cmd_run, "update-golden": cmd_update_golden, "baseline": cmd_baseline, "redraw": cmd_redraw}
  return commands[sub](args)


def main(argv: list[str] | None = None) -> int:
  return command_main(convergence.__doc__, run, argv)  # the package's docstring is the help
