"""What a restart reuses beyond JAX's compilation cache (`compile.warm_start`, on by default): the planner's
decision and the serialized executables of the state's init and of the train step.

Why. JAX's persistent cache (maxlm/runtime/compile_cache.py) skips XLA's compile, but its key is the lowered program,
so every start still traces and lowers: on the H200 a warm start of llama3.2-3b (28 unrolled layers) spent
5.0 s tracing and lowering the step and 2.2 s loading it, 4.4 s tracing the init twice (benchmarks/
init_profile.py), and with `plan.mode=fit` the planner's own trace of the step (benchmarks/results/
2026-12-04-startup_h200.jsonl). Here the executables themselves are kept, serialized by JAX
(`jax.experimental.serialize_executable`, the mechanism of MaxText's `compiled_trainstep_file`), under a key
computed without tracing: a restart of the same run on the same machine loads them and runs.

The key is a SHA-256 of everything that decides the program and can change between two starts: the config
(all of it, less `KEEP_OUT`: names, paths, checkpointing, profiling and logging cadence, the coordinator's
address, which no program reads), the program's argument shapes, dtypes and shardings, the source of every maxlm
module, the versions of the libraries that build or compile programs (`LIBRARIES`), the backend (platform, its
version, the devices),
JAX's settings, and the environment variables XLA, JAX and TE read (`ENV_PREFIXES`). A change in any of
them is a miss and the program is traced and compiled again, then stored beside the old entry. What the key
cannot see (a library patched in place without a version change) is why `compile.warm_start=false` exists.

Where and who. Entries are files `<kind>-<key>.pkl` in `<compile cache dir>/maxlm-warm`, written atomically
(a temporary file renamed into place) so a reader sees a whole entry or none. Executables in a run of one
process only: a serialized executable holds the device assignment of the process that compiled it, so
multi-process runs use JAX's cache alone for them. The planner's decision is process 0's in a run of several
processes (maxlm/plan/__init__.py `for_run`): process 0 alone keeps and loads it, and every process runs what
process 0 decided, kept or new. An entry that cannot be read or loaded (truncated, another JAX) counts as a miss. The entries are
pickles: loading one runs code, as loading JAX's cache entries does, hence a per-user default directory.

Loaded ahead. Loading a kept executable is not free: on the H200, llama3.2-3b's train step took 1.7 s to load
in bf16 and 5.8-6.5 s in fp8_delayed, whose program is larger (quantization around every GEMM). So each run
also keeps a manifest (`run-<key>.pkl`, keyed by the config, the code and the library versions): which entries
its last start used, with their argument signatures. `prefetch`, called as soon as the run's config is final,
reads it and loads those executables in background threads (the load runs in XLA, outside the GIL) while the
process builds its data pipeline and its state and restores a checkpoint. `compiled` takes a loaded one only
when it is the very entry that this start's key names, for arguments of the recorded signature (else it loads
or compiles as without a manifest): the manifest is a hint, never trusted. The init's executable also gives
the state's shardings (its output shardings), so a warm start does not trace the model's init for them
(`Compiler.kept`; on the H200 that trace cost 4-7 s for fp8_delayed,
benchmarks/results/2026-12-04-startup_h200_fp8_warm_profile.txt).

Only an executable XLA compiled in this process is kept, never one that JAX's persistent cache handed back: on
XLA:CPU (jax 0.10.2) an executable loaded from that cache serializes without its kernels, and the entry then
fails when run ("NOT_FOUND: Function broadcast_multiply_fusion not found"; tests/test_runtime_warm_start.py). So a
program that JAX's cache already holds (from a start before compile.warm_start, or after a change of maxlm's
code that left the program the same) stays a JAX-cache hit, traced and lowered at each start, until JAX's entry
is gone.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

from maxlm.config import Config, to_dict
from maxlm.runtime import compile_cache

SUBDIR = "maxlm-warm"
KEEP_OUT = ("output_dir", "run_name", "checkpoint", "profile", "compile", "train.log_every", "train.eval_every",
            "train.eval_steps", "train.watchdog", "train.watchdog_factor", "train.watchdog_floor_s",
            "train.watchdog_first_step_s", "distributed.coordinator_address", "distributed.initialization_timeout_s")
LIBRARIES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
             "transformer-engine", "transformer-engine-jax", "transformer_engine", "transformer_engine_jax",
             "flax", "optax", "ml-dtypes", "numpy")
ENV_PREFIXES = ("XLA_", "JAX_", "NVTE_", "CUDA_VISIBLE_DEVICES", "TF_XLA")

_dir: Path | None = None
_ahead: dict[str, "_Ahead"] = {}  # kind -> an executable being loaded ahead (`prefetch`)


def configure(cache_dir: Path | None, enabled: bool) -> str | None:
  """Set where entries live (None or not enabled: off); returns the line for the log, if any."""
  global _dir
  _dir = Path(cache_dir) / SUBDIR if cache_dir is not None and enabled else None
  _ahead.clear()
  return None if _dir is None else f"warm start: plans and executables in {_dir} (compile.warm_start)"


DECISIONS = ("plan",)  # kinds that process 0 keeps for every process of a run (not executables: module doc)


def active(kind: str = "") -> bool:
  """Entries are kept and loaded here: executables in a run of one process; decisions (DECISIONS) also by process
  0 of several, which decides for all of them (maxlm/runtime/agree.py)."""
  if _dir is None:
    return False
  return jax.process_count() == 1 or (kind in DECISIONS and jax.process_index() == 0)


def run_signature(cfg: Config, keep_out: tuple[str, ...] = KEEP_OUT) -> dict:
  """The config less what no program reads (`KEEP_OUT`, or the caller's wider list)."""
  flat = {}

  def walk(prefix: str, node: Any) -> None:
    for k, v in node.items():
      name = f"{prefix}{k}"
      if name in keep_out:
        continue
      if isinstance(v, dict):
        walk(f"{name}.", v)
      else:
        flat[name] = v
  walk("", to_dict(cfg))
  return flat


@functools.lru_cache(maxsize=1)
def _code() -> str:
  """A hash of every maxlm source file, in path order."""
  h = hashlib.sha256()
  root = Path(__file__).resolve().parents[1]  # maxlm/
  for p in sorted(root.rglob("*.py")):
    h.update(str(p.relative_to(root)).encode())
    h.update(p.read_bytes())
  return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
  out = {}
  for name in LIBRARIES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
  return out


def _environment() -> dict:
  """The backend, JAX's settings (plain values) and the environment variables XLA, JAX and TE read."""
  devices = jax.devices()
  settings = {k: v for k, v in jax.config.values.items()
              if isinstance(v, (bool, int, float, str, type(None))) and k != "jax_compilation_cache_dir"}
  env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)
         and k != "JAX_COMPILATION_CACHE_DIR"}
  client = devices[0].client
  return {"platform": client.platform, "platform_version": client.platform_version,
          "devices": [(d.id, d.device_kind) for d in devices], "settings": settings, "env": env}


def key(kind: str, parts: Any) -> str:
  text = json.dumps([kind, _code(), _versions(), _environment(), parts], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def signature(args: Any) -> list:
  """Arguments as the key sees them: the tree and each leaf's shape, dtype and sharding."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  return [str(tree)] + [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves]


def _unpickle(path: Path) -> Any:
  """The value pickled in `path`, None when there is none or it cannot be read."""
  try:
    return pickle.loads(path.read_bytes())
  except Exception:  # noqa: BLE001 - missing, truncated or from another library version: a miss
    return None


class Entry:
  """The store's file for (kind, parts), its key computed once, when it is made: what is then loaded or saved
  has the key of the state before the work (importing TE, for one, sets environment variables of its own)."""

  def __init__(self, kind: str, parts: Any):
    self.path = _dir / f"{kind}-{key(kind, parts)}.pkl" if active(kind) else None

  def load(self) -> Any:
    """The value stored, None when off, when there is none or when it cannot be read."""
    return None if self.path is None else _unpickle(self.path)

  def save(self, value: Any) -> None:
    """Store `value` (picklable), atomically; nothing when off."""
    if self.path is None:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    compile_cache.write_atomic(self.path, pickle.dumps(value))


class _Ahead:
  """An entry's executable loading in a background thread, with the signature it was kept for."""

  def __init__(self, path: Path, sig: list):
    self.name, self.sig, self.exe, self.load_s = path.name, sig, None, None
    # not a daemon: the interpreter's exit waits for a load in flight rather than tearing XLA down under it
    self.thread = threading.Thread(target=self._load, args=(path,), name=f"maxlm-warm-{path.stem}")
    self.thread.start()

  def _load(self, path: Path) -> None:
    t0 = time.perf_counter()
    self.exe = _load(_unpickle(path))
    self.load_s = time.perf_counter() - t0

  def result(self):
    """The executable, or None when it could not be loaded (waits for the load)."""
    self.thread.join()
    return self.exe


def _manifest(cfg_parts: dict) -> Path | None:
  """The run's manifest file. Its key leaves out JAX's settings and the environment, which scopes change (the
  init is traced under the threefry kernel's flag): the entries it names carry their own full keys."""
  if not active():
    return None
  text = json.dumps(["run", _code(), _versions(), cfg_parts], sort_keys=True, default=str)
  return _dir / f"run-{hashlib.sha256(text.encode()).hexdigest()[:32]}.pkl"


def _read(path: Path | None) -> dict:
  """A manifest's {kind: (entry file name, signature)}; empty when there is none or it cannot be read."""
  return (_unpickle(path) if path is not None else None) or {}


def prefetch(cfg_parts: dict) -> None:
  """Start loading, in background threads, the executables the last start of this run used (its manifest).
  Nothing when off or when the run has no manifest."""
  _ahead.clear()
  for kind, (name, sig) in _read(_manifest(cfg_parts)).items():
    if _dir is not None and (_dir / name).is_file():
      _ahead[kind] = _Ahead(_dir / name, sig)


def _note(cfg_parts: dict, kind: str, entry: Entry, sig: list) -> None:
  """Record in the run's manifest that `kind` uses `entry` for arguments of signature `sig`."""
  path = _manifest(cfg_parts)
  kept = _read(path)
  if path is not None and entry.path is not None and kept.get(kind) != (entry.path.name, sig):
    compile_cache.write_atomic(path, pickle.dumps({**kept, kind: (entry.path.name, sig)}))


class Timed:
  """An executable with how it came: `loaded` from this store, else traced + lowered (`lower_s`) and compiled
  (`compile_s`, which JAX's own cache may have shortened); `compile_s` is the load's time when loaded, or the
  wait for it when it was loaded ahead (`background_s`: the load's own time, in the background)."""

  def __init__(self, executable, loaded: bool, lower_s: float, compile_s: float, background_s: float | None = None):
    self.executable, self.loaded, self.lower_s, self.compile_s = executable, loaded, lower_s, compile_s
    self.background_s = background_s


def _load(serialized) -> Any:
  """A stored executable loaded, or None (nothing stored, or an entry this JAX cannot load: compile instead)."""
  try:
    return None if serialized is None else serialize_executable.deserialize_and_load(*serialized)
  except Exception:  # noqa: BLE001 - truncated, another JAX: a miss
    return None


def _kept(kind: str, entry: Entry, sig: list):
  """(executable, seconds its load took in the background or None) kept for `entry`: the one `prefetch` loaded
  when it is `entry`'s file, kept for arguments of signature `sig`, else loaded from the store now; (None, None)
  when there is none."""
  ahead = _ahead.pop(kind, None)
  if ahead is not None and entry.path is not None and ahead.name == entry.path.name and ahead.sig == sig:
    exe = ahead.result()
    if exe is not None:
      return exe, ahead.load_s
  exe = _load(entry.load())
  return exe, None


def compiled(kind: str, jitted: Callable, args: tuple, cfg_parts: dict) -> Timed:
  """The executable of `jitted` for `args` (arrays or ShapeDtypeStructs with shardings): the one `prefetch`
  loaded, or loaded from the store when this run's key has one, else traced, lowered, compiled and stored."""
  t0 = time.perf_counter()
  sig = signature(args)
  entry = Entry(kind, [cfg_parts, sig])
  exe, background_s = _kept(kind, entry, sig)
  if exe is not None:
    if background_s is None:  # loaded from the store: the manifest may not name it yet
      _note(cfg_parts, kind, entry, sig)
    return Timed(exe, True, 0.0, time.perf_counter() - t0, background_s)
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  t1 = time.perf_counter()
  hits = compile_cache.COUNTER.snapshot()[0]
  exe = lowered.compile()
  t2 = time.perf_counter()
  if entry.path is not None and compile_cache.COUNTER.snapshot()[0] == hits:  # compiled here, not by JAX's cache
    try:
      entry.save(serialize_executable.serialize(exe))
      _note(cfg_parts, kind, entry, sig)
    except (ValueError, NotImplementedError):  # a program JAX cannot serialize (constants): not kept
      pass
  return Timed(exe, False, t1 - t0, t2 - t1)


class Compiler:
  """`compiled` for one run (its config less `KEEP_OUT`), as maxlm/build.py's `CompiledStep` and
  maxlm/train_state.py's `compiler` argument; `kept` gives an executable only when one is already kept for the
  arguments."""

  def __init__(self, cfg_parts: dict):
    self.cfg_parts = cfg_parts

  def __call__(self, kind: str, jitted: Callable, args: tuple) -> Timed:
    return compiled(kind, jitted, args, self.cfg_parts)

  def kept(self, kind: str, args: tuple):
    """The executable kept for `kind` and `args` (loaded ahead, else from the store), or None: nothing traced."""
    sig = signature(args)
    return _kept(kind, Entry(kind, [self.cfg_parts, sig]), sig)[0]
