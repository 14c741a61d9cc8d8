"""`DataError` and the counter of skipped records shared by every reader."""

from __future__ import annotations

import collections
import logging

log = logging.getLogger("maxlm.data")


class DataError(ValueError):
  """Bad data input (file, record, tokenizer or data config); the message is one line."""


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
