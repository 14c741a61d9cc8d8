"""maxlm/errors.py: one base class whose subclasses carry their exit codes, and the one mapping commands use."""

import pytest

from maxlm.checkpoint import CheckpointError
from maxlm.cli.grammar import UsageError, command_main
from maxlm.config import ConfigError
from maxlm.tools.convergence.suite import SuiteError
from maxlm.data import DataError
from maxlm.errors import MaxlmError, report
from maxlm.generation import GenerationError
from maxlm.layers import PrecisionError
from maxlm.trainer import RunError


@pytest.mark.parametrize("cls,code", [(ConfigError, 2), (DataError, 2), (PrecisionError, 2), (UsageError, 2),
                                      (GenerationError, 2), (SuiteError, 2), (CheckpointError, 3), (RunError, 1)])
def test_every_user_error_is_a_maxlm_error_with_its_exit_code(cls, code, capsys):
  e = cls("bad\nthing")
  assert isinstance(e, MaxlmError) and e.exit_code == code
  assert report(e) == code
  assert capsys.readouterr().err == "maxlm: error: bad\\nthing\n"  # one line, the break escaped


def test_command_main_maps_user_errors_and_keeps_bugs(capsys):
  def raising(exc):
    def run(argv):
      raise exc
    return run
  assert command_main("doc", raising(CheckpointError("no checkpoint in x")), []) == 3
  assert capsys.readouterr().err == "maxlm: error: no checkpoint in x\n"
  assert command_main("doc", raising(DataError("bad file y")), []) == 2
  with pytest.raises(KeyError):  # an internal bug keeps its traceback
    command_main("doc", raising(KeyError("bug")), [])
  assert command_main("the help", raising(KeyError("never run")), ["--help"]) == 0
  assert capsys.readouterr().out == "the help\n"
