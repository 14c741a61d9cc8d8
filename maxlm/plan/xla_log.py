"""XLA's own log lines during the planner's compiles: caught and summarized in the planner's words, never printed
raw.

XLA's C++ code logs through glog/absl onto the process's file descriptor 2, beneath Python's sys.stderr, e.g.
(XLA:GPU compiling the 70B for 64 compile-only H200s, whose program is over the memory limit XLA assumes):

  W1207 21:05:16.588760    4745 hlo_rematerialization.cc:3231] Can't reduce memory use below 108.39GiB
  (116385573454 bytes) by rematerialization; only reduced to 208.85GiB (224251888325 bytes), down from 218.89GiB
  (235027055537 bytes) originally

(one line). `caught()` points fd 2 at a pipe for the length of a compile, a thread reading it: warning and info
lines of glog's form are kept (`Caught.lines`) and summarized (`summary`), anything else (Python's own output on
sys.stderr, a progress line, an error line of XLA's) is passed on to the real fd 2 as it arrives. fd 2 is always
restored, the thread always joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading

# glog's prefix: severity, MMDD, time, thread id, file:line]
GLOG = re.compile(r"^(?P<sev>[IW])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (?P<file>[\w.\-]+):\d+\] (?P<msg>.*)$")
REMAT = re.compile(r"Can't reduce memory use below (?P<limit>[\d.]+)GiB.*only reduced to (?P<got>[\d.]+)GiB")


@dataclasses.dataclass
class Caught:
  lines: list[str] = dataclasses.field(default_factory=list)  # glog warning / info lines, as written

  def warnings(self) -> list[str]:
    return [ln for ln in self.lines if ln.startswith("W")]

  def fields(self) -> dict:
    """{"xla_log": summary} where XLA warned, else {} (for the measurement's dict)."""
    text = summary(self.warnings())
    return {"xla_log": text} if text else {}


def summary(lines: list[str]) -> str:
  """One clause for XLA's warning lines ("" for none): the rematerialization pass's, which the planner knows
  (the limit XLA compiled for, from the target's memory, and the least it got to by its own count, which is not
  memory_analysis's peak), else each warning's file and its first words."""
  parts, remat = [], []
  for ln in lines:
    m = GLOG.match(ln)
    msg, where = (m["msg"], m["file"]) if m else (ln, "")
    r = REMAT.search(msg)
    if r:
      remat.append((float(r["limit"]), float(r["got"])))
    else:
      parts.append(f"{where}: {msg[:120]}" if where else msg[:120])
  if remat:
    limit, least = max(a for a, _ in remat), min(b for _, b in remat)
    times = f" ({len(remat)} times)" if len(remat) > 1 else ""
    parts.insert(0, f"its rematerialization could not bring the program under XLA's own limit of {limit:.1f} GiB "
                 f"(by its count {least:.1f} GiB){times}")
  if not parts:
    return ""
  more = f"; {len(parts) - 2} more warnings" if len(parts) > 2 else ""
  return "XLA: " + "; ".join(dict.fromkeys(parts[:2])) + more


def _forward(read_fd: int, out_fd: int, caught: Caught) -> None:
  """Read the pipe to its end: glog lines into `caught`, the rest written to `out_fd` line by line."""
  with os.fdopen(read_fd, "rb", buffering=0) as pipe:
    pending = b""
    while True:
      chunk = pipe.read(65536)
      if not chunk:
        break
      pending += chunk
      *done, pending = pending.split(b"\n")
      for raw in done:
        _route(raw + b"\n", out_fd, caught)
    if pending:
      _route(pending, out_fd, caught)


def _route(raw: bytes, out_fd: int, caught: Caught) -> None:
  text = raw.decode(errors="replace").rstrip("\n")
  if GLOG.match(text):
    caught.lines.append(text)
  else:
    os.write(out_fd, raw)


@contextlib.contextmanager
def caught():
  """Within: fd 2 is a pipe whose glog warning/info lines are kept in the yielded `Caught`, the rest passed on
  to the real fd 2 as written. Afterwards fd 2 is the real one again (also on an exception)."""
  out = Caught()
  sys.stderr.flush()
  saved = os.dup(2)
  read_fd, write_fd = os.pipe()
  reader = threading.Thread(target=_forward, args=(read_fd, saved, out), name="maxlm-xla-log", daemon=True)
  reader.start()
  try:
    try:
      os.dup2(write_fd, 2)
    finally:
      os.close(write_fd)  # fd 2 is now the pipe's only write end
    try:
      yield out
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees its end
  finally:
    reader.join()
    os.close(saved)
