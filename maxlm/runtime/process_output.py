"""`[process i/N host]` at the start of every line a process prints (stdout, stderr and the logging
handlers writing to them), so the merged log of N processes stays readable. `maxlm.runtime.distributed` turns it on
for a multi-process run."""

from __future__ import annotations

import io
import logging
import sys
import threading

class PrefixedStream(io.TextIOBase):
  """A text stream that starts every line written to `stream` with `prefix` (thread-safe). A line reaches
  `stream` in one write, with its newline (print() writes the text and the newline separately), so that
  the lines of processes sharing one pipe (mpirun, srun) do not interleave mid-line; a partial line is
  held until its newline or a flush."""

  def __init__(self, stream, prefix: str):
    super().__init__()
    self.stream, self.prefix = stream, prefix
    self._at_line_start = True
    self._pending = ""  # the start of a line not yet written
    self._lock = threading.Lock()

  def write(self, text: str) -> int:
    with self._lock:
      parts = (self._pending + text).splitlines(keepends=True)
      self._pending = "" if not parts or parts[-1].endswith(("\n", "\r")) else parts.pop()
      if parts:
        self.stream.write("".join(self._emit(part) for part in parts))
    return len(text)

  def _emit(self, part: str) -> str:
    head = self.prefix if self._at_line_start else ""
    self._at_line_start = part.endswith(("\n", "\r"))
    return head + part

  def flush(self) -> None:
    with self._lock:
      if self._pending:
        self.stream.write(self._emit(self._pending))
        self._pending = ""
    self.stream.flush()

  def fileno(self) -> int:
    return self.stream.fileno()

  def isatty(self) -> bool:
    return self.stream.isatty()

  def writable(self) -> bool:
    return True

  @property
  def encoding(self):
    return getattr(self.stream, "encoding", "utf-8")


def prefix_output(prefix: str) -> None:
  """Prefix every line of sys.stdout / sys.stderr (and of logging handlers writing to them). The streams it
  replaced are the prefixed streams' own `stream` (no module state): `restore_output` finds them there."""
  if isinstance(sys.stdout, PrefixedStream):
    return
  old_out, old_err = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = PrefixedStream(old_out, prefix), PrefixedStream(old_err, prefix)
  for handler in logging.getLogger().handlers:
    if isinstance(handler, logging.StreamHandler) and handler.stream in (old_out, old_err):
      handler.setStream(sys.stdout if handler.stream is old_out else sys.stderr)


def restore_output() -> None:
  """Undo `prefix_output` (the end of an in-process run): the streams it replaced come back, in sys and in the
  logging handlers writing to the prefixed ones."""
  out, err = sys.stdout, sys.stderr
  if not isinstance(out, PrefixedStream):
    return
  out.flush()
  err.flush()
  sys.stdout, sys.stderr = out.stream, getattr(err, "stream", err)
  for handler in logging.getLogger().handlers:
    if isinstance(handler, logging.StreamHandler) and handler.stream in (out, err):
      handler.setStream(handler.stream.stream)
