"""`python -m maxlm.convergence ...`: the old name of `maxlm convergence` (maxlm/tools/convergence/), kept for the
launch/ nightly templates that call it; the same arguments, output and exit codes."""

import sys

from maxlm.tools.convergence import main

if __name__ == "__main__":
  sys.exit(main())
