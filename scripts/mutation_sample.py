"""Print a uniform random sample of mutant names per module group (after mutmut generated mutants/).

For modules whose full run does not fit the time at hand: `bash scripts/mutation.sh $(python
scripts/mutation_sample.py 40 maxlm.step)` runs 40 of maxlm/step.py's mutants, and `python
scripts/mutation_report.py --only <(python scripts/mutation_sample.py 40 maxlm.step)` scores that sample.

  python scripts/mutation_sample.py N PREFIX [PREFIX ...] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("n", type=int, help="mutants per prefix")
  ap.add_argument("prefixes", nargs="+", help="module prefix, e.g. maxlm.layers (covers its submodules)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--mutants", default="mutants")
  args = ap.parse_args(argv)
  names = sorted(k for meta in Path(args.mutants).rglob("*.py.meta")
                 for k in json.loads(meta.read_text())["exit_code_by_key"])
  for prefix in args.prefixes:
    group = [k for k in names if k.startswith(prefix + ".")]
    for k in sorted(random.Random(args.seed).sample(group, min(args.n, len(group)))):
      print(k)


if __name__ == "__main__":
  main()
