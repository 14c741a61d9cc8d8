"""maxlm's error contract: every failure a user can cause is a `MaxlmError` whose class carries its exit code.

Commands map them in one place, `report` (used by `maxlm.cli.command_main`, convert and train): one stderr line
`maxlm: error: <message>` and the class's exit code. Anything else is an internal bug and keeps its traceback.

  BadInput (2)         a bad config, argument, data input or precision: nothing was created or written
  CheckpointFailure (3) no usable checkpoint, one that does not fit, or a save that failed
  RunFailure (1)       the run itself failed (a non-finite loss under train.nonfinite=stop, out of memory)

This module imports nothing of maxlm, so every layer (data/ and layers/ too) can raise these.
"""

from __future__ import annotations

import sys

EXIT_RUN_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_CHECKPOINT = 3


class MaxlmError(Exception):
  """A failure with a one-line message (line breaks escaped) and the process exit code it maps to."""
  exit_code = EXIT_RUN_FAILURE

  def __init__(self, message: str = ""):
    super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message)))


class BadInput(MaxlmError):
  exit_code = EXIT_BAD_INPUT


class CheckpointFailure(MaxlmError):
  exit_code = EXIT_CHECKPOINT


class RunFailure(MaxlmError):
  exit_code = EXIT_RUN_FAILURE


def report(e: MaxlmError) -> int:
  """The one mapping from an error to what a command prints and returns: one stderr line, the class's code."""
  print(f"maxlm: error: {e}", file=sys.stderr, flush=True)
  return e.exit_code
