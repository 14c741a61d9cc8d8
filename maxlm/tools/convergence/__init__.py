"""Convergence suites: run cases, compare them with golden loss bands, write a report with plots.

  maxlm convergence run --suite cpu [--out DIR] [--cases a,b] [--jobs N] [key=value ...]
  maxlm convergence update-golden --suite cpu [--seeds N] [--cases a,b] [--jobs N]
  maxlm convergence baseline [config=FILE] [key=value ...]

`run` trains every case of configs/convergence/<suite>.yml at the suite's run seed (key=value overrides
apply to every case), checks each metric at each listed step against the golden band in
configs/convergence/golden/<suite>/<case>.json, and writes report.md, loss_curves.png, results.json and
junit.xml to --out. Exit 0 when every check passes, 1 when any fails (the failing cases are named),
2 on a setup error (unknown suite or case, missing or stale golden, bad config, matplotlib missing).
`update-golden` re-records the goldens from N seeds and prints the diff; it is never run automatically:
review a changed golden like code. `baseline` prints the unigram and tuned bigram cross-entropies of a
config's held-out split. See docs/convergence.md.
"""


def main(argv: list[str] | None = None) -> int:
  from maxlm.tools.convergence.cli import main as cli_main  # noqa: PLC0415 (lazy: `maxlm --help` reads this file only)
  return cli_main(argv)
