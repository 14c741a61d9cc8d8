"""maxlm/plan/clock.py: the seconds the planner's next compile is expected to take, against hand numbers."""

import pytest

from maxlm.config import load_config
from maxlm.plan.clock import CompileClock, depth


def cfg(layers: int, scan: bool = False):
  return load_config([f"model.n_layers={layers}", f"model.scan_layers={str(scan).lower()}"])


def test_depth_counts_the_layers_xla_compiles_one_by_one():
  assert depth(cfg(32)) == 32 and depth(cfg(32, scan=True)) == 1


def test_nothing_compiled_expects_nothing():
  assert CompileClock().expect(cfg(32)) is None


def test_a_compile_at_least_as_deep_is_the_expectation():
  clock = CompileClock()
  clock.add(cfg(32), 44.0)  # the config as written, 8B-like: 44 s
  clock.add(cfg(32), 81.0)  # a candidate's compile
  clock.add(cfg(8), 25.0)   # a shallow probe
  assert clock.expect(cfg(32)) == 81.0  # the slowest of the 32-layer ones, not the probe scaled (100 s)
  assert clock.expect(cfg(4)) == 81.0  # shallower than every compile seen: their slowest bounds it


def test_only_shallower_compiles_scale_by_depth():
  clock = CompileClock()
  clock.add(cfg(4), 19.0)
  clock.add(cfg(8), 25.0)
  # 32 layers from the probes: 19 x 32/4 = 152, 25 x 32/8 = 100: the larger
  assert clock.expect(cfg(32)) == pytest.approx(152.0)
  clock.add(cfg(8, scan=True), 10.0)  # a scanned compile is one layer deep: 10 x 32 = 320 for 32 unrolled
  assert clock.expect(cfg(32)) == pytest.approx(320.0)
  assert clock.expect(cfg(80, scan=True)) == 25.0  # scanned: every compile seen is at least as deep

