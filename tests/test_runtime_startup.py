"""maxlm/runtime/startup.py: `begin`, the one start sequence of the commands, and train.deterministic's cache rule.

Each run is a fresh process (the settings act before the backend starts), on CPU, with its own cache directory
and the default compile.min_compile_s (JAX's 1 s, which most of a tiny model's programs compile under), and
compile.warm_start=false: JAX's cache alone is under test (tests/test_runtime_warm_start.py has the warm start).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from maxlm.config import load_config
from maxlm.runtime import env as runtime_env
from maxlm.runtime import startup, xla_presets

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.backend=flax", "model.vocab_size=128", "data.type=synthetic",
        "data.seq_len=16", "data.global_batch_size=4", "train.steps=2", "train.log_every=1",
        "train.eval_every=0", "checkpoint.enabled=false"]


def _train(tmp: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu", **env_extra)
  return subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp}",
                         f"compile.cache_dir={tmp / 'cache'}", "compile.warm_start=false", *TINY, *args],
                        cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def _first_row(run_dir: Path) -> dict:
  return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def test_deterministic_runs_keep_every_program_so_a_second_start_compiles_nothing(tmp_path):
  """train.deterministic=true: the first start keeps every program it compiles, so an identical second start
  loads all of them (hits == compile requests) and runs the first one's binaries. Without the rule the default
  threshold (1 s) leaves this tiny model's sub-second programs out and the second start compiles them again."""
  first = _train(tmp_path, "run_name=a", "train.deterministic=true")
  assert first.returncode == 0, first.stderr
  assert f"maxlm: train.deterministic=true: {startup.DETERMINISTIC_CACHE}" in first.stdout, first.stdout
  assert "JAX_COMPILATION_CACHE_MAX_SIZE" not in first.stdout  # JAX's default cache: nothing is evicted
  second = _train(tmp_path, "run_name=b", "train.deterministic=true")
  assert second.returncode == 0, second.stderr
  cold, warm = _first_row(tmp_path / "a"), _first_row(tmp_path / "b")
  assert cold["compile_cache_hits"] == 0 and cold["compile_cache_requests"] >= 2
  assert warm["compile_cache_requests"] == cold["compile_cache_requests"]
  assert warm["compile_cache_hits"] == warm["compile_cache_requests"], warm


def test_deterministic_without_the_cache_says_what_a_restart_risks(tmp_path):
  r = _train(tmp_path, "run_name=a", "train.deterministic=true", "compile.cache=false")
  assert r.returncode == 0, r.stderr
  assert f"maxlm: train.deterministic=true with {startup.DETERMINISTIC_NO_CACHE}" in r.stdout, r.stdout


def test_deterministic_with_a_size_limited_cache_says_what_a_restart_risks(tmp_path):
  """A size-limited cache (JAX_COMPILATION_CACHE_MAX_SIZE, as the test suite's own) evicts entries: a restart
  may compile the first start's program again, so the run says so."""
  r = _train(tmp_path, "run_name=a", "train.deterministic=true", JAX_COMPILATION_CACHE_MAX_SIZE=str(3 * 10 ** 9))
  assert r.returncode == 0, r.stderr
  line = "maxlm: train.deterministic=true with " + startup.DETERMINISTIC_EVICTION.format(limit="3.0 GB")
  assert line in r.stdout, r.stdout
  r = _train(tmp_path, "run_name=b", "train.steps=1", JAX_COMPILATION_CACHE_MAX_SIZE=str(3 * 10 ** 9))
  assert r.returncode == 0 and "JAX_COMPILATION_CACHE_MAX_SIZE" not in r.stdout  # only deterministic runs care


def test_the_process_start_is_read_from_adjacent_clocks(monkeypatch):
  """process_start = the clock now less the process's age at that same moment. An age that takes 0.2 s to read
  (a loaded machine: the /proc read, a descheduled process) is an age at the end of those 0.2 s, so the clock is
  read after it; read before (the old order), the start came out 0.2 s early, and the time to the first step long
  (a CI failure: 1.8 ms above the test's own clock)."""
  def slow_age():
    time.sleep(0.2)
    return 5.0  # seconds old, as of now: the moment it returns
  monkeypatch.setattr(startup, "process_age_s", slow_age)
  before = time.perf_counter()
  t0 = startup.process_start()
  after = time.perf_counter()
  assert before + 0.2 - 5.0 <= t0 <= after - 5.0


def test_begin_on_a_gpu_raises_xlas_pinned_host_pool(monkeypatch):
  """startup.begin (the train command's start, before the backend) sets the pinned host pool's cap on a GPU from
  this node's RAM and the processes on it (both stand-ins here: 512 GiB, 4 processes): 0.9 x 512 / 4 = 115.2 ->
  115 GiB."""
  for var in (runtime_env.HOST_POOL_VAR, *runtime_env.FRACTION_VARS, "XLA_FLAGS"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(xla_presets, "detect_gpu", lambda: ("NVIDIA H200", "9.0"))
  monkeypatch.setattr(startup, "host_memory_bytes", lambda: 512 * 2**30)
  monkeypatch.setattr(startup, "processes_on_node", lambda environ: 4)
  lines = startup.begin(load_config(["config=default.yml"]), compile_cache=False)
  assert os.environ[runtime_env.HOST_POOL_VAR] == "115"
  assert any(f"{runtime_env.HOST_POOL_VAR}=115" in line for line in lines)
