"""The persistent compilation cache (maxlm/runtime/compile_cache.py), the startup breakdown (maxlm/runtime/startup.py) and
`--compile-only`, in subprocesses on CPU: each run is a fresh process, as a restart is.

The runs use their own cache directory (compile.cache_dir, which wins over the suite's JAX_COMPILATION_CACHE_DIR)
and no JAX_COMPILATION_CACHE_MAX_SIZE, so maxlm's own file cache (atomic writes) is the one under test;
compile.min_compile_s=0 keeps every program, however fast this machine compiles it. compile.warm_start=false:
JAX's cache alone is under test here (a warm start would load the executables without asking it;
tests/test_runtime_warm_start.py).
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from maxlm.config import CompileConfig, ConfigError
from maxlm.runtime import compile_cache

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.backend=flax", "model.vocab_size=128", "data.type=synthetic",
        "data.seq_len=16", "data.global_batch_size=4", "train.steps=2", "train.log_every=1",
        "train.eval_every=0", "checkpoint.enabled=false"]
HIT = "maxlm: compilation cache: the train step came from the cache (hit"
MISS = "maxlm: compilation cache: the train step was compiled (miss"
PARTS = ("backend_s", "plan_s", "init_s", "lower_s", "compile_s", "first_run_s")


def _env() -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE_MAX_SIZE")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu")
  return env


def _cmd(out: Path, cache: Path, *args: str) -> list[str]:
  return [sys.executable, "-m", "maxlm.train", f"output_dir={out}", f"compile.cache_dir={cache}",
          "compile.min_compile_s=0", "compile.warm_start=false", *args]


def _train(out: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(_cmd(out, cache, *TINY, *args), cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=600)


def _first_row(run_dir: Path) -> dict:
  return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def _entries_whole(cache: Path) -> list[str]:
  """Every entry's name, after checking that it decompresses (JAX's zlib format, its zstandard absent here)."""
  names = sorted(p.name for p in cache.glob("*-cache"))
  for name in names:
    zlib.decompress((cache / name).read_bytes())  # raises on a truncated or mixed entry
  return names


def _train_clocked(out: Path, cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
  """`_train`, with JAX's own compile log on (JAX_LOG_COMPILES: every trace, lowering and XLA compile timed by JAX, on
  stderr), and the seconds from launching the process to reading its first-step line: the test's own clock."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(_cmd(out, cache, *TINY, *args), cwd=ROOT, env={**_env(), "JAX_LOG_COMPILES": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  err: list[str] = []
  reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
  reader.start()  # a full stderr pipe must not stall the child while stdout is read here
  lines, seen = [], None
  for line in proc.stdout:
    lines.append(line)
    if seen is None and line.startswith("maxlm: first step"):
      seen = time.perf_counter() - t0
  proc.wait(timeout=600)
  reader.join(60)
  assert seen is not None, ("".join(lines), "".join(err)[-3000:])
  return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), "".join(err)), seen


def _jax_times(stderr: str) -> tuple[float, float]:
  """(trace + lowering, XLA compile) seconds of the train step (`jit(step)`, its first compile) as JAX logs them."""
  trace = float(re.search(r"Finished tracing step for jit in ([\d.e-]+) sec", stderr)[1])
  lower = float(re.search(r"Finished jaxpr to MLIR module conversion jit\(step\) in ([\d.e-]+) sec", stderr)[1])
  compiled = re.search(r"Finished XLA compilation of jit\(step\) in ([\d.e-]+) sec", stderr)
  return trace + lower, float(compiled[1]) if compiled else 0.0


def test_a_second_run_loads_the_train_step_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  first, first_seen = _train_clocked(tmp_path, cache, "run_name=a")
  assert first.returncode == 0, first.stderr
  second, second_seen = _train_clocked(tmp_path, cache, "run_name=b")
  assert second.returncode == 0, second.stderr
  assert MISS in first.stdout and HIT not in first.stdout, first.stdout
  assert HIT in second.stdout, second.stdout
  cold, warm = _first_row(tmp_path / "a"), _first_row(tmp_path / "b")
  assert not cold["compile_cache_hit"] and warm["compile_cache_hit"]
  assert warm["compile_cache_hits"] >= 1 and cold["compile_cache_hits"] == 0
  assert warm["compile_s"] < 0.5 * cold["compile_s"], (cold["compile_s"], warm["compile_s"])
  # The time to the first step against the test's own clock: the process starts after the launch and prints its
  # line after the first step's end, so startup_s is at most the launch-to-line time (+ 0.01 s: the kernel records
  # a process's start in clock ticks of 10 ms), and at least that time less the fork and the pipe, well under
  # 1.5 s (a startup_s that left out the imports, 2-5 s of them, would be below it). The parts against JAX's own
  # timing of the train step: trace and lower at least JAX's tracing and lowering, compile at least XLA's compile.
  for row, seen, run in ((cold, first_seen, first), (warm, second_seen, second)):
    assert all(row[k] >= 0 for k in PARTS) and row["backend_s"] > 0
    assert seen - 1.5 <= row["startup_s"] <= seen + 0.01, (row["startup_s"], seen)
    assert row["first_step_s"] == row["startup_s"]
    jax_lower, jax_compile = _jax_times(run.stderr)
    assert row["lower_s"] >= jax_lower and row["compile_s"] >= jax_compile, (row, jax_lower, jax_compile)
  assert _jax_times(first.stderr)[1] > 0  # JAX timed the cold compile (a hit times its load from the cache)
  line = next(ln for ln in second.stdout.splitlines() if ln.startswith("maxlm: first step 1 done"))
  for name in ("imports and backend", "init", "trace and lower", "compile", "first run"):
    assert f"{name} " in line, line
  assert f"in {cache} (atomic writes)" in second.stdout  # maxlm's file cache, not JAX's own
  assert _entries_whole(cache) and not list(cache.glob(".*.tmp"))


def test_two_runs_writing_one_cache_at_once_leave_it_usable(tmp_path):
  cache = tmp_path / "cache"
  procs = [subprocess.Popen(_cmd(tmp_path, cache, *TINY, f"run_name={name}"), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
  assert _entries_whole(cache) and not list(cache.glob(".*.tmp"))
  third = _train(tmp_path, cache, "run_name=c")
  assert third.returncode == 0, third.stderr
  assert HIT in third.stdout and "Error reading persistent compilation cache" not in third.stderr, third.stdout


# A model whose state is large (fp32 parameters + Adam's two moments: 12 bytes per parameter; the untied
# embedding and LM head alone are 2 x 131072 x 1024 = 268M parameters, 3.2 GB) but which compiles in seconds.
WIDE = ["model.vocab_size=131072", "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=8",
        "model.head_dim=128", "model.ffn_dim=1024", "model.n_layers=1", "model.backend=flax",
        "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=2", "run_name=wide"]
WIDE_STATE_BYTES = 12 * 2 * 131072 * 1024


def test_compile_only_allocates_no_state_writes_no_run_dir_and_warms_the_cache(tmp_path):
  out, cache = tmp_path / "out", tmp_path / "cache"
  # a fresh parent whose only child is the run: RUSAGE_CHILDREN is then that run's peak RSS alone
  probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
  r = subprocess.run([sys.executable, "-c", probe, *_cmd(out, cache, *WIDE, "--compile-only")], cwd=ROOT,
                     env=_env(), capture_output=True, text=True, timeout=600)
  code, peak_kib = map(int, r.stdout.strip().splitlines()[-1].split())
  assert code == 0, r.stderr
  assert peak_kib * 1024 < WIDE_STATE_BYTES / 2, (peak_kib, r.stdout)
  assert "maxlm: --compile-only: " in r.stdout and "compiled in " in r.stdout and "XLA's memory per device" in r.stdout
  assert MISS in r.stdout, r.stdout
  assert not out.exists()  # nothing in (or of) the run directory
  assert _entries_whole(cache)


def test_compile_only_then_the_run_starts_warm(tmp_path):
  out, cache = tmp_path / "out", tmp_path / "cache"
  ahead = subprocess.run(_cmd(out, cache, *TINY, "run_name=r", "--compile-only"), cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600)
  assert ahead.returncode == 0, ahead.stderr
  assert MISS in ahead.stdout and not out.exists()
  run = _train(out, cache, "run_name=r")
  assert run.returncode == 0, run.stderr
  assert HIT in run.stdout, run.stdout  # the same executable: its cache key matched


def test_a_cache_dir_under_a_regular_file_is_one_line_exit_2(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  r = _train(tmp_path / "out", blocker / "cache", "run_name=r")
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("maxlm: error: compile.cache_dir: ") and str(blocker) in lines[0]
  assert not (tmp_path / "out").exists() and blocker.read_text() == ""


def test_default_dir_without_jax_setting_and_cache_off(tmp_path):
  env = {k: v for k, v in _env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # the per-user default: $XDG_CACHE_HOME/maxlm/xla

  def train(*args):
    return subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp_path}", *TINY,
                           "compile.min_compile_s=0", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
  r = train("run_name=off", "compile.cache=false")
  assert r.returncode == 0, r.stderr
  assert "maxlm: compilation cache off: the train step compiled in " in r.stdout, r.stdout
  assert not (tmp_path / "xdg").exists()
  row = _first_row(tmp_path / "off")
  assert row["compile_cache_hit"] is False and row["compile_cache_requests"] == 0
  r = train("run_name=on")
  assert r.returncode == 0, r.stderr
  assert f"in {tmp_path / 'xdg' / 'maxlm' / 'xla'} (atomic writes)" in r.stdout, r.stdout
  assert _entries_whole(tmp_path / "xdg" / "maxlm" / "xla")


def test_default_dir_order(tmp_path):
  home = Path.home()
  assert compile_cache.default_dir({}) == home / ".cache" / "maxlm" / "xla"
  assert compile_cache.default_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "maxlm" / "xla"
  env = {"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
  assert compile_cache.default_dir(env) == tmp_path / "jax"


def test_unusable_dirs_are_config_errors_before_anything_is_created(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(ConfigError, match="is not a directory"):
    compile_cache.configure(CompileConfig(cache_dir=str(tmp_path / "file" / "a" / "b")))
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    if os.access(ro, os.W_OK):
      pytest.skip("running as root: a read-only directory is writable")
    with pytest.raises(ConfigError, match="is not writable"):
      compile_cache.configure(CompileConfig(cache_dir=str(ro / "cache")))
  finally:
    ro.chmod(0o700)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"] and not list(ro.iterdir())


def test_atomic_file_cache_round_trip_and_no_overwrite(tmp_path):
  c = compile_cache.AtomicFileCache(tmp_path / "c")
  assert c.get("k") is None
  c.put("k", b"one")
  c.put("k", b"two")  # an entry, once written, stays (JAX's rule: the same key is the same program)
  assert c.get("k") == b"one"
  names = sorted(p.name for p in (tmp_path / "c").iterdir())
  assert names == ["k-atime", "k-cache"]  # JAX's names: its size-limited cache can share the directory
  assert len((tmp_path / "c" / "k-atime").read_bytes()) == 8
