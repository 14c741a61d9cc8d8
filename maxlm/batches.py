"""The training loop's batch feed (maxlm/trainer.py): batches in order, and with finite data the end of the
data known one batch ahead and agreed by every process."""

from __future__ import annotations

import jax
import numpy as np


def _any_process(mine: bool) -> bool:
  """Whether this or any other process says yes (a collective when there are several)."""
  if jax.process_count() == 1:
    return mine
  from jax.experimental import multihost_utils  # noqa: PLC0415 - only multi-process runs need it
  return bool(np.asarray(multihost_utils.process_allgather(np.array([mine]))).any())


class Batches:
  """The training batches of a run, in order. With finite data (`data.num_epochs` > 0) it looks one batch
  ahead, so the step that takes the last batch is known to be the last one (saved and logged like the
  step at train.steps), and the data position it reports stays that of the batches handed out. A process
  whose rows ran out while others still have data takes empty rows (no tokens)."""

  def __init__(self, data, finite: bool):
    self.data, self.finite = data, finite
    self._ahead = self._fetch() if finite else None  # (batch, position after it) or None

  def _fetch(self):
    local = next(self.data, None)
    if not _any_process(local is not None):
      return None
    batch = local if local is not None else self.data.empty_batch()
    return batch, self.data.get_state()

  def take(self):
    """The next batch (this process's rows, numpy), or None when every process's data has ended."""
    if not self.finite:
      return next(self.data)
    if self._ahead is None:
      return None
    (batch, self._position), self._ahead = self._ahead, self._fetch()
    return batch

  @property
  def ended(self) -> bool:
    """True once the batch last taken was the last one there is."""
    return self.finite and self._ahead is None

  def position(self):
    """The data position after the batch last taken (what a checkpoint stores)."""
    return self._position if self.finite else self.data.get_state()
