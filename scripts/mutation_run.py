"""`mutmut run` (mutmut 3.8.1) with this project's two rules for which tests judge a mutant.

mutmut runs, for every mutant, each selected test that called the mutated function in its stats pass.
Here a mutant of a core module is judged by the tests of that module's own test file(s) only (OWN_TESTS):
the tests whose purpose is that behaviour, as issue 15 asks. A mutant of maxlm/optim.py that only
test_step.py's ten-minute AdamW runs would notice counts as surviving: test_optim.py should catch it.
This is stricter than mutmut's default (the score can only go down) and makes a run affordable on two
cores (the optimizer's mutants need seconds of tests instead of minutes).

The tests of a mutant run fastest first (mutmut's fork server runs them in set order), so a killed
mutant usually costs one quick test (pytest stops at the first failure).

  python scripts/mutation_run.py [--max-children N] [MUTANT_NAME_PATTERN ...]   (as `mutmut run`)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mutmut import __main__ as mutmut_main
from mutmut.state import state
from mutmut.workers import isolation

# mutant module (a prefix covers its submodules) or function -> the test files whose purpose is its behaviour
OWN_TESTS = {
    "maxlm.model": ("tests/test_model.py",),
    "maxlm.step": ("tests/test_step.py",),
    "maxlm.optim": ("tests/test_optim.py",),
    "maxlm.metrics": ("tests/test_metrics.py",),
    "maxlm.layers": ("tests/test_layers.py",),
    "maxlm.layers.kv_cache": ("tests/test_generation.py",),  # KV-cache generation
    "maxlm.model.xǁTransformerǁ_cached_layers": ("tests/test_generation.py",),
    "maxlm.layers.x_remat_policy": ("tests/test_layers.py", "tests/test_model.py"),  # remat of the blocks
    "maxlm.layers.x_check_precision": ("tests/test_layers.py", "tests/test_step.py"),  # FP8 refused / run
    "maxlm.layers.x_supported_precisions": ("tests/test_layers.py", "tests/test_step.py"),
    "maxlm.layers.te_env": ("tests/test_layers.py", "tests/test_model.py"),  # TE set up on a CPU host
    "maxlm.data.pipeline": ("tests/test_data_pipeline.py", "tests/test_data_streams.py", "tests/test_data_inputs.py"),
    "maxlm.data.packing": ("tests/test_data_pipeline.py", "tests/test_data_streams.py"),
}


def own_test_files(function: str) -> tuple[str, ...] | None:
  """The test files of a mangled function name (`maxlm.layers.rope.x_apply_rope`), None if unlisted."""
  if function in OWN_TESTS:
    return OWN_TESTS[function]
  module = function.rsplit(".", 1)[0]
  for prefix in sorted(OWN_TESTS, key=len, reverse=True):
    if module == prefix or module.startswith(prefix + "."):
      return OWN_TESTS[prefix]
  return None


def keep_own_tests(tests_by_function: dict) -> None:
  for function, tests in tests_by_function.items():
    files = own_test_files(function)
    if files is not None:
      tests_by_function[function] = {t for t in tests if t.split("::", 1)[0] in files}


_collect_or_load_stats = mutmut_main.collect_or_load_stats


def collect_or_load_stats(*args, **kwargs):
  """mutmut's stats (collected or loaded, and saved, as usual), then only each module's own tests kept
  in memory for this run: mutants/mutmut-stats.json keeps the full map."""
  _collect_or_load_stats(*args, **kwargs)
  keep_own_tests(state().tests_by_mangled_function_name)


_submit = isolation.ForkServerRunner.submit


def submit(self, mutant_name, tests, cpu_time_limit, estimated_time):
  tests = sorted(tests, key=lambda t: state().duration_by_test.get(t, 0.0))  # fastest first
  return _submit(self, mutant_name, tests, cpu_time_limit, estimated_time)


_run_clean_tests = isolation.ForkServerRunner.run_clean_tests


def run_clean_tests(self, tests):
  """MUTATION_SKIP_CLEAN=1: skip mutmut's clean run of every selected test before a partial run (minutes on
  two cores); the stats pass ran them clean, and a test added since must have passed on its own."""
  if os.environ.get("MUTATION_SKIP_CLEAN") == "1":
    return 0
  return _run_clean_tests(self, tests)


def forget_tests(files: list[str], stats_path: Path = Path("mutants/mutmut-stats.json")) -> int:
  """MUTATION_RESTAT="tests/test_step.py ...": drop these files' tests from mutmut's saved test map, so that
  this run maps them again. mutmut maps only tests it has not seen before; after a module gains functions
  (maxlm/step.py's FP8 head), the old tests would leave the new functions' mutants with "no tests"."""
  if not files or not stats_path.exists():
    return 0
  stats = json.loads(stats_path.read_text())
  known = stats["duration_by_test"]
  stats["duration_by_test"] = {t: d for t, d in known.items() if t.split("::", 1)[0] not in files}
  stats_path.write_text(json.dumps(stats))
  return len(known) - len(stats["duration_by_test"])


mutmut_main.collect_or_load_stats = collect_or_load_stats
isolation.ForkServerRunner.submit = submit
isolation.ForkServerRunner.run_clean_tests = run_clean_tests

if __name__ == "__main__":
  forget_tests(os.environ.get("MUTATION_RESTAT", "").split())
  mutmut_main.cli.main(args=["run", *sys.argv[1:]], prog_name="mutmut")
