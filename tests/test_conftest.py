"""The suite's own crash and hang report (tests/conftest.py): an inner pytest run under xdist, in a temporary
directory holding a copy of this conftest, where one test aborts the process and one hangs past its timeout.
The outer summary must name each test and show the stack of the thread that was in it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")
pytest.importorskip("pytest_timeout")

INNER = '''
import os
import time

import pytest


def test_fine():
  pass


def test_aborts_here():
  os.abort()


@pytest.mark.timeout(8)
def test_hangs_here():
  time.sleep(60)
'''


def test_a_crashed_and_a_stuck_worker_are_named_with_their_stacks(tmp_path):
  shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
  (tmp_path / "test_inner.py").write_text(INNER)
  (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 900\ntimeout_method = thread\n")
  temp = tmp_path / "tmp"
  temp.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("MAXLM_TEST_FAULT_DIR", "PYTEST_XDIST_WORKER",
                                                          "PYTEST_ADDOPTS")}
  env["TMPDIR"] = str(temp)  # where the inner controller makes its fault directory
  r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-p", "no:randomly",
                      str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  out = r.stdout + r.stderr
  assert r.returncode == 1, out
  assert "1 passed" in out, out
  summary = out[out.index("crashed or stuck"):] if "crashed or stuck" in out else ""
  assert summary.count("crashed or stuck") == 2, out
  assert "test: test_inner.py::test_aborts_here" in summary and "Fatal Python error: Aborted" in summary, out
  assert 'line 13 in test_aborts_here' in summary, out  # the main thread's stack, down to os.abort()
  assert "test: test_inner.py::test_hangs_here" in summary and "Timeout (0:00:06" in summary, out  # 80% of 8 s
  assert 'line 18 in test_hangs_here' in summary, out
  assert not list(temp.glob("maxlm-test-faults-*")), out  # the controller removed its directory
