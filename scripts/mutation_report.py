"""Print the mutation score per module and every surviving mutant with its diff (after `mutmut run`).

Reads mutmut's result files (mutants/**/*.py.meta) and the mutated sources beside them; the diff of a
mutant is its function against the original. Mutants listed in docs/mutation.md's equivalent table (first
column, in backticks) are reported apart and left out of the adjusted score.

  python scripts/mutation_report.py [--mutants mutants] [--doc docs/mutation.md] [--elapsed SECONDS]

Exit code 0; 1 when mutants/ holds no results.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path

# mutmut 3.8.1's exit-code meanings (mutmut/stats.py); anything else is "suspicious".
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          37: "type check", -11: "segfault", -9: "segfault", None: "not checked"}
DETECTED = ("killed", "timeout", "segfault", "type check")  # the tests noticed the change
UNDETECTED = ("survived", "no tests", "suspicious")


def load_results(root: Path) -> dict[str, dict[str, str]]:
  """{source path: {mutant name: status}} for every mutated file."""
  out = {}
  for meta in sorted(root.rglob("*.py.meta")):
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    src = meta.relative_to(root).with_suffix("")  # maxlm/optim.py
    out[str(src)] = {k: STATUS.get(v, "suspicious") for k, v in codes.items()}
  return out


def function_sources(path: Path) -> dict[str, str]:
  """Source text of every function (methods included) of a mutated file, by name."""
  text = path.read_text()
  lines = text.splitlines(keepends=True)
  funcs = {}
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # by line numbers: get_source_segment is
      funcs[node.name] = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))  # O(file) per call
  return funcs


def mutant_diff(funcs: dict[str, str], mutant: str) -> list[str]:
  """The changed lines (-/+) of one mutant against the original function."""
  name = mutant.rsplit(".", 1)[1]  # x_foo__mutmut_7 or xǁClassǁmethod__mutmut_7
  base = name.rsplit("__mutmut_", 1)[0]
  orig, new = funcs.get(base + "__mutmut_orig"), funcs.get(name)
  if orig is None or new is None:
    return [f"(source of {name} not found)"]
  orig = orig.replace(base + "__mutmut_orig", base).splitlines()
  new = new.replace(name, base).splitlines()
  return [line for line in difflib.unified_diff(orig, new, lineterm="", n=0)
          if line[:1] in "-+" and not line.startswith(("---", "+++"))]


def equivalent_names(doc: Path) -> set[str]:
  """Mutant names in the first column of docs/mutation.md's tables, e.g. | `maxlm.optim.x_f__mutmut_3` |."""
  if not doc.exists():
    return set()
  return set(re.findall(r"^\|\s*`([\w.ǁ]+__mutmut_\d+)`", doc.read_text(), flags=re.M))


def module_of(path: str) -> str:
  return path[:-3].replace("/", ".")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mutants", default="mutants")
  ap.add_argument("--doc", default="docs/mutation.md")
  ap.add_argument("--elapsed", type=float, default=None, help="run time to print, seconds")
  ap.add_argument("--only", default=None, help="a file of mutant names (one a line): score only those, e.g. a "
                  "sample from scripts/mutation_sample.py")
  args = ap.parse_args(argv)
  root = Path(args.mutants)
  results = load_results(root)
  if args.only:
    keep = set(Path(args.only).read_text().split())
    results = {p: {m: s for m, s in r.items() if m in keep} for p, r in results.items()}
  if not results:
    print(f"mutation: no results under {root}/ (run `make mutation` first)", file=sys.stderr)
    return 1
  listed = equivalent_names(Path(args.doc))

  rows, survivors, equivalent = [], [], []
  total = Counter()
  for path, by_name in results.items():
    count = Counter(by_name.values())
    checked = sum(n for s, n in count.items() if s != "not checked")
    if not checked:
      continue
    detected = sum(count[s] for s in DETECTED)
    eq = [m for m, s in by_name.items() if s in UNDETECTED and m in listed]
    rows.append((module_of(path), checked, count, detected, len(eq)))
    total.update(count)
    total["checked"] += checked
    total["detected"] += detected
    total["equivalent"] += len(eq)
    funcs = None
    for m, s in by_name.items():
      if s in UNDETECTED:
        funcs = funcs or function_sources(root / path)
        (equivalent if m in listed else survivors).append((m, s, mutant_diff(funcs, m)))

  def pct(a, b):
    return f"{100.0 * a / b:5.1f}%" if b else "   n/a"

  head = (f"{'module':<26} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} "
          f"{'equiv':>5} {'score':>7} {'adjusted':>8}")
  print(head)
  print("-" * len(head))
  for name, checked, c, det, eq in rows:
    print(f"{name:<26} {checked:>7} {c['killed']:>6} {c['timeout']:>7} {c['survived']:>8} {c['no tests']:>8} "
          f"{eq:>5} {pct(det, checked):>7} {pct(det, checked - eq):>8}")
  print("-" * len(head))
  print(f"{'all':<26} {total['checked']:>7} {total['killed']:>6} {total['timeout']:>7} {total['survived']:>8} "
        f"{total['no tests']:>8} {total['equivalent']:>5} {pct(total['detected'], total['checked']):>7} "
        f"{pct(total['detected'], total['checked'] - total['equivalent']):>8}")
  print("score = (killed + timeout) / mutants; adjusted leaves out the equivalent mutants listed in "
        f"{args.doc}")
  if args.elapsed is not None:
    m, s = divmod(int(round(args.elapsed)), 60)
    print(f"run time {m} min {s:02d} s")

  print(f"\n{len(survivors)} surviving mutant(s) not listed as equivalent:")
  for m, s, diff in survivors:
    print(f"\n  {m} ({s})")
    for line in diff:
      print(f"    {line}")
  if equivalent:
    print(f"\n{len(equivalent)} surviving mutant(s) listed as equivalent in {args.doc}: "
          + ", ".join(m.rsplit(".", 1)[1] for m, _, _ in equivalent))
  stale = listed - {m for by_name in results.values() for m, s in by_name.items() if s in UNDETECTED}
  known = {m for by_name in results.values() for m in by_name}
  stale = {m for m in stale if m in known}  # listed, measured here, and yet detected: renumbered?
  if stale:
    print(f"\nlisted as equivalent but detected now (the list may be stale): {', '.join(sorted(stale))}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
