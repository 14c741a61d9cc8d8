"""Convergence suites: run cases, compare them with golden loss bands, write a report with plots.

  maxlm convergence run suite=cpu [out=DIR] [cases=a,b] [jobs=N] [steps=N] [--no-plot] [model.x=... ...]
  maxlm convergence redraw out=DIR
  maxlm convergence update-golden suite=cpu [seeds=N] [cases=a,b] [jobs=N] [out=DIR]
  maxlm convergence baseline [config=FILE] [model.x=... ...]

`run` trains every case of configs/convergence/<suite>.yml at the suite's run seed (dotted config overrides
apply to every case), checks each metric at each listed step against the golden band in
configs/convergence/golden/<suite>/<case>.json, and writes report.md, loss_curves.png, results.json and
junit.xml to out= (default runs/convergence/<suite>).
  suite=NAME   a name in configs/convergence/ (cpu, gpu) or a suite file's path
  cases=a,b    a comma-separated subset of the suite's cases (default: all)
  jobs=N       cases run side by side (default 1)
  steps=N      stop every case after N steps (checks past it are skipped; the learning-rate schedule stays
               the full case's)
  --no-plot    skip loss_curves.png (where matplotlib is missing); `redraw out=DIR` draws it later from
               that run's results.json
Exit 0 when every check passes, 1 when any fails (the failing cases are named), 2 on a setup error (a bad
argument, unknown suite or case, missing or stale golden, bad config, matplotlib missing).
`update-golden` re-records the goldens from seeds 0..N-1 (default: the suite's `seeds`) and prints the diff;
its seed runs go to out= (default: a temporary directory). It is never run automatically: review a changed
golden like code. `baseline` prints the unigram and tuned bigram cross-entropies of a config's held-out
split. See docs/convergence.md.
"""


def main(argv: list[str] | None = None) -> int:
  from maxlm.tools.convergence.cli import main as cli_main  # noqa: PLC0415 (lazy: `maxlm --help` reads this file only)
  return cli_main(argv)
