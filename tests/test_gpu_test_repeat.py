"""benchmarks/gpu_test_repeat.py's arithmetic: how many jobs share the GPU and the disk, and the run of passes."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "gpu_test_repeat", Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_test_repeat.py")
repeat = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(repeat)


def test_jobs_at_once_are_bounded_by_the_disk_and_never_zero():
  # the H200 machine: 64 GB disk, ~50 GB free, 16 GB a deterministic-resume job -> 3 (50 // 16), not the 8 asked
  assert repeat.at_once(8, 50.0, 16.0) == 3
  assert repeat.at_once(2, 500.0, 16.0) == 2  # a big disk: what was asked
  assert repeat.at_once(8, 47.9, 16.0) == 2  # 47.9 GB hold two whole jobs, not three
  assert repeat.at_once(8, 10.0, 16.0) == 1  # less than one job's room: still one, never none


def test_passes_in_a_row_are_the_longest_unbroken_run():
  assert repeat.streak([]) == 0
  assert repeat.streak(["passed"] * 10) == 10
  assert repeat.streak(["passed", "passed", "failed", "passed", "passed", "passed", "timeout"]) == 3
  assert repeat.streak(["failed", "timeout"]) == 0
