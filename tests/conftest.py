"""Test setup: 8 simulated CPU devices (set before JAX is imported), TE helpers and markers."""

import atexit
import faulthandler
import os
import shutil
import tempfile
import warnings

# On CPU, XLA's LLVM backend at optimization level 0: the suite is mostly compiles of tiny programs, and level
# 0 halves their CPU time (tests/test_loss_scale.py: 75 s of CPU instead of 159 s, measured). It changes how
# the generated code runs, not the HLO: every tolerance here is derived from the arithmetic, not from one
# compiler's rounding, and the goldens recorded at the default level (HF logits, convergence bands) hold.
# Subprocesses started by the tests inherit it. On the GPU (MAXLM_TEST_GPU=1) the kernels keep level 3.
_FAST_CPU = "" if os.environ.get("MAXLM_TEST_GPU") == "1" else " --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + _FAST_CPU)
os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("MAXLM_TEST_GPU") != "1" else "")
# XLA:CPU's thread pool sized for those devices as maxlm's commands size it (maxlm/runtime/env.py), for the workers
# and every subprocess: with XLA's own pool (one thread per device on this 2-core machine), the README test
# aborted its worker in 4 of 7 runs with a second run beside it, deadlocked in an 8-device all-gather.
from maxlm.runtime import env as runtime  # noqa: E402 - imports no JAX; the pool must be sized before JAX starts

runtime.size_cpu_pool()

# One XLA compilation cache for the whole run, made empty here and removed when the run ends: the suite trains
# the same tiny models many times, in-process and in subprocesses (CLI, SLURM, mpirun), and a subprocess run
# that finds its programs compiled takes about half the CPU (18 s -> 10 s measured for a 3-step tiny run).
# Nothing is carried from an earlier run. The size limit turns on JAX's file lock, which keeps concurrent
# writers (xdist workers, the processes of a launch) apart. The workers and every subprocess inherit it.
# Only compiles over 1 s are kept: under that lock every write lists and reads the whole cache (JAX's LRU
# eviction check), so keeping the many sub-second compiles too made `make test` slower (719 s instead of
# ~660 s, with test_parallel_sharding.py's 8-device test at 58 s instead of 17 s), though one file alone gained 5-10 %.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="maxlm-test-xla-cache-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1",
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(4 * 2 ** 30))
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import pytest  # noqa: E402

from maxlm.layers import te_installed  # noqa: E402

TE_REASON = "Transformer Engine is not installed (bash scripts/setup.sh installs it)"


# A wrapper: the marks are added before pytest-xdist's worker hook turns xdist_group marks into node-id
# suffixes (--dist loadgroup, `make test`), and checked after it.
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
  loadgroup = config.getoption("loadgroup", default=False)  # set in xdist workers under --dist loadgroup
  if loadgroup:
    for item in items:
      _group_by_shared_fixture(item)
  yield
  if loadgroup:
    _check_groups_applied(items)
  if te_installed():
    return
  skip = pytest.mark.skip(reason=TE_REASON)
  for item in items:
    if "te" in item.keywords:
      item.add_marker(skip)


def _group_by_shared_fixture(item) -> None:
  """Tests that use a module-scoped fixture of their own module (a reference run, a trained checkpoint)
  run on one xdist worker: `make test` (--dist loadgroup) would otherwise spread them over both workers
  and each would make the fixture again (10 to 20 s of CPU apiece for the heavy ones, measured). An
  explicit xdist_group mark wins."""
  if item.get_closest_marker("xdist_group") or not hasattr(item, "_fixtureinfo"):
    return
  module = getattr(item, "module", None)
  if module is None:
    return
  for defs in item._fixtureinfo.name2fixturedefs.values():
    if defs[-1].scope == "module" and getattr(defs[-1].func, "__module__", None) == module.__name__:
      item.add_marker(pytest.mark.xdist_group(module.__name__))
      return


def _check_groups_applied(items) -> None:
  """pytest-xdist 3.8 marks a group by renaming the node id, which pytest 9.2 ignores: the groups then
  silently vanish (both workers repeat the shared runs and run SLURM jobs side by side). Say so in the
  warnings summary instead (a worker cannot stop the run with a readable message)."""
  for item in items:
    if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rsplit("]", 1)[-1]:
      warnings.warn(pytest.PytestWarning(
          f"pytest-xdist did not apply the xdist_group mark of {item.nodeid} under --dist loadgroup (pytest "
          "9.2 with pytest-xdist 3.8: pytest-dev/pytest-xdist#1386); install pytest<9.2 (make setup)"))
      return


# Where an xdist worker dies or hangs. pytest's faulthandler writes a crashed worker's thread stacks to its
# stderr, which the controller cuts off at "node down" (a fresh clone once lost the main thread's stack that
# way), and a test stuck in C++ prints nothing until pytest-timeout ends it. So each worker writes, to its own
# file in a directory the controller made: the test it starts (one line each), the stacks of every thread on a
# fatal signal (abort, segfault), and the stacks again at 80% of a test's timeout (pyproject.toml), before
# pytest-timeout ends the stuck test. The controller prints the files that hold a crash or a timeout in its summary.
_FAULTS = "MAXLM_TEST_FAULT_DIR"
_FAULT_MARKS = ("Fatal Python error", "Timeout (")


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin, whose stderr handler this one replaces
def pytest_configure(config):
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker is None:
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None):
      os.environ[_FAULTS] = tempfile.mkdtemp(prefix="maxlm-test-faults-")  # the workers inherit it
    return
  if _FAULTS in os.environ:
    config._maxlm_faults = open(os.path.join(os.environ[_FAULTS], f"{worker}-{os.getpid()}.log"), "w")
    faulthandler.enable(file=config._maxlm_faults, all_threads=True)


def _timeout_s(request) -> float:
  """The test's pytest-timeout limit in seconds (0: none, or pytest-timeout not installed)."""
  marker = request.node.get_closest_marker("timeout")
  if marker and marker.args:
    return float(marker.args[0])
  try:
    return float(request.config.getini("timeout") or 0)
  except ValueError:  # no such ini key: pytest-timeout is not installed
    return 0.0


@pytest.fixture(autouse=True)
def _fault_record(request):
  out = getattr(request.config, "_maxlm_faults", None)
  if out is None:
    yield
    return
  out.write(f"test: {request.node.nodeid}\n")
  out.flush()
  limit = _timeout_s(request)
  if limit:
    faulthandler.dump_traceback_later(0.8 * limit, file=out)  # before pytest-timeout ends the worker
  yield
  faulthandler.cancel_dump_traceback_later()


def pytest_terminal_summary(terminalreporter):
  folder = os.environ.get(_FAULTS)
  if not folder or os.environ.get("PYTEST_XDIST_WORKER") or not os.path.isdir(folder):
    return
  for name in sorted(os.listdir(folder)):
    text = open(os.path.join(folder, name), errors="replace").read()
    if any(m in text for m in _FAULT_MARKS):
      at = text.rfind("test: ", 0, min(text.find(m) for m in _FAULT_MARKS if m in text))
      terminalreporter.write_sep("=", f"worker {name}: crashed or stuck")
      terminalreporter.write_line(text[max(at, 0):][:20000])
  shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fake_fp8_gpu(monkeypatch):
  """Make TE's compute-capability probe report a Hopper GPU so FP8 recipes run on CPU.

  TE then takes its pure-JAX FP8 path (NVTE_JAX_CUSTOM_CALLS=false), which simulates E4M3/E5M2
  quantization with per-tensor scales exactly.
  """
  from maxlm.layers.te_env import import_te
  import_te()
  import transformer_engine_jax
  from transformer_engine.jax.quantize import device_utils, helper
  monkeypatch.setattr(transformer_engine_jax, "get_device_compute_capability", lambda gpu_id=0: 90)
  device_utils.get_device_compute_capability.cache_clear()
  monkeypatch.setattr(helper, "_is_scaling_mode_supported", None)
  monkeypatch.setattr(helper, "_reason_for_no_scaling_mode", None, raising=False)
  yield
  device_utils.get_device_compute_capability.cache_clear()


@pytest.fixture(autouse=True)
def _warm_start_off_after_each_test():
  """compile.warm_start's store is process-wide (maxlm/runtime/warm_start.py): an in-process run configures it, and a
  later test in the same worker must not find that run's kept plans and executables."""
  yield
  from maxlm.runtime import warm_start  # lazy on purpose: it imports jax, once the first test has run
  warm_start.configure(None, False)
