"""The checkpoint directory's disk: how many bytes a save writes, the free space, and a bandwidth probe.

`state_bytes(state)`: the bytes of every array of a train state (what a checkpoint holds, before Orbax's few
kilobytes of metadata). `probe(directory, nbytes)`: writes `nbytes` to a file there (synced), drops it from the
page cache and reads it back, so the write and read bandwidth are the storage's, not memory's; the hang watchdog's
save and restore limits come from them (maxlm/runtime/watchdog.py). `nearest_existing(path)`: the directory whose
file system a path not yet created will be on.

The disk check (`check_start` before the first step, `short_of_space` before each save): docs/checkpoints.md.

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

from maxlm.config import ConfigError

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


# --- the disk check: does the next save fit, and the run's saves? ---------------------------------------------

def footprint(path: Path) -> int:
  """Bytes a directory tree takes on its disk (allocated blocks: what a checkpoint of that size will take)."""
  total = 0
  for root, _, names in os.walk(path):
    for name in names:
      try:
        total += os.lstat(os.path.join(root, name)).st_blocks * 512
      except OSError:
        continue
  return total


def save_steps(start: int, steps: int, every: int) -> list[int]:
  """The steps a run from `start` to `steps` saves at: each multiple of `every` (0: none), and the last."""
  out = [s for s in range(every, steps + 1, every) if s > start] if every > 0 else []
  if steps > start and (not out or out[-1] != steps):
    out.append(steps)
  return out


def peak_bytes(existing: list[int], planned: list[int], size: int, keep: int, keep_period: int,
               free: int) -> tuple[int, int | None]:
  """(the most bytes the planned saves take beyond today's usage at any one time, the first planned save during
  which that exceeds `free`, or None). Orbax writes a save beside the kept checkpoints and then removes those
  past checkpoint.keep (the latest `keep`, 0 = all; multiples of `keep_period` stay too): during a save the
  directory holds the kept ones plus the new one. `existing` checkpoints take `size` each, like the new ones."""
  kept, extra, peak, first = list(existing), 0, 0, None
  for step in planned:
    during = extra + size
    peak = max(peak, during)
    if first is None and during > free:
      first = step
    kept.append(step)
    extra += size
    if keep > 0:
      latest = set(kept[-keep:])
      stay = [k for k in kept if k in latest or (keep_period > 0 and k % keep_period == 0)]
      extra -= size * (len(kept) - len(stay))
      kept = stay
  return peak, first


def human(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_start(c, t, output_dir: str, ckpt_dir: Path, nbytes: int, existing: list[int]) -> str:
  """Before the first step (CheckpointConfig `c`, TrainConfig `t`, the state's `nbytes`, the checkpoint steps in
  `ckpt_dir`): ConfigError when the next save cannot fit in the free space; a warning (returned, '' if none) when
  the run's saves would fill the disk within checkpoint.keep saves. A save is sized as the latest checkpoint's
  footprint on disk (the saves of a run hold the same arrays), before one exists as the state's arrays (an upper
  bound: Orbax compresses what it writes, and a trained state's values compress little)."""
  planned = save_steps(existing[-1] if existing else 0, t.steps, c.every)
  if not planned:
    return ""
  size = footprint(ckpt_dir / str(existing[-1])) if existing else nbytes
  what = "the latest checkpoint's size on disk" if existing else "the train state's arrays"
  free = free_bytes(ckpt_dir)
  where = f"{nearest_existing(ckpt_dir)} has {human(free)} free"
  if free < size:
    old = (f", remove checkpoints of this run you do not need (steps {', '.join(map(str, existing[:-1]))} in "
           f"{ckpt_dir}; checkpoint.keep=K keeps the last K)" if len(existing) > 1 else "")
    raise ConfigError(f"output_dir={output_dir}: not enough disk space for a checkpoint: the next one (step "
                      f"{planned[0]}) needs {human(size)} ({what}) and {where}; free space there, train in another "
                      f"output_dir=...{old}, or set checkpoint.enabled=false (the run then keeps no weights)")
  peak, first = peak_bytes(existing, planned, size, c.keep, c.keep_period, free)
  if first is None:
    return ""
  kept = f"checkpoint.keep={c.keep} kept and one being written" if c.keep else "checkpoint.keep=0 keeps every one"
  return (f"output_dir={output_dir}: this run's checkpoints take up to {human(peak)} more ({human(size)} each, "
          f"{kept}) and {where}: the save of step {first} will fail; a smaller checkpoint.keep, a larger "
          f"checkpoint.every or another output_dir avoids that")


def short_of_space(directory: Path, size: int) -> str:
  """'' when `size` bytes fit in the free space of `directory`'s disk, else why not (for one line)."""
  free = free_bytes(directory)
  if free >= size:
    return ""
  return f"it needs about {human(size)} and {nearest_existing(directory)} has {human(free)} free"
