"""One run per directory at a time: `<run_dir>/run.lock` and `<run_dir>/run.lease`, held by process 0 of a job.

Two runs training into one directory side by side both end at their first checkpoint (exit 3), after hours: a
double submit, or a requeued job whose old allocation is still alive. So the train command takes the lock first,
right after reading its config and before the planner, the data or the devices (`take`): a duplicate is refused in
seconds, its GPU untouched. It stops in one line (exit 2, every process of it), naming the holder; nothing of the
first is touched. A requeued job (the same SLURM job id, a higher restart count) whose previous allocation still
holds the lock says so.

Two guards, both needed:
- an exclusive `flock` on `run.lock`, which holds the holder's record (host, pid, SLURM job and restart count,
  since when). The kernel releases it when its holder ends, however it ends (kill -9 too), so a file left by a
  dead holder is taken over. But on some file systems it is per node (Lustre mounted with `localflock`, some NFS
  set-ups): two nodes can both hold it; on others (`noflock`) it is refused (a warning, and the lease alone
  guards).
- the lease `run.lease`: the same record and `beat`, the time (seconds since the epoch) the holder last renewed
  it. A thread of the holder renews it every BEAT_S seconds, writing a temporary file and renaming it over the
  lease, so a reader never sees half of one. A run that finds a live lease is refused, whatever its flock said.
  A lease is dead when its beat is older than STALE_S, or at once when its holder is on this host and its pid has
  exited (a kill -9 and a requeue onto the same node); a dead lease is taken over with one warning line.

STALE_S = 60 s, 6 beats: a holder misses a beat only when its process stalls or the file system is slow to write
(a metadata server under a checkpoint's load), and both rarely last seconds; the clocks of a cluster's nodes
(NTP) agree far better than that. A requeued job on another node waits at most this long for the lease of its
dead allocation; SLURM's requeue takes longer anyway.

A new lease is created with `link` (atomic where there is one: it fails when a lease is there), and a run that
takes one over reads it back after writing it; two runs taking over one dead lease in the same instant are not
told apart, and the holder whose lease was taken over says so in a warning at its next beat. A normal end
removes both files.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from maxlm.checkpoint import run_dir as run_dirs
from maxlm.config import Config, ConfigError
from maxlm.metrics import echo
from maxlm.runtime import agree

LOCK, LEASE = "run.lock", "run.lease"
BEAT_S = 10.0  # the holder renews its lease this often
STALE_S = 60.0  # a lease not renewed for this long is dead (6 beats: see the module doc)


def _me() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
          "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "token": uuid.uuid4().hex}


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def busy_message(run_dir: Path, holder: dict, me: dict, renewed_s: float | None = None) -> str:
  """The one line for a run directory whose lock `holder` (its recorded info, {} if unreadable) holds;
  `renewed_s`: how long ago it renewed its lease, when the lease refused."""
  who = (f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}"
         + (f" (SLURM job {holder['job']}, restart {holder.get('restart', 0)})" if holder.get("job") else "")
         + (f" since {holder['since']}" if holder.get("since") else ""))
  if renewed_s is not None:
    who += (f", its lease renewed {max(0.0, renewed_s):.0f} s ago (it is taken over once not renewed for "
            f"{STALE_S:.0f} s)")
  elif holder.get("pid") and holder.get("host") == me["host"] and not _alive(int(holder["pid"])):
    who += (", which has exited: a process it started still holds the lock (see `fuser "
            f"{run_dir / LOCK}`)")
  if me["job"] and holder.get("job") == me["job"] and int(holder.get("restart", 0)) < me["restart"]:
    return (f"run directory {run_dir} is still held by this job's previous allocation: {who}; SLURM requeued the "
            f"job (restart {me['restart']}) before its old processes ended; requeue again once they are gone "
            f"(`scontrol requeue {me['job']}`)")
  return (f"run directory {run_dir} is in use by another run: {who}; wait for it to end, or give this run its own "
          f"run_name=...")


def _read(path: Path) -> dict:
  try:
    info = json.loads(path.read_text() or "{}")
  except (OSError, ValueError):
    return {}
  return info if isinstance(info, dict) else {}


def _write_lease(path: Path, record: dict, exclusive: bool) -> bool:
  """Write the lease atomically (a temporary file renamed, or linked, onto it); with `exclusive`, only where there
  is none (False when there is one)."""
  tmp = path.with_name(f".{path.name}.{record['host']}.{record['pid']}.tmp")
  tmp.write_text(json.dumps({**record, "beat": time.time()}) + "\n")
  try:
    if not exclusive:
      os.replace(tmp, path)
      return True
    try:
      os.link(tmp, path)
    except FileExistsError:
      return False
    except OSError as e:  # a file system without hard links: not atomic, but the read-back checks it
      if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
        raise
      if path.exists():
        return False
      os.replace(tmp, path)
    return True
  finally:
    tmp.unlink(missing_ok=True)


def _dead(lease: dict, me: dict) -> str:
  """Why `lease` (as read, {} if unreadable) no longer holds the directory, or "" while it does."""
  if not lease.get("token"):
    return "an unreadable lease"
  who = f"process {lease.get('pid', '?')} on host {lease.get('host', '?')}"
  age = time.time() - float(lease.get("beat", 0))
  if age > STALE_S:
    return f"the lease of {who}, not renewed for {age:.0f} s (over {STALE_S:.0f} s)"
  if lease.get("host") == me["host"] and not _alive(int(lease.get("pid", 0))):
    return f"the lease of {who}, which has exited"
  return ""


def _wait_for_previous(run_dir: Path, held: dict, me: dict) -> str:
  """A requeued SLURM job whose previous allocation's live-looking lease is there (its process 0 ended without
  removing it: a signal before the first step, the hang watchdog, a lost node) waits for that lease to die, at most
  STALE_S and a beat, saying so in a line; why it died, or "" (it is still renewed, or not this job's)."""
  if not (me["job"] and held.get("job") == me["job"] and int(held.get("restart", 0)) < me["restart"]):
    return ""
  end = time.time() + STALE_S + BEAT_S
  echo(f"maxlm: run directory {run_dir}: waiting up to {STALE_S + BEAT_S:.0f} s for the lease of this job's "
       f"previous allocation (restart {held.get('restart', 0)}, process {held.get('pid', '?')} on host "
       f"{held.get('host', '?')}) to end")
  while time.time() < end:
    time.sleep(1.0)
    now = _read(run_dir / LEASE)
    if now.get("token") != held.get("token"):
      return ""  # another run took it meanwhile: judged again by the caller's read-back
    why = _dead(now, me)
    if why:
      return why
  return ""


class RunLock:
  """A held lock and lease; `release()` stops the lease's renewal and removes both files (the process's end lets
  the flock go too, and its lease dies STALE_S later)."""

  def __init__(self, run_dir: Path, fd: int | None, record: dict, beat_s: float = BEAT_S):
    self.path, self.lease, self._fd, self.record, self.beat_s = run_dir / LOCK, run_dir / LEASE, fd, record, beat_s
    self._stop, self._released = threading.Event(), False
    self._beats = threading.Thread(target=self._renew, name="maxlm-run-lease", daemon=True)
    self._beats.start()

  def _renew(self) -> None:
    warned = False
    while not self._stop.wait(self.beat_s):
      held = _read(self.lease)  # ({} when unreadable for a moment: renewed all the same)
      if held.get("token") not in (None, self.record["token"]):
        if self.lease.parent.exists():  # (a bad start removing its own directory is not a takeover)
          echo(f"maxlm: warning: the lease of run directory {self.lease.parent} was taken over by process "
               f"{held.get('pid', '?')} on host {held.get('host', '?')}: two runs now write into it")
        return
      try:
        _write_lease(self.lease, self.record, exclusive=False)
      except OSError as e:
        if not warned and self.lease.parent.exists():
          echo(f"maxlm: warning: cannot renew the lease {self.lease} ({e.strerror or e}); another node takes it "
               f"over when it is not renewed for {STALE_S:.0f} s")
          warned = True

  def stop(self) -> None:
    """Stop renewing the lease."""
    self._stop.set()
    self._beats.join()

  def release(self) -> None:
    if self._released:
      return
    self.stop()
    self._released = True
    if _read(self.lease).get("token") == self.record["token"]:
      self.lease.unlink(missing_ok=True)
    if self._fd is not None:
      try:
        self.path.unlink()  # while still holding it: a run waiting on the old file retries on the new one
      except OSError:
        pass
      os.close(self._fd)
      self._fd = None


def _flock(path: Path, run_dir: Path, flock: bool) -> int | None:
  """An fd of `path` holding its flock (with `flock=False`, as if: a per-node flock that no other node sees); None
  on a file system without locks (a warning); ConfigError when taken."""
  for _ in range(10):  # the file may be removed between our open and our lock by a holder that ends
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise ConfigError(f"output_dir: cannot open the run directory's lock {path} ({e.strerror or e}); set "
                        f"output_dir to a writable place") from None
    try:
      if flock:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise ConfigError(busy_message(run_dir, _read(path) or _read(run_dir / LEASE), _me())) from None
      echo(f"maxlm: warning: cannot lock {path} ({e.strerror or e}): this file system has no locks, so only the "
           f"lease {run_dir / LEASE} keeps a second run out of {run_dir}")
      return None
    try:
      same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      same = False
    if same:
      return fd
    os.close(fd)
  raise RuntimeError(f"{path}: the lock file kept changing under us")  # a bug or a tight loop of other runs


def _lease(run_dir: Path, me: dict) -> None:
  """Take the lease of `run_dir` for `me`, or ConfigError naming its live holder."""
  path = run_dir / LEASE
  try:
    if _write_lease(path, me, exclusive=True):
      return
    held = _read(path)
    why = _dead(held, me) or _wait_for_previous(run_dir, held, me)
    if not why:
      held = _read(path) or held
      raise ConfigError(busy_message(run_dir, held, me, time.time() - float(held.get("beat", 0))))
    echo(f"maxlm: warning: run directory {run_dir}: taking over {why}")
    _write_lease(path, me, exclusive=False)
  except OSError as e:
    raise ConfigError(f"output_dir: cannot write the run directory's lease {path} ({e.strerror or e}); set "
                      f"output_dir to a writable place") from None
  held = _read(path)
  if held.get("token") != me["token"]:  # another run took it over in the same instant
    raise ConfigError(busy_message(run_dir, held, me, time.time() - float(held.get("beat", 0))))


def acquire(run_dir: Path, flock: bool = True, beat_s: float = BEAT_S) -> RunLock:
  """The lock and the lease of `run_dir` (which exists), or ConfigError naming the holder. Tests: `flock=False`
  takes the flock as if it were per node, whoever holds it (the lease alone guards); `beat_s`, the lease's renewal
  interval."""
  run_dir = Path(run_dir)
  path = run_dir / LOCK
  fd = _flock(path, run_dir, flock)
  me = _me()
  try:
    _lease(run_dir, me)
  except ConfigError:
    if fd is not None:
      os.close(fd)
    raise
  if fd is not None:
    data = (json.dumps(me) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)  # at the start: a record longer than this one, left by a dead holder, is gone whole
  return RunLock(run_dir, fd, me, beat_s)


@dataclasses.dataclass
class Held:
  """A run directory made ready by `take`: `new`, the topmost directory this start created (the run directory or
  a parent; None when it was there), `lock` process 0's lock (None elsewhere). `discard`: the start failed on bad
  input before the directory held a run, so `release` removes it whole."""
  run_dir: Path
  main: bool
  new: Path | None = None
  lock: RunLock | None = None
  discard: bool = False

  def release(self) -> None:
    """Let the lock go; on process 0, remove the directories this start created and left empty (with `discard`,
    the run directory whatever it holds)."""
    if self.lock is not None:
      self.lock.stop()
    if self.main and self.new is not None and self.discard:
      shutil.rmtree(self.run_dir, ignore_errors=True)
    if self.lock is not None:
      self.lock.release()
    if self.main and self.new is not None:
      run_dirs.remove_new(self.run_dir, self.new)


def take(cfg: Config, process_index: int, watch, limit) -> Held:
  """Process 0 creates the run directory (`run_dir.create`) and takes its lock; every process gets the same
  answer, a refusal as the same one line (maxlm/runtime/agree.py: no device is touched). `watch`, `limit`: the
  watchdog and its start-up limit."""
  held = Held(cfg.run_dir, main=process_index == 0)

  def make() -> bool:
    held.new = run_dirs.create(cfg)
    try:
      held.lock = acquire(cfg.run_dir)
    except ConfigError:
      held.release()  # the directories it created, left empty
      raise
    return True

  agree.decide("run lock", make, watch, "start-up: run directory", limit)
  return held
