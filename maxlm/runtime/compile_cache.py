"""JAX's persistent compilation cache, on by default (`compile:` in the config; docs/configuration.md).

`configure(cfg.compile)` runs at process start, before the first compile (maxlm/runtime/env.py `start`). It sets
JAX's cache directory, and with it XLA's GPU autotuning cache (JAX's `jax_persistent_cache_enable_xla_caches`
default puts the per-fusion autotune results, the GEMM algorithm choices among them, under
`<dir>/xla_gpu_per_fusion_autotune_cache_dir`).

Several processes and hosts. JAX itself decides who writes: an executable is written by process 0 only
(`jax._src.compiler._cache_write`: "Only write cache entries from the first process. Otherwise we create
problems with contention for writes on some filesystems"), and XLA's autotune cache is in UPDATE mode on
process 0 and READ mode on the others (`get_compile_options`); every process reads. Cache keys leave out
the process (the GPU device assignment is stripped), so process 1 finds what process 0 wrote. maxlm keeps
that rule. What JAX leaves open is two jobs that are each process 0 (two runs of a sweep, a requeued job
and a `--compile-only` beside it) writing one key at once: JAX's file cache writes the entry in place, so a
reader can find half an entry, and a writer killed mid-write leaves a truncated entry that is never
rewritten (the key exists). maxlm therefore hands JAX a file cache whose writes are atomic: the entry is
written to a temporary file in the directory and renamed into place (atomic on POSIX filesystems, NFS and
Lustre alike), so a reader sees a whole entry or none. It keeps JAX's file names (`<key>-cache`, and the
`<key>-atime` file JAX's own size-limited cache reads), so either can use the directory. When
`JAX_COMPILATION_CACHE_MAX_SIZE` is set, JAX's own size-limited cache is left in place (its file lock keeps
writers apart and it evicts the least recently used entries); the directory otherwise grows by one entry per
distinct program and may be removed at any time no run is using it.

Thresholds. Programs that compiled in under `compile.min_compile_s` are not kept (default JAX's: 1 s, or
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS). What costs a restart its time are the train and eval steps and
the state's initialization (seconds to minutes on a GPU); the many sub-second helpers would add a file each
for little. The entry-size threshold stays JAX's (none): size says nothing about what compiling cost.
"""

from __future__ import annotations

import collections
import os
import time
import uuid
from pathlib import Path

import jax
from jax._src import compilation_cache as jax_cache  # private: `_install` replaces its file cache
from jax.experimental.compilation_cache import compilation_cache as public_cache

from maxlm.config import CompileConfig, ConfigError

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
HITS = "/jax/compilation_cache/cache_hits"
REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"  # every compile with the cache on
_SUFFIX, _ATIME = "-cache", "-atime"  # JAX's file names (jax/_src/lru_cache.py)
_STALE_TMP_S = 3600  # a temporary file this old belongs to a writer that died


def default_dir(env=os.environ) -> Path:
  """The directory when compile.cache_dir is "" and JAX has none set (JAX reads JAX_COMPILATION_CACHE_DIR as
  it is imported; a program embedding maxlm may also have set jax_compilation_cache_dir): the variable,
  else $XDG_CACHE_HOME/maxlm/xla, else ~/.cache/maxlm/xla (per user: the cache is trusted code)."""
  if env.get(ENV_DIR):
    return Path(env[ENV_DIR]).expanduser()
  base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(base).expanduser() / "maxlm" / "xla"


def _check_dir(path: Path) -> None:
  """ConfigError unless `path` is, or can be made, a writable directory (nothing is created here)."""
  probe = path
  while not probe.exists():
    if probe.is_symlink() or probe.parent == probe:
      break
    probe = probe.parent
  why = None
  if not probe.is_dir():
    why = f"{probe} is not a directory"
  elif not os.access(probe, os.W_OK | os.X_OK):
    why = f"{probe} is not writable"
  if why:
    raise ConfigError(f"compile.cache_dir: cannot use {path} as the compilation cache ({why}); set "
                      f"compile.cache_dir to a writable directory, or compile.cache=false")


class AtomicFileCache:
  """JAX's cache interface over a directory, each entry written to a temporary file and renamed into place."""

  def __init__(self, path: Path):
    self._path = self.path = Path(path)
    self.path.mkdir(parents=True, exist_ok=True)

  def get(self, key: str) -> bytes | None:
    try:
      return (self.path / f"{key}{_SUFFIX}").read_bytes()
    except FileNotFoundError:
      return None

  def put(self, key: str, value: bytes) -> None:
    target = self.path / f"{key}{_SUFFIX}"
    if target.exists():
      return
    write_atomic(self.path / f"{key}{_ATIME}", time.time_ns().to_bytes(8, "little"))
    write_atomic(target, value)

  def clear(self) -> None:  # part of JAX's interface; maxlm never clears a shared cache
    raise NotImplementedError("remove the cache directory instead")


def write_atomic(target: Path, data: bytes) -> None:
  """`data` into `target` through a temporary file renamed into place: a reader sees all of it or none."""
  tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
  try:
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, target)
  finally:
    tmp.unlink(missing_ok=True)


def _remove_stale_tmp(path: Path) -> None:
  now = time.time()
  for p in path.glob(".*.tmp"):
    try:
      if now - p.stat().st_mtime > _STALE_TMP_S:
        p.unlink()
    except OSError:
      pass  # another process removed it first


# Why JAX's private `_cache` is replaced rather than set through a public API: JAX (0.10 and 0.11) has none that
# supplies the cache's implementation. `jax_compilation_cache_dir` selects JAX's own LRUCache, whose `put` writes the
# entry in place and its `-atime` sidecar in a second write, not atomically (jax-ml/jax#39880: a write cut between
# the two leaves an orphan; #39883 made the eviction tolerate it, not the write atomic). This replacement goes once
# JAX's cache writes atomically or takes a cache object of the caller's; until then `_install` checks for every
# internal it touches and falls back to JAX's own cache where one is missing.
def _install(path: Path) -> bool:
  """Hand JAX an AtomicFileCache over `path`; False where JAX's internals differ (JAX's own cache then)."""
  needed = ("_cache", "_cache_initialized", "_get_cache", "_initialize_cache", "reset_cache")
  if not all(hasattr(jax_cache, a) for a in needed):
    return False
  jax_cache.reset_cache()
  jax_cache._cache, jax_cache._cache_initialized = AtomicFileCache(path), True
  return True


class _Counter:
  """Counts JAX's compilation-cache events in this process (one listener, registered once)."""

  def __init__(self):
    self.counts = collections.Counter()
    self.registered = False

  def __call__(self, event: str, **_) -> None:
    if event in (HITS, REQUESTS):
      self.counts[event] += 1

  def register(self) -> None:
    if not self.registered:
      jax.monitoring.register_event_listener(self)
      self.registered = True

  def snapshot(self) -> tuple[int, int]:
    return self.counts[HITS], self.counts[REQUESTS]


COUNTER = _Counter()
_active: dict = {}  # what configure() set: dir, min_compile_s


def configure(c: CompileConfig) -> str:
  """Apply `compile:` before the first compile; returns the line for the log."""
  COUNTER.register()
  _active.clear()
  if not c.cache:
    jax.config.update("jax_enable_compilation_cache", False)
    return "compilation cache off (compile.cache=false)"
  if not jax.config.jax_enable_compilation_cache:
    return "compilation cache off (JAX_ENABLE_COMPILATION_CACHE=false in the environment)"
  path = Path(c.cache_dir or jax.config.jax_compilation_cache_dir or default_dir()).expanduser()
  _check_dir(path)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"compile.cache_dir: cannot create {path} ({e.strerror or e})") from None
  if c.min_compile_s >= 0:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(c.min_compile_s))
  if jax.config.jax_compilation_cache_dir != str(path):
    public_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_enable_compilation_cache", True)
  how = "JAX's size-limited cache" if jax.config.jax_compilation_cache_max_size != -1 else "JAX's file cache"
  if jax.config.jax_compilation_cache_max_size == -1 and _install(path):
    how = "atomic writes"
  _remove_stale_tmp(path)  # any process: only what a dead writer left an hour ago
  _active.update(dir=path, how=how, min_compile_s=jax.config.jax_persistent_cache_min_compile_time_secs)
  return f"compilation cache {path} ({how}; programs compiled in {_active['min_compile_s']:g} s or more)"


def size_limit() -> int | None:
  """Bytes JAX's cache may hold before it evicts its least recently used entries; None while the cache is off
  or unlimited (JAX's default)."""
  limit = jax.config.jax_compilation_cache_max_size
  return limit if _active and limit != -1 else None


def directory() -> Path | None:
  """The cache directory configure() set; None while the cache is off."""
  return _active.get("dir")


def size_on_disk(path: Path) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.stat(os.path.join(root, name)).st_size
      except OSError:
        pass  # removed meanwhile
  return total


def human(n: int) -> str:
  for unit in ("B", "kB", "MB", "GB"):
    if n < 1000 or unit == "GB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1000
  return ""


def step_line(hit: bool, compile_s: float, loaded: bool = False, background_s: float | None = None) -> str:
  """The first step's cache line: whether the train step came from the cache (or, `loaded`, as an executable
  kept by an earlier start: maxlm/runtime/warm_start.py, `background_s` when it was loaded ahead), the counts, the
  size on disk."""
  if not _active:
    return f"compilation cache off: the train step compiled in {compile_s:.1f} s"
  hits, requests = COUNTER.snapshot()
  if loaded and background_s is not None:
    what = (f"the train step's executable, kept by an earlier start of this run, loaded in the background in "
            f"{background_s:.1f} s, {compile_s:.1f} s of it waited for (warm start: nothing traced or compiled)")
  elif loaded:
    what = (f"the train step's executable, kept by an earlier start of this run, loaded in {compile_s:.1f} s "
            "(warm start: nothing traced or compiled)")
  elif hit:
    what = f"the train step came from the cache (hit, loaded in {compile_s:.1f} s)"
  elif compile_s >= _active["min_compile_s"]:
    what = f"the train step was compiled (miss, {compile_s:.1f} s) and written to the cache"
  else:
    what = (f"the train step was compiled (miss, {compile_s:.1f} s), too fast to keep (under "
            f"compile.min_compile_s={_active['min_compile_s']:g})")
  return (f"compilation cache: {what}; {hits} of {requests} programs so far from the cache; "
          f"{human(size_on_disk(_active['dir']))} in {_active['dir']} ({_active['how']})")


def stats() -> dict:
  """The cache's counts for metrics.jsonl."""
  hits, requests = COUNTER.snapshot()
  return {"compile_cache_hits": hits, "compile_cache_requests": requests}
