"""maxlm/checkpoint/verify.py: the unraisable-hook chain of `OrbaxNoise` (one per open Checkpointer).

The file checks and fingerprints of the same module are tested through whole checkpoints in test_checkpoint.py.
"""

import sys
import types

import pytest

from maxlm.checkpoint.verify import OrbaxNoise


def _args(text: str):
  return types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError(text), exc_traceback=None, err_msg=None,
                               object=None)


@pytest.fixture
def seen(monkeypatch):
  """The process's hook before any OrbaxNoise: records what reaches it."""
  got = []
  monkeypatch.setattr(sys, "unraisablehook", lambda args: got.append(str(args.exc_value)))
  return got


def test_noise_is_dropped_and_the_rest_reaches_the_hook_before(seen):
  noise = OrbaxNoise()
  noise.install()
  sys.unraisablehook(_args("Event loop is closed"))
  sys.unraisablehook(_args("a real error"))
  noise.remove(failed=False)
  sys.unraisablehook(_args("Event loop is closed"))
  assert seen == ["a real error", "Event loop is closed"]


def test_two_checkpointers_closed_in_the_order_they_opened(seen):
  """The first one removed while the second's hook sits over it (two Checkpointers open at once, closed first to
  last): the chain still reaches the hook before both (it used to end in `None(args)`, a TypeError printed from
  inside the hook), and once both are removed the process has its first hook back."""
  first, second = OrbaxNoise(), OrbaxNoise()
  before = sys.unraisablehook
  first.install()
  second.install()
  first.remove(failed=False)
  sys.unraisablehook(_args("a real error"))
  sys.unraisablehook(_args("Event loop is closed"))  # the second one still drops the noise
  second.remove(failed=False)
  assert sys.unraisablehook is before
  sys.unraisablehook(_args("Event loop is closed"))
  assert seen == ["a real error", "Event loop is closed"]


def test_closed_last_to_first(seen):
  before = sys.unraisablehook
  first, second = OrbaxNoise(), OrbaxNoise()
  first.install()
  second.install()
  second.remove(failed=False)
  sys.unraisablehook(_args("Event loop is closed"))  # the first one is still open
  first.remove(failed=False)
  assert sys.unraisablehook is before
  sys.unraisablehook(_args("a real error"))
  assert seen == ["a real error"]
