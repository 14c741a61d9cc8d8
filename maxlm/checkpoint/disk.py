"""The checkpoint directory's disk: how many bytes a save writes, the free space, and a bandwidth probe.

`state_bytes(state)`: the bytes of every array of a train state (what a checkpoint holds, before Orbax's few
kilobytes of metadata). `probe(directory, nbytes)`: writes `nbytes` to a file there (synced), drops it from the
page cache and reads it back, so the write and read bandwidth are the storage's, not memory's; the hang watchdog's
save and restore limits come from them (maxlm/runtime/watchdog.py). `nearest_existing(path)`: the directory whose
file system a path not yet created will be on.

`slow_storage`, where a function takes it: a callable given the bytes just written to the checkpoint directory (the
probe's, each checkpoint's), called after they are written; None in a run. Tests give one that sleeps or blocks,
a storage that is slow or stuck on purpose.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

PROBE_BYTES = 16 * 2**20  # the most the probe writes: enough to time a disk, little next to a checkpoint

SlowStorage = Callable[[int], None]


def state_bytes(state) -> int:
  """Bytes of every array leaf of `state` (global shapes: what the checkpoint holds over all processes)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(state)
             if hasattr(x, "shape"))


def probe_size(nbytes: int) -> int:
  """What the probe writes for a state of `nbytes`: an eighth of it, at least 64 KiB, at most PROBE_BYTES. A small
  write times latency more than bandwidth: it errs towards a slower disk, so towards longer limits."""
  return min(PROBE_BYTES, max(64 * 2**10, nbytes // 8))


def nearest_existing(path: Path) -> Path:
  path = Path(path).absolute()
  return next(p for p in (path, *path.parents) if p.exists())


def free_bytes(path: Path) -> int:
  """Bytes free to an unprivileged writer on the file system `path` is (or will be) on."""
  st = os.statvfs(nearest_existing(path))
  return st.f_bavail * st.f_frsize


def probe(directory: Path, nbytes: int, slow_storage: SlowStorage | None = None) -> tuple[float, float] | None:
  """(write, read) bytes per second of `nbytes` written to `directory` (synced) and read back from the disk; None
  when it cannot be measured (no space, not writable). The probe file is removed."""
  nbytes = max(1, int(nbytes))
  path = nearest_existing(directory) / f".maxlm-probe-{os.getpid()}"
  data = memoryview(os.urandom(nbytes))  # random: a compressing file system cannot shortcut it
  try:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
      done = 0
      while done < nbytes:
        done += os.write(fd, data[done:])
      os.fsync(fd)
    finally:
      os.close(fd)
    if slow_storage is not None:
      slow_storage(nbytes)
    t1 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
      if hasattr(os, "posix_fadvise"):  # read from the disk, not from the page cache the write filled
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      while os.read(fd, 2**20):
        pass
    finally:
      os.close(fd)
    t2 = time.perf_counter()
  except OSError:
    return None
  finally:
    try:
      path.unlink()
    except OSError:
      pass
  return nbytes / max(t1 - t0, 1e-9), nbytes / max(t2 - t1, 1e-9)

