"""maxlm/plan/xla_log.py: XLA's own log lines (glog on fd 2) during a compile are caught and summarized, anything
else written to fd 2 passes through, and fd 2 is restored whatever happens; a real XLA:CPU compile's warnings too."""

import json
import os
import subprocess
import sys

import pytest

from maxlm.plan import xla_log

# the line XLA:GPU wrote while `maxlm plan` compiled the 70B for 64 compile-only H200s (issue 55)
REMAT = ("W1207 21:05:16.588760    4745 hlo_rematerialization.cc:3231] Can't reduce memory use below 108.39GiB "
         "(116385573454 bytes) by rematerialization; only reduced to 208.85GiB (224251888325 bytes), down from "
         "218.89GiB (235027055537 bytes) originally")
OTHER = "W1207 21:05:17.000001    4745 gpu_compiler.cc:99] something else entirely"


def _fd2_target() -> tuple:
  st = os.fstat(2)
  return st.st_dev, st.st_ino


def test_glog_lines_written_to_fd_2_are_caught_and_the_rest_passes(capfd):
  before = _fd2_target()
  with xla_log.caught() as log:
    os.write(2, (REMAT + "\n").encode())  # from C's level, as XLA writes: beneath Python's sys.stderr
    os.write(2, b"a line of someone else\n")
    os.write(2, (OTHER + "\n").encode())
  assert _fd2_target() == before  # restored
  assert log.lines == [REMAT, OTHER]
  err = capfd.readouterr().err
  assert err == "a line of someone else\n"  # passed on, the glog lines not
  assert log.fields() == {"xla_log": "XLA: its rematerialization could not bring the program under XLA's own limit "
                                     "of 108.4 GiB (by its count 208.8 GiB); gpu_compiler.cc: something else entirely"}


def test_fd_2_is_restored_on_an_exception(capfd):
  before = _fd2_target()
  with pytest.raises(RuntimeError, match="boom"):
    with xla_log.caught():
      os.write(2, (REMAT + "\n").encode())
      raise RuntimeError("boom")
  assert _fd2_target() == before
  os.write(2, b"after\n")
  assert capfd.readouterr().err == "after\n"


def test_summary_by_hand():
  assert xla_log.summary([]) == ""
  low = REMAT.replace("208.85GiB", "150.00GiB").replace("108.39GiB", "111.48GiB")
  assert xla_log.summary([REMAT, low]) == ("XLA: its rematerialization could not bring the program under XLA's own "
                                           "limit of 111.5 GiB (by its count 150.0 GiB) (2 times)")
  assert xla_log.Caught(["I1207 21:05:16.5 1 x.cc:1] info only"]).fields() == {}  # info lines: no summary


CHILD = r"""
import json
import jax, jax.numpy as jnp
from maxlm.plan import xla_log
jax.devices()  # the backend up before: its start-up lines are not the compile's
with xla_log.caught() as log:
  jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()  # XLA's pass pipeline logs each pass (VLOG, below)
print(json.dumps({"lines": len(log.lines), "passes": sum("hlo_pass_pipeline" in ln for ln in log.lines)}))
"""


def test_a_real_xla_compile_logs_into_the_catch_not_onto_stderr():
  # XLA's C++ logging made verbose for its pass pipeline: real glog lines, written by XLA:CPU while compiling
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1"}
  r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(r.stdout.splitlines()[-1])
  assert got["passes"] > 10, got  # caught
  assert "hlo_pass_pipeline" not in r.stderr  # and none printed
