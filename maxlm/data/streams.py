"""Training data as streams, one per row of the global batch, so that no batch depends on the process count.

The global batch has B = data.global_batch_size rows. Row r of every global batch comes from stream r,
which reads the documents at global positions r, r + B, r + 2B, ... of the training order (each source's
training documents, shuffled anew every epoch from the source's seed, epochs one after the other; a
mixture mixes its share of every source with the weights), and packs them first-fit over its own
data.packing_bins rows, shuffled from (data.seed, r). Process p of P owns rows [p*B/P, (p+1)*B/P) and
reads only their documents; every stream depends on the data config and r alone, so the global batches
of a run are the same for every process count that divides B, and a position (one state per stream)
saved under one process count restores under another.

In a finite run (data.num_epochs > 0) a stream that has ended gives empty rows until every stream of
the process has ended; then the process's iterator ends. Processes may end at different steps: a
process whose streams ended contributes empty rows (`DataIterator.empty_batch`) until all have.
"""

from __future__ import annotations

import sys

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data import sources
from maxlm.data.packing import BATCH_KEYS, pack, prefetch, read_options, workers

DONE = {"done": True}  # the state of a stream that has ended


def stream_seed(seed: int, row: int) -> int:
  """The packing (row order) seed of stream `row`: a 31-bit hash of (data.seed, row)."""
  return int(np.random.SeedSequence([seed, row]).generate_state(1)[0] >> 1)


def epoch_order(n: int, seed: int, shuffle: bool):
  """Global position g -> position in a source's training view: epoch g // n in its own order."""
  if not shuffle:
    return None
  if n <= sources.EpochShuffle.MAX_DOCS:
    return sources.EpochShuffle(n, seed, None)
  return grain.MapDataset.range(n).shuffle(seed=seed)  # Grain reseeds it per epoch (seed + epoch)


class StreamDocs(grain.MapDataset):
  """The training-view positions stream `row` of `streams` reads from one source: global positions
  row, row + streams, ... of its epoch order, for `epochs` epochs (None: forever)."""

  def __init__(self, order, n: int, streams: int, row: int, epochs: int | None):
    super().__init__([])
    self.order, self.n, self.streams, self.row = order, n, streams, row
    self.length = max(0, -(-(n * epochs - row) // streams)) if epochs else sys.maxsize

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, j):
    if isinstance(j, slice):
      return self.slice(j)
    g = self.row + self.streams * j
    return g % self.n if self.order is None else int(self.order[g])

  def __str__(self) -> str:
    return f"StreamDocs(row={self.row} of {self.streams}, n={self.n})"


def stream(cfg: DataConfig, comps, views, orders, vocab, weights, row: int,
           options: grain.ReadOptions) -> grain.IterDataset | None:
  """Stream `row`'s packed rows (dicts of the four batch keys, [T] each); None when it has no documents
  (a finite run over fewer documents than rows)."""
  parts = []
  for comp, view, order in zip(comps, views, orders):
    docs = StreamDocs(order, len(view), cfg.global_batch_size, row, cfg.num_epochs or None)
    if len(docs) == 0:
      return None
    parts.append(docs.batch(sources.DOCS_PER_READ).map(sources.ReadDocs(comp, view, vocab)))
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
  ds = ds.to_iter_dataset(options)
  return pack(ds, cfg, cfg.packing_bins, cfg.shuffle, stream_seed(cfg.seed, row))


class StreamRows(grain.IterDataset):
  """This process's streams -> one row from each per step, with every stream's state after it.

  Elements: {"rows": {key: [n, T] int32}, "states": {str(row): state}, "done": bool}. A stream that has
  ended gives empty rows (all 0) and the state DONE; "done" says every stream here has ended. Elements
  never run out (`Assemble` stops). Grain's worker processes slice this dataset itself (`set_slice`):
  worker i of n takes the i-th of n contiguous groups of the rows, so each step arrives as n
  consecutive elements (Grain interleaves its workers round-robin). `states` (None: from the start)
  is where each stream starts.
  """

  def __init__(self, streams: dict[int, grain.IterDataset | None], seq_len: int, states: dict | None = None):
    super().__init__([s for s in streams.values() if s is not None])
    self.rows, self.streams = list(streams), list(streams.values())
    self.seq_len, self.states = seq_len, dict(states or {})
    self.part = (0, 1)

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice  # whole streams go to a worker either way
    i, n = sl.start or 0, sl.step or 1
    if sl.stop is not None or not 0 <= i < n:  # Grain gives worker i of n slice(i, None, n)
      raise AssertionError(f"unexpected worker slice {sl} from Grain")
    self.part = (i, n)

  def own(self) -> list[int]:
    """Indices (into self.rows) of the rows this slice produces."""
    i, n = self.part
    return [int(k) for k in np.array_split(np.arange(len(self.rows)), n)[i]]

  def __iter__(self) -> grain.DatasetIterator:
    mine = self.own()
    rows = [self.rows[k] for k in mine]
    its, state = _open([self.streams[k] for k in mine], rows, self.states)
    return _StreamRowsIterator(rows, its, state, self.seq_len)

  def __str__(self) -> str:
    return f"StreamRows(rows={self.rows[:1]}..{self.rows[-1:]}, part={self.part})"


def _open(streams: list, rows: list[int], states: dict) -> tuple[dict, dict]:
  """Iterators of the streams that have not ended, at their saved states; and every row's state."""
  its, state = {}, {}
  try:
    for r, ds in zip(rows, streams):
      st = states.get(str(r))
      state[str(r)] = DONE if ds is None else st
      if ds is None or st == DONE:
        continue
      its[r] = ds.__iter__()
      if st is not None:
        its[r].set_state(st)
  except BaseException:
    for it in its.values():
      it.close()
    raise
  return its, state


class _StreamRowsIterator(grain.DatasetIterator):

  def __init__(self, rows: list[int], its: dict, state: dict, seq_len: int):
    super().__init__(list(its.values()))
    self._rows, self._its, self._state, self._t = rows, its, state, seq_len

  def __next__(self) -> dict:
    out = {k: np.zeros((len(self._rows), self._t), np.int32) for k in BATCH_KEYS}  # [n, T] each
    for j, r in enumerate(self._rows):
      it = self._its.get(r)
      if it is None:
        continue
      try:
        row = next(it)
      except StopIteration:
        del self._its[r]
        it.close()
        self._state[str(r)] = DONE
        continue
      for k in BATCH_KEYS:
        out[k][j] = row[k]
      self._state[str(r)] = it.get_state()
    return {"rows": out, "states": dict(self._state), "done": not self._its}

  def get_state(self) -> dict:
    return {"states": dict(self._state)}

  def set_state(self, state) -> None:
    raise NotImplementedError("restore streams by building a new StreamRows from their states")


class Assemble(grain.IterDataset):
  """StreamRows elements (`parts` per step: one per worker) -> (batch of this process's rows, their
  states); ends at the first step at which every stream has ended."""

  def __init__(self, parent: grain.IterDataset, parts: int):
    super().__init__(parent)
    self.parts = parts

  def __iter__(self) -> grain.DatasetIterator:
    return _AssembleIterator(self._parent.__iter__(), self.parts)


class _AssembleIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, parts: int):
    super().__init__(parent)
    self._parts, self._states = parts, {}

  def __next__(self) -> tuple[dict, dict]:
    got = [next(self._parent) for _ in range(self._parts)]
    if all(g["done"] for g in got):
      raise StopIteration
    batch = {k: np.concatenate([g["rows"][k] for g in got]) for k in BATCH_KEYS}  # [B_local, T]
    self._states = {r: s for g in got for r, s in g["states"].items()}
    return batch, self._states

  def get_state(self) -> dict:
    return {"states": self._states}

  def set_state(self, state) -> None:
    raise NotImplementedError("restore streams by building a new StreamRows from their states")


def check_states(streams: dict, states: dict) -> None:
  """Open every stream at its saved state and close it again, so that a state that does not fit fails
  here (in this process) rather than later inside a worker process."""
  its, _ = _open(list(streams.values()), list(streams), states)
  for it in its.values():
    it.close()


def train_pipeline(cfg: DataConfig, comps, views, vocab, weights, rows: range, states: dict | None):
  """An iterator of (batch of `rows`, {str(row): state}) starting from `states` (None: the beginning)."""
  seeds = [(cfg.seed + 7919 * c) % 2**31 for c in range(len(comps))]
  orders = [epoch_order(len(v), s, cfg.shuffle) for v, s in zip(views, seeds)]
  options = read_options(cfg)  # each stream reads ahead on its own threads
  per_row = {r: stream(cfg, comps, views, orders, vocab, weights, r, options) for r in rows}
  n_workers = min(cfg.worker_count, len(rows))  # a worker owns whole streams: at most one per row
  if states and n_workers:
    check_states(per_row, states)
  ds = Assemble(workers(StreamRows(per_row, cfg.seq_len, states), n_workers), max(1, n_workers))
  return iter(prefetch(ds, cfg))
