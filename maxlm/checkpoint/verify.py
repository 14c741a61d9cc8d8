"""Checkpoint integrity: array checksums, NaN checks, file-size manifests, one-line error reasons.

The checksum of an array is a sum (mod 2^32) of a mixed hash of every element's bits and its
flat index, so it does not depend on how the array is sharded: a checkpoint saved on one mesh
verifies on any other. Any single changed element changes the checksum. The JSON items (data
position, config) are checked by the sha256 of their canonical JSON.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.offload import to_device_memory

MANIFEST = "maxlm_files.json"

log = logging.getLogger("maxlm")


class Corrupt(Exception):
  """A checkpoint is damaged (unreadable, truncated, checksum mismatch): use the previous one."""


# The checksum of an array (docs/checkpoint_format.md): the sum mod 2^32 of a hash of each element's bits and its
# flat index, so any slice's share can be computed alone. One definition of the constants; two evaluations: on the
# device for a whole array (`_leaf_hash`) and in numpy for one streamed slice (`slice_checksum`, hf/orbax_io.py).
M1, M2, M3, M4 = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F, 0x2C1B3C6D


def slice_checksum(x: np.ndarray, start: int) -> int:
  """Sum (mod 2^32) of the element hashes of `x`, whose first element has flat index `start`."""
  x = np.ascontiguousarray(x).reshape(-1)
  bits = x.view(f"uint{8 * x.itemsize}").astype(np.uint32)
  index = (np.arange(x.size, dtype=np.uint64) + np.uint64(start)).astype(np.uint32)
  h = bits * np.uint32(M1) + index * np.uint32(M2) + np.uint32(M3)
  h = (h ^ (h >> np.uint32(15))) * np.uint32(M4)
  h = h ^ (h >> np.uint32(12))
  return int(h.sum(dtype=np.uint32))


def _leaf_hash(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
  index = jnp.zeros(x.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(x.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
    stride *= x.shape[d]
  h = bits * jnp.uint32(M1) + index * jnp.uint32(M2) + jnp.uint32(M3)
  h = (h ^ (h >> 15)) * jnp.uint32(M4)
  h = h ^ (h >> 12)
  return jnp.sum(h, dtype=jnp.uint32)


def _leaf_finite(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.all(jnp.isfinite(x))
  return jnp.bool_(True)


@jax.jit
def _fingerprint(leaves):
  leaves = to_device_memory(leaves)  # optim.offload=host: the optimizer state is hashed on the device
  return (jnp.stack([_leaf_hash(x) for x in leaves]), jnp.stack([_leaf_finite(x) for x in leaves]))


def _host(x: jax.Array) -> np.ndarray:
  return np.asarray(x.addressable_data(0))  # replicated scalars: any local copy


def fingerprint(tree) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """(uint32 checksum per leaf, all-finite flag per leaf, leaf paths) of a tree of jax Arrays."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in flat]
  sums, finite = _fingerprint([x for _, x in flat])
  return _host(sums), _host(finite), paths


def describe(tree, sums: np.ndarray, paths: list[str]) -> dict[str, list]:
  """{leaf path: [shape, dtype, checksum]}: the `meta` item of a checkpoint."""
  leaves = jax.tree_util.tree_leaves(tree)
  return {p: [list(x.shape), str(x.dtype), int(s)] for p, x, s in zip(paths, leaves, sums)}


def mismatches(saved: dict[str, list], target, prefix: str = "") -> list[str]:
  """Differences in leaf paths and shapes between a checkpoint's `meta` and `target` (dtypes may differ)."""
  want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  want = {prefix + k: v for k, v in want.items()}
  have = {k: v for k, v in saved.items() if k.startswith(prefix)}
  out = [f"{k} missing from the checkpoint" for k in sorted(set(want) - set(have))]
  out += [f"{k} in the checkpoint but not in the model" for k in sorted(set(have) - set(want))]
  out += [f"{k} has shape {tuple(have[k][0])} in the checkpoint, {tuple(want[k].shape)} here"
          for k in sorted(set(want) & set(have)) if tuple(have[k][0]) != tuple(want[k].shape)]
  return out


def wrong_checksums(saved: dict[str, list], tree, prefix: str = "") -> list[str]:
  """Leaves of `tree` (restored) whose checksum differs from the saved one (same-dtype leaves only)."""
  sums, _, paths = fingerprint(tree)
  leaves = jax.tree_util.tree_leaves(tree)
  bad = []
  for p, x, s in zip(paths, leaves, sums):
    shape, dtype, want = saved[prefix + p]
    if dtype == str(x.dtype) and int(s) != want:
      bad.append(prefix + p)
  return bad


def json_digest(obj) -> str:
  """sha256 (hex) of the canonical JSON of `obj`: sorted keys, no spaces, ASCII. The same for the
  object saved and the one restored (JSON turns tuples into lists; both print as arrays)."""
  text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(step_dir: Path, items: tuple[str, ...]) -> int:
  """Record the size of every file of the items under `step_dir`; returns the total bytes."""
  files = {}
  for item in items:
    for root, _, names in os.walk(step_dir / item):
      for name in names:
        f = Path(root) / name
        files[str(f.relative_to(step_dir))] = f.stat().st_size
  tmp = step_dir / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps({"files": files}, indent=0, sort_keys=True))
  os.replace(tmp, step_dir / MANIFEST)
  return sum(files.values())


def check_files(step_dir: Path) -> str:
  """'' when every file listed in the manifest is there with its size, else what is wrong."""
  m = step_dir / MANIFEST
  if not m.exists():
    return ""  # saved without a manifest (e.g. killed between writing and listing): sizes unchecked
  try:
    files = json.loads(m.read_text())["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"{MANIFEST} is unreadable ({e})"
  problems = []
  for rel, size in sorted(files.items()):
    f = step_dir / rel
    if not f.exists():
      problems.append(f"{f} is missing")
    elif f.stat().st_size != size:
      problems.append(f"{f} has {f.stat().st_size} bytes, expected {size}")
  if not problems:
    return ""
  more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
  return ", ".join(problems[:3]) + more


def reason(e: BaseException) -> str:
  """The most specific line of an exception chain (TensorStore's cause, not Orbax's wrapper)."""
  chain = []
  while e is not None and len(chain) < 10:
    chain.append(e)
    e = e.__cause__ or e.__context__
  best = chain[0]
  for c in chain:
    if isinstance(c, OSError) or "Error writing" in str(c) or "Error reading" in str(c):
      best = c
  text = str(best).split(" See full TensorStore details")[0]
  text = re.sub(r"\s*\[source locations='.*?'\]", "", text, flags=re.S)  # TensorStore's C++ call sites
  text = re.sub(r"[\w/.-]+\.(cc|h):\d+", " ", text.replace("\\n", " "))
  line = " ".join(text.split())
  name = type(best).__name__
  if len(line) > 400:
    short = line[:150] + " ... " + line[-250:]  # the OS error is usually at the end
    # but not always (TensorStore appends its own details): keep the OS's words for every errno named
    codes = re.findall(r"(?:os_error_code|errno|Errno)\W{0,3}(\d+)", line)
    lost = [os.strerror(int(c)) for c in dict.fromkeys(codes) if os.strerror(int(c)) not in short]
    line = short + "".join(f" [{w}]" for w in lost)
  return f"{name}: {line}" if line else name


class _Drop(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return False


class _OrbaxErrors(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    return "orbax" not in record.pathname and "never retrieved" not in record.getMessage()


class OrbaxNoise:
  """While a Checkpointer is open: drop Orbax's error logs and the tracebacks its save threads leave
  after a failed write (TensorStore callbacks hitting a closed event loop, reported as unraisable).
  The Checkpointer reports every failure itself, in one line. MAXLM_LOG=DEBUG keeps everything."""

  def __init__(self):
    self._filter = _OrbaxErrors()
    self._hook = None
    self._removed = False  # removed while another hook was installed over it: it only forwards

  def install(self) -> None:
    if log.isEnabledFor(logging.DEBUG):
      return
    for name in ("absl", "asyncio"):
      logging.getLogger(name).addFilter(self._filter)
    self._removed = False
    if self._hook is None:  # else still in the chain of hooks (removed under another): filtering again
      self._hook = sys.unraisablehook
      sys.unraisablehook = self._unraisable

  def _unraisable(self, args) -> None:
    text = str(args.exc_value)
    code = getattr(args.object, "cr_code", None)  # "Exception ignored in: <coroutine object ...>"
    if self._removed or not ("Event loop is closed" in text or "Python is likely shutting down" in text
            or (code is not None and "/orbax/" in code.co_filename)):
      self._hook(args)

  def remove(self, failed: bool) -> None:
    """Wait for Orbax's leftover save threads, then restore logging (after a failure, `_quiet_after_failure`
    keeps the same filters: that save's futures and callbacks may still report until the process exits)."""
    deadline = time.monotonic() + 30  # one bound for all of them (they are done after a wait)
    for th in threading.enumerate():
      if th is not threading.current_thread() and type(th).__module__.startswith("orbax"):
        try:
          th.join(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - Orbax's threads re-raise the failure already reported
          pass
    gc.collect()
    if self._hook is not None:
      for name in ("absl", "asyncio"):
        logging.getLogger(name).removeFilter(self._filter)
      if sys.unraisablehook == self._unraisable:
        hook, self._hook = self._hook, None
        below = getattr(hook, "__self__", None)
        while isinstance(below, OrbaxNoise) and below._removed:  # those removed under this one go too
          hook, below._hook = below._hook, None
          below = getattr(hook, "__self__", None)
        sys.unraisablehook = hook
      else:  # another hook (a second open Checkpointer's) was installed over this one and forwards to it:
        self._removed = True  # keep the chain, forwarding everything from now on
    if failed:
      _quiet_after_failure()


@contextlib.contextmanager
def quiet():
  """Silence Orbax/asyncio error logs and tracebacks (we report failures ourselves in one line)."""
  if log.isEnabledFor(logging.DEBUG):
    yield
    return
  loggers = [logging.getLogger(n) for n in ("absl", "asyncio")]
  drop = _Drop()
  for lg in loggers:
    lg.addFilter(drop)
  hook = sys.unraisablehook
  sys.unraisablehook = lambda _: None
  failed = False
  try:
    yield
  except BaseException:
    failed = True
    raise
  finally:
    gc.collect()  # reads and writes, failed or not, leave coroutines whose warnings would print at collection
    sys.unraisablehook = hook
    for lg in loggers:
      lg.removeFilter(drop)
    if failed:
      _quiet_after_failure()


_after_failure: OrbaxNoise | None = None


def _quiet_after_failure() -> None:
  """Keep Orbax's leftovers of a failed read or write quiet until the process exits (once per process).

  Orbax runs an operation's reads in an event loop that it closes as soon as one fails (orbax/checkpoint/_src/
  asyncio_utils.py: run_until_complete, then close). The other reads finish later in TensorStore's threads, call
  back into the closed loop ("Event loop is closed"), and their coroutines, held by the failure's traceback, are
  closed only when it is collected, where Orbax raises again: at interpreter exit, after the one-line error,
  `maxlm generate` on a truncated array file printed 12 to 260 lines of tracebacks (4 runs of 4). The filters
  (OrbaxNoise) drop only those: Orbax's coroutines, closed-loop callbacks, asyncio's "never retrieved"; anything
  else still reaches the previous hook."""
  global _after_failure
  if _after_failure is None and not log.isEnabledFor(logging.DEBUG):
    _after_failure = OrbaxNoise()
    _after_failure.install()
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
