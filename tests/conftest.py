"""Test setup: 8 simulated CPU devices (set before JAX is imported), TE helpers and markers."""

import atexit
import os
import shutil
import tempfile

# On CPU, XLA's LLVM backend at optimization level 0: the suite is mostly compiles of tiny programs, and level
# 0 halves their CPU time (tests/test_loss_scale.py: 75 s of CPU instead of 159 s, measured). It changes how
# the generated code runs, not the HLO: every tolerance here is derived from the arithmetic, not from one
# compiler's rounding, and the goldens recorded at the default level (HF logits, convergence bands) hold.
# Subprocesses started by the tests inherit it. On the GPU (MAXLM_TEST_GPU=1) the kernels keep level 3.
_FAST_CPU = "" if os.environ.get("MAXLM_TEST_GPU") == "1" else " --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + _FAST_CPU)
os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("MAXLM_TEST_GPU") != "1" else "")

# One XLA compilation cache for the whole run, made empty here and removed when the run ends: the suite trains
# the same tiny models many times, in-process and in subprocesses (CLI, SLURM, mpirun), and a subprocess run
# that finds its programs compiled takes about half the CPU (18 s -> 10 s measured for a 3-step tiny run).
# Nothing is carried from an earlier run. The size limit turns on JAX's file lock, which keeps concurrent
# writers (xdist workers, the processes of a launch) apart. The workers and every subprocess inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="maxlm-test-xla-cache-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1",
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(4 * 2 ** 30))
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import pytest  # noqa: E402

from maxlm.layers import te_installed  # noqa: E402

TE_REASON = "Transformer Engine is not installed (bash scripts/setup.sh installs it)"


def pytest_collection_modifyitems(config, items):
  if te_installed():
    return
  skip = pytest.mark.skip(reason=TE_REASON)
  for item in items:
    if "te" in item.keywords:
      item.add_marker(skip)


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
