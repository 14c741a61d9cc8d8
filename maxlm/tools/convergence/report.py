"""What a suite run writes: report.md, results.json, junit.xml (and plot.py's loss_curves.png)."""

from __future__ import annotations

import json
import math
import platform
import socket
import subprocess
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

from maxlm.tools.convergence.golden import Check

PACKAGES = ("jax", "jaxlib", "flax", "optax", "transformer-engine", "transformer-engine-jax", "grain",
            "orbax-checkpoint")
VERDICT_TEXT = {"pass": "pass", "above": "FAIL (above band)", "below": "FAIL (below band)",
                "missing": "FAIL (not logged)", "nonfinite": "FAIL (non-finite)", "skipped": "skipped"}


def commit(root: Path) -> str:
  """`<sha>` of HEAD, `+dirty` when tracked files differ; 'unknown' outside a git checkout."""
  try:
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return sha + ("+dirty" if dirty else "")


def environment(device: str = "") -> dict[str, Any]:
  versions = {}
  for p in PACKAGES:
    try:
      versions[p] = metadata.version(p)
    except metadata.PackageNotFoundError:
      pass
  return {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
          "device": device, "packages": versions}


def device_from_log(log: Path) -> str:
  """'1 x cpu' from the trainer's run line (`maxlm: NAME (...) on 1 x cpu, mesh ...`)."""
  try:
    for line in log.read_text(errors="replace").splitlines():
      if line.startswith("maxlm: ") and " on " in line and ", mesh " in line:
        return line.split(" on ", 1)[1].split(", mesh ", 1)[0]
  except OSError:
    pass
  return ""


def num(v: float | None) -> str:
  if v is None:
    return "-"
  if not math.isfinite(v):
    return str(v)
  return f"{v:.4f}"


def band_text(c: Check) -> str:
  if math.isinf(c.lo) and c.lo < 0:
    return f"<= {num(c.hi)}"
  return f"[{num(c.lo)}, {num(c.hi)}]"


def failing_cases(checks: list[Check]) -> list[str]:
  seen = []
  for c in checks:
    if c.failed and c.case not in seen:
      seen.append(c.case)
  return seen


def write_results(out: Path, results: dict[str, Any]) -> None:
  (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


def write_report(out: Path, suite: str, checks: list[Check], runs: list[dict[str, Any]], meta: dict[str, Any],
                 plot: str | None) -> Path:
  failed = failing_cases(checks)
  status = "PASS" if not failed else f"FAIL: {', '.join(failed)}"
  env = meta["environment"]
  lines = [f"# Convergence: suite `{suite}` - {status}", "",
           f"- commit: `{meta['commit']}`", f"- date: {meta['date']}",
           f"- overrides: `{' '.join(meta['overrides']) or '(none)'}`",
           f"- device: {env.get('device') or 'unknown'}; host {env['host']}; {env['platform']}; Python {env['python']}",
           "- packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items())]
  for case, changes in meta.get("config_changes", {}).items():
    lines.append(f"- case {case} resolves differently from when its golden was recorded: {'; '.join(changes)}")
  lines.append("")
  if plot:
    lines += [f"![loss curves]({plot})", ""]
  lines += ["| case | metric | step | value | band | verdict |", "|---|---|---|---|---|---|"]
  for c in checks:
    verdict = VERDICT_TEXT.get(c.verdict, c.verdict)
    note = f" ({c.note})" if c.note else ""
    lines.append(f"| {c.case} | {c.metric} | {c.step} | {num(c.value)} | {band_text(c)} | {verdict}{note} |")
  lines += ["", "| case | seed | exit | seconds | run directory |", "|---|---|---|---|---|"]
  for r in runs:
    lines.append(f"| {r['case']} | {r['seed']} | {r['returncode']} | {r['seconds']:.0f} | `{r['run_dir']}` |")
  path = out / "report.md"
  path.write_text("\n".join(lines) + "\n")
  return path


def write_junit(out: Path, suite: str, checks: list[Check], seconds: dict[str, float]) -> Path:
  """One <testcase> per case (all its checks), failed when any of its checks fails."""
  cases: dict[str, list[Check]] = {}
  for c in checks:
    cases.setdefault(c.case, []).append(c)
  n_fail = sum(any(c.failed for c in cs) for cs in cases.values())
  root = ET.Element("testsuites")
  ts = ET.SubElement(root, "testsuite", name=f"convergence.{suite}", tests=str(len(cases)), failures=str(n_fail),
                     errors="0", time=f"{sum(seconds.values()):.1f}")
  for name, cs in cases.items():
    tc = ET.SubElement(ts, "testcase", classname=f"convergence.{suite}", name=name,
                       time=f"{seconds.get(name, 0.0):.1f}")
    bad = [c for c in cs if c.failed]
    if bad:
      msg = "; ".join(f"{c.metric}@{c.step}={num(c.value)} outside {band_text(c)}" for c in bad)
      f = ET.SubElement(tc, "failure", message=msg[:1000], type="ConvergenceRegression")
      f.text = "\n".join(f"{c.metric} step {c.step}: {num(c.value)} {VERDICT_TEXT.get(c.verdict, c.verdict)} "
                         f"{band_text(c)} {c.note}" for c in bad)
  path = out / "junit.xml"
  ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
  return path
