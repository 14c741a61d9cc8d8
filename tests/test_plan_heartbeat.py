"""maxlm/plan/heartbeat.py: a line every `every` seconds while the block runs, none after it (also when it raises),
no thread left; and the candidate's words."""

import threading
import time

import pytest

from maxlm.config import load_config
from maxlm.plan import heartbeat


def _beating_threads() -> list:
  return [t for t in threading.enumerate() if t.name == "maxlm-plan-heartbeat"]


def test_a_line_every_interval_while_the_block_runs_and_none_after():
  lines = []
  with heartbeat.beating(lines.append, "compiling X", every=0.1):
    time.sleep(0.55)  # a slow compile
  n = len(lines)
  assert 4 <= n <= 6, lines
  assert lines[0].startswith("plan: compiling X (") and lines[0].endswith(" s so far)")
  assert not _beating_threads()
  time.sleep(0.3)
  assert len(lines) == n  # stopped


def test_an_error_in_the_block_stops_the_lines_before_it_goes_on():
  lines = []
  with pytest.raises(RuntimeError, match="compile failed"):
    with heartbeat.beating(lines.append, "compiling X", every=0.05):
      time.sleep(0.2)
      raise RuntimeError("compile failed")
  n = len(lines)
  assert n >= 2 and not _beating_threads()
  time.sleep(0.2)
  assert len(lines) == n


def test_seconds_so_far_by_the_clock():
  now = [100.0]
  lines = []
  with heartbeat.beating(lines.append, "x", every=0.05, clock=lambda: now[0]):
    now[0] = 160.0
    time.sleep(0.12)
  assert lines and lines[0] == "plan: x (60 s so far)"


def test_without_a_listener_no_thread():
  with heartbeat.beating(None, "x", every=0.01):
    assert not _beating_threads()
    time.sleep(0.05)


def test_candidate_words():
  cfg = load_config(["config=tiny.yml", "model.remat=save_dots", "mesh.fsdp=4", "mesh.dcn_data=2"])
  assert heartbeat.candidate(cfg) == ("remat=save_dots, grad_accum=1, offload=none, mu_dtype=float32, "
                                      "nu_dtype=float32; mesh fsdp 4 x dcn_data 2; 2 layers")
