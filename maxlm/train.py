"""Train a model: `python -m maxlm.train [config=FILE] [key=value ...]` is `maxlm train ...` (maxlm/cli/train.py).

This entry stays for the spelling that the README, launch/'s templates and the SLURM and container jobs use;
the command itself lives in maxlm/cli/train.py.
"""

import sys

from maxlm.cli.train import main

__all__ = ["main"]

if __name__ == "__main__":
  sys.exit(main())
