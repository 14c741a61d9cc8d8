"""maxlm/plan/measure.py's Target while it measures: a progress line every `heartbeat_s` during a slow compile (a
child that takes its time, given through Simulator's `command`), none after it, also when the child dies; XLA's
warnings that the child caught said in one line; and `measure` catching XLA's own log lines of a real compile."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from maxlm.config import load_config
from maxlm.plan.target import Simulator, Target

TINY = load_config(["config=tiny.yml", "model.remat=save_dots"])
# a child answering each config after `delay` seconds with a made-up measurement (and, if asked, XLA's summary)
SLOW = ("import sys, time, json\n"
        "for line in sys.stdin:\n"
        "  time.sleep(float(sys.argv[1]))\n"
        "  out = {'device': 1000, 'how': 'measured'} | ({'xla_log': sys.argv[2]} if len(sys.argv) > 2 else {})\n"
        "  print(json.dumps(out), flush=True)\n")
DEAD = "import sys, time; sys.stdin.readline(); time.sleep(float(sys.argv[1])); sys.exit(3)"


def _target(script: str, *args: str, every: float = 0.1) -> tuple[Target, list]:
  lines = []
  sim = Simulator(2, [sys.executable, "-c", script, *args], os.environ.copy(), "2 slow devices", one_memory=False)
  t = Target(2, 1, "NVIDIA H200", 2 ** 40, 0.95, True, _sim=sim, progress=lines.append, heartbeat_s=every)
  return t, lines


def _beating() -> list:
  return [t for t in threading.enumerate() if t.name == "maxlm-plan-heartbeat"]


def test_a_slow_compile_says_so_every_interval_and_stops():
  t, lines = _target(SLOW, "0.65")
  try:
    assert t.measure(TINY)["device"] == 1000
  finally:
    t.close()
  assert 4 <= len(lines) <= 7, lines  # one every 0.1 s of 0.65 s (the child's start included)
  assert lines[0].startswith("plan: compiling remat=save_dots, grad_accum=1, offload=none, mu_dtype=float32, "
                             "nu_dtype=float32; mesh ") and lines[0].endswith(" on 2 slow devices (0 s so far)")
  assert not _beating()
  n = len(lines)
  time.sleep(0.3)
  assert len(lines) == n


def test_a_child_that_dies_ends_the_lines_before_the_error():
  t, lines = _target(DEAD, "0.35")
  with pytest.raises(RuntimeError, match="ended"):
    t.measure(TINY)
  n = len(lines)
  assert n >= 2 and not _beating()
  time.sleep(0.3)
  assert len(lines) == n


def test_xla_warnings_caught_by_the_child_are_one_line_of_the_planner():
  t, lines = _target(SLOW, "0", "XLA: could not reduce memory below 108.4 GiB by its rematerialization", every=60)
  try:
    out = t.measure(TINY)
  finally:
    t.close()
  assert out["xla_log"].startswith("XLA: could not reduce")
  assert lines == ["plan: XLA: could not reduce memory below 108.4 GiB by its rematerialization; while compiling "
                   "remat=save_dots, grad_accum=1, offload=none, mu_dtype=float32, nu_dtype=float32; mesh fsdp rest "
                   "x dcn_data rest; 2 layers on 2 slow devices"]


MEASURE = r"""
import json
from maxlm.config import load_config
from maxlm.plan.measure import measure
cfg = load_config(["config=tiny.yml", "model.backend=flax", "data.type=synthetic", "checkpoint.enabled=false"])
print(json.dumps(sorted(measure(cfg))))
"""


def test_measure_keeps_xla_log_lines_of_its_compile_off_stderr():
  # XLA's C++ logging made verbose for its pass pipeline: every compile then writes glog lines onto fd 2
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1"}
  r = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=600, env=env)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "device" in json.loads(r.stdout.splitlines()[-1])
  assert "hlo_pass_pipeline" not in r.stderr  # the step's compile logged only into the catch
