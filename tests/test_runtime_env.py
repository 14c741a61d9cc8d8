"""maxlm/runtime/env.py: XLA:CPU's thread pool for simulated devices (train.deterministic's settings are tested in
tests/test_runtime_startup.py and tests/test_gpu.py)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from maxlm.runtime import env as runtime

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh(monkeypatch):
  """size_cpu_pool as in a process whose JAX backend has not started (this worker's has)."""
  monkeypatch.setattr(runtime, "backend_started", lambda: False)


@pytest.mark.parametrize("environ, devices", [
  ({}, 1),
  ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 8),
  ({"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4"}, 4),
  ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_force_host_platform_device_count=6"}, 6),
  ({"XLA_FLAGS": "--xla_force_host_platform_device_count=x"}, 1),
  ({"JAX_NUM_CPU_DEVICES": "16"}, 16),
  ({"JAX_NUM_CPU_DEVICES": "-1"}, 1),
])
def test_simulated_cpu_devices_are_read_from_xla_flags_and_jax(environ, devices):
  assert runtime.simulated_cpu_devices(environ) == devices


def test_the_pool_gets_four_threads_per_simulated_device(fresh, monkeypatch):
  monkeypatch.setattr(os, "cpu_count", lambda: 2)
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  line = runtime.size_cpu_pool(environ)
  assert environ["PJRT_NPROC"] == "32"  # 4 x 8: twice the 2 x 8 - 1 threads one dispatching thread can block
  assert line.startswith("PJRT_NPROC=32:") and "8 simulated devices" in line


def test_a_machine_with_more_cores_keeps_them(fresh, monkeypatch):
  monkeypatch.setattr(os, "cpu_count", lambda: 64)
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  runtime.size_cpu_pool(environ)
  assert environ["PJRT_NPROC"] == "64"


@pytest.mark.parametrize("environ", [
  {},  # one CPU device: no in-process collectives
  {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
  {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "12"},  # a size you set wins
  {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "12"},
])
def test_nothing_is_set_where_it_is_not_needed_or_already_chosen(fresh, environ):
  before = dict(environ)
  assert runtime.size_cpu_pool(environ) is None
  assert environ == before


def test_nothing_is_set_once_the_backend_has_started():
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  jax.devices()
  assert runtime.backend_started()  # this worker's JAX is up: XLA has read its pool size
  assert runtime.size_cpu_pool(environ) is None and "PJRT_NPROC" not in environ


_THREADS_AFTER_START = """
import os, sys
from maxlm.runtime import env as runtime
runtime.size_cpu_pool()
import jax, jax.numpy as jnp
jax.jit(lambda x: x * 2)(jnp.ones(8)).block_until_ready()
print(len(os.listdir("/proc/self/task")), os.environ.get("PJRT_NPROC"))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_xla_starts_the_larger_pool():
  """XLA itself reads the size (a jaxlib that stopped reading PJRT_NPROC fails here): the process maxlm sized
  has at least the 32 - 8 more pool threads than one left at XLA's minimum of one thread per device."""
  def threads(pool: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    if pool:
      env["PJRT_NPROC"] = pool
    out = subprocess.run([sys.executable, "-c", _THREADS_AFTER_START], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), out[1]
  sized, minimal = threads(None), threads("1")
  assert sized[1] == str(max(os.cpu_count() or 1, 32))
  assert sized[0] - minimal[0] >= int(sized[1]) - 8, (sized, minimal)


@pytest.mark.parametrize("env, value, gpu, expect, line", [
    ({}, 0.0, True, "0.95", "auto on an NVIDIA GPU"),
    ({}, 0.0, False, None, None),
    ({}, 0.9, False, "0.9", "set"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}, 0.0, True, None, None),
    ({"XLA_CLIENT_MEM_FRACTION": "0.8"}, 0.9, True, "0.8", "your environment sets 0.8"),
])
def test_mem_fraction_before_the_backend(monkeypatch, env, value, gpu, expect, line):
  for var in runtime.FRACTION_VARS:
    monkeypatch.delenv(var, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  got = runtime.apply_mem_fraction(value, gpu)
  assert os.environ.get("XLA_CLIENT_MEM_FRACTION") == expect
  assert (got is None) == (line is None) and (line is None or line in got)


GIB = 2**30


@pytest.mark.parametrize("env, host, processes, gpu, expect", [
    ({}, 128 * GIB, 1, True, "115"),  # 0.9 x 128 = 115.2 GiB: the H200 machine's RAM, one process
    ({}, 2048 * GIB, 8, True, "230"),  # a DGX node's 2 TiB over 8 processes: 0.9 x 256 = 230.4
    ({}, 64 * GIB, 1, True, None),  # 57.6 GiB is below XLA's own 64: XLA's default stays
    ({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "32"}, 128 * GIB, 1, True, "32"),  # yours wins
    ({}, 128 * GIB, 1, False, None),  # no GPU: no pinned pool
    ({}, None, 1, True, None),  # RAM unknown
])
def test_host_pool_before_the_backend(monkeypatch, env, host, processes, gpu, expect):
  """XLA:GPU caps its pinned host pool (optim.offload's state) at 64 GiB by default: the 8B's float32 host state
  (89.7 GiB) failed under it on the H200. The cap becomes 90% of the node's RAM over its processes."""
  monkeypatch.delenv(runtime.HOST_POOL_VAR, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  line = runtime.apply_host_pool(host, processes, gpu)
  assert os.environ.get(runtime.HOST_POOL_VAR) == expect
  assert (line is None) == (expect is None or bool(env))
  if line:
    assert f"{runtime.HOST_POOL_VAR}={expect}" in line and f"over {processes} process" in line
