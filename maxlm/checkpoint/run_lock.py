"""One run per directory at a time: `<run_dir>/run.lock`, held by process 0 of a job while it uses the directory.

Two runs training into one directory side by side both end at their first checkpoint (exit 3), after hours: a
double submit, or a requeued job whose old allocation is still alive. So process 0 takes an exclusive `flock` on
`run.lock` before it looks at the directory, and writes into it who holds it: host, pid, SLURM job and restart count,
since when. A second run finds the lock taken and stops at start in one line (exit 2, every process of it), naming
the holder; nothing of the first is touched. A requeued job (the same SLURM job id, a higher restart count) whose
previous allocation still holds the lock says so.

The kernel releases a flock when its holder ends, however it ends (kill -9 too), so a lock is never stale: a file
left by a dead holder is taken over. A normal end removes the file. flock works across hosts on NFS (Linux maps it
to POSIX locks) and on Lustre mounted with `-o flock`; on a file system without locks (Lustre's `localflock` or
`noflock`: the lock is per node, or refused) a refused lock is a warning and the run goes on unguarded.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import jax

from maxlm.checkpoint.manager import gather_json
from maxlm.config import ConfigError
from maxlm.metrics import echo

LOCK = "run.lock"


def _me() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
          "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def busy_message(run_dir: Path, holder: dict, me: dict) -> str:
  """The one line for a run directory whose lock `holder` (its recorded info, {} if unreadable) holds."""
  who = (f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}"
         + (f" (SLURM job {holder['job']}, restart {holder.get('restart', 0)})" if holder.get("job") else "")
         + (f" since {holder['since']}" if holder.get("since") else ""))
  if holder.get("pid") and holder.get("host") == me["host"] and not _alive(int(holder["pid"])):
    who += (", which has exited: a process it started still holds the lock (see `fuser "
            f"{run_dir / LOCK}`)")
  if me["job"] and holder.get("job") == me["job"] and int(holder.get("restart", 0)) < me["restart"]:
    return (f"run directory {run_dir} is still held by this job's previous allocation: {who}; SLURM requeued the "
            f"job (restart {me['restart']}) before its old processes ended; requeue again once they are gone "
            f"(`scontrol requeue {me['job']}`)")
  return (f"run directory {run_dir} is in use by another run: {who}; wait for it to end, or give this run its own "
          f"run_name=...")


class RunLock:
  """A held lock; `release()` removes the file and lets it go (the process's end lets it go too)."""

  def __init__(self, path: Path, fd: int | None):
    self.path, self._fd = path, fd

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      self.path.unlink()  # while still holding it: a run waiting on the old file retries on the new one
    except OSError:
      pass
    os.close(self._fd)
    self._fd = None


def acquire(run_dir: Path) -> RunLock:
  """The lock of `run_dir` (which exists), or ConfigError naming its holder. A file system without locks gives an
  unguarded RunLock and a warning."""
  path = Path(run_dir) / LOCK
  for _ in range(10):  # the file may be removed between our open and our lock by a holder that ends
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise ConfigError(f"output_dir: cannot open the run directory's lock {path} ({e.strerror or e}); set "
                        f"output_dir to a writable place") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise ConfigError(busy_message(Path(run_dir), _read(path), _me())) from None
      echo(f"maxlm: warning: cannot lock {path} ({e.strerror or e}): this file system has no locks, so nothing "
           f"keeps a second run out of {run_dir}")
      return RunLock(path, None)
    try:
      same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      same = False
    if same:
      os.ftruncate(fd, 0)
      os.write(fd, (json.dumps(_me()) + "\n").encode())
      return RunLock(path, fd)
    os.close(fd)
  raise RuntimeError(f"{path}: the lock file kept changing under us")  # a bug or a tight loop of other runs


def _read(path: Path) -> dict:
  try:
    info = json.loads(path.read_text() or "{}")
  except (OSError, ValueError):
    return {}
  return info if isinstance(info, dict) else {}


def hold(run_dir: Path) -> RunLock | None:
  """Process 0 takes the lock of `run_dir`; every process raises the same ConfigError when it is taken (a
  collective when there are several). Returns process 0's lock (None elsewhere)."""
  lock, error = None, ""
  if jax.process_index() == 0:
    try:
      lock = acquire(run_dir)
    except ConfigError as e:
      error = str(e)
  refused = [m for m in gather_json(error) if m]
  if refused:
    if lock is not None:
      lock.release()
    raise ConfigError(refused[0])
  return lock
