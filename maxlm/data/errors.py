"""`DataError`, `first_line` and the counter of skipped records shared by every reader."""

from __future__ import annotations

import collections
import logging

from maxlm.errors import BadInput

log = logging.getLogger("maxlm.data")

# Every character str.splitlines() breaks at -> its Python escape (e.g. newline -> backslash n).
_LINE_BREAKS = str.maketrans({c: ascii(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


class DataError(BadInput, ValueError):
  """Bad data input (file, record, tokenizer or data config); the message is one line.

  Line breaks in the message (from a file name, a JSON key, a library's error text) are escaped,
  so whatever a message quotes, the CLI prints one line.
  """

  def __init__(self, message: str):
    super().__init__(str(message).translate(_LINE_BREAKS))


def first_line(e: BaseException) -> str:
  """The first non-blank line of an exception's message, or its type name when it has none."""
  for line in str(e).splitlines():
    if line.strip():
      return line.strip()
  return type(e).__name__


class Skips:
  """Counts records skipped under `skip_bad_records=true`, by reason; strict mode raises instead."""

  def __init__(self, skip_bad_records: bool):
    self.enabled = skip_bad_records
    self.counts: collections.Counter[str] = collections.Counter()
    self.first: dict[str, str] = {}  # reason -> where it first happened

  def bad(self, where: str, reason: str, n: int = 1) -> None:
    """Report a bad record at `where` (e.g. 'a.jsonl:12'): raise, or count it when skipping."""
    if not self.enabled:
      raise DataError(f"{where}: {reason} (data.skip_bad_records=true or prepare "
                      f"--skip-bad-records skips such records)")
    self.counts[reason] += n
    self.first.setdefault(reason, where)

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def summary(self) -> str:
    if not self.counts:
      return "no records skipped"
    parts = [f"{n} {reason} (first at {self.first[reason]})" for reason, n in self.counts.most_common()]
    return f"skipped {self.total} bad records: " + "; ".join(parts)

  def merge(self, other: "Skips") -> None:
    self.counts.update(other.counts)
    for k, v in other.first.items():
      self.first.setdefault(k, v)
