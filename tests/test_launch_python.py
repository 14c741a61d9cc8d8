"""Which Python the launch templates start (launch/mpi/train.sh, launch/slurm/train.sbatch and nightly.sbatch):
$MAXLM_PYTHON, else the active virtualenv's, else the .venv that `make setup` made (the repository's for mpirun,
the submit directory's for sbatch), else python3 when it imports maxlm, else one error line and exit 2. The
scripts run under bash with stand-ins for srun, mpirun, scontrol and python3 that only print what they get."""

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from maxlm.tools.convergence.cli import _arguments

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = {"mpi": "launch/mpi/train.sh", "sbatch": "launch/slurm/train.sbatch",
             "nightly": "launch/slurm/nightly.sbatch"}


def _exe(path: Path, body: str) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("#!/bin/sh\n" + body)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return path


def _launch(tmp_path: Path, template: str, env: dict, venv: bool, python3_has_maxlm: bool):
  """Run a copy of the template inside a repository-shaped folder (tmp/repo/launch/...), submitted from it.
  Returns (exit code, stdout, stderr, the command srun/mpirun got)."""
  repo = tmp_path / "repo"
  script = repo / TEMPLATES[template]
  script.parent.mkdir(parents=True)
  shutil.copy(ROOT / TEMPLATES[template], script)
  if venv:
    _exe(repo / ".venv" / "bin" / "python", "exit 0\n")
  bin_ = tmp_path / "bin"
  got = tmp_path / "got"
  for launcher in ("srun", "mpirun"):
    _exe(bin_ / launcher, f'echo "$@" > {got}\n')
  _exe(bin_ / "scontrol", "exit 0\n")
  _exe(bin_ / "python3", f"exit {0 if python3_has_maxlm else 1}\n")  # asked only `-c 'import maxlm'`
  base = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "7", "SLURM_NTASKS": "1",
          "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(repo), "MAXLM_REPORTS": str(tmp_path / "reports")}
  r = subprocess.run(["bash", str(script), "train.steps=1"], cwd=repo, env={**base, **env}, capture_output=True,
                     text=True, timeout=60)
  return r.returncode, r.stdout, r.stderr, got.read_text().split() if got.exists() else []


def _python_of(argv: list[str]) -> str:
  """The interpreter in a launcher command line: the word before `-m`."""
  return argv[argv.index("-m") - 1]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_maxlm_python_wins(tmp_path, template):
  code, _, err, argv = _launch(tmp_path, template, {"MAXLM_PYTHON": "/opt/py/bin/python3.11",
                                                    "VIRTUAL_ENV": "/venvs/other"}, venv=True, python3_has_maxlm=True)
  assert code == 0, err
  assert _python_of(argv) == "/opt/py/bin/python3.11"


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_active_virtualenv_comes_next(tmp_path, template):
  code, out, err, argv = _launch(tmp_path, template, {"VIRTUAL_ENV": "/venvs/maxlm"}, venv=True,
                                 python3_has_maxlm=True)
  assert code == 0, err
  assert _python_of(argv) == "/venvs/maxlm/bin/python"
  if template != "mpi":  # the sbatch start lines name the Python
    assert "python /venvs/maxlm/bin/python" in out


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_then_the_venv_that_make_setup_made(tmp_path, template):
  """Not activated (the issue's case: `make setup`, then the launcher): the repository's .venv, not the python
  on PATH, which may have no maxlm."""
  code, _, err, argv = _launch(tmp_path, template, {}, venv=True, python3_has_maxlm=True)
  assert code == 0, err
  assert _python_of(argv) == str(tmp_path / "repo" / ".venv" / "bin" / "python")


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_then_python3_if_it_has_maxlm_else_one_error_line(tmp_path, template):
  code, _, err, argv = _launch(tmp_path, template, {}, venv=False, python3_has_maxlm=True)
  assert code == 0, err
  assert _python_of(argv) == "python3"
  code, _, err, argv = _launch(tmp_path / "no", template, {}, venv=False, python3_has_maxlm=False)
  assert code == 2 and argv == []  # nothing launched
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("maxlm-launch: error: no Python with maxlm") and \
      "MAXLM_PYTHON" in lines[0] and "make setup" in lines[0], err


def test_the_nightly_command_is_in_the_convergence_grammar(tmp_path):
  """nightly.sbatch's srun line parses as `maxlm convergence run` arguments (suite=, jobs=, out=, overrides)."""
  code, _, err, argv = _launch(tmp_path, "nightly", {"MAXLM_PYTHON": "py", "MAXLM_SUITE": "cpu", "MAXLM_JOBS": "2"},
                               venv=False, python3_has_maxlm=True)
  assert code == 0, err
  words = argv[argv.index("-m") + 1:]
  assert words[:2] == ["maxlm.tools.convergence", "run"]
  sub, args = _arguments(words[1:])
  assert (sub, args.suite, args.jobs, args.out.parent) == ("run", "cpu", 2, tmp_path / "reports")
  assert args.overrides == ["distributed.mode=off", "train.steps=1"]  # the template's own, then the job's
