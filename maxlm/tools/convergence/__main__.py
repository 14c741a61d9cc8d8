import sys

from maxlm.tools.convergence.cli import main

if __name__ == "__main__":
  sys.exit(main())
