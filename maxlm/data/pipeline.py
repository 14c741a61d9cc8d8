"""Train/eval iterators: Grain pipelines from documents to packed [B, T] int32 batches.

Training batches are built per global batch row ("stream", see streams.py): the same global batches
for every process count that divides data.global_batch_size, and a position saved under one process
count restores under another. Eval is one global stream that every process packs and slices.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data import sources, streams
from maxlm.data.errors import DataError, Skips, first_line, log
from maxlm.data.packing import BATCH_KEYS, PadRows, finish, pack, read_options

__all__ = ["BATCH_KEYS", "DataIterator", "check_inputs", "make_eval_iterator", "make_train_iterator",
           "merge_states"]


class DataIterator:
  """Iterator of batches (dicts of np.int32 [B_local, T]) with a checkpointable position.

  A training position is kept per global batch row (stream): `get_state()` gives
  {"streams": B, "batches": n, "rows": {"<row>": state}} for this process's rows; `merge_states` joins
  every process's into one holding all B rows, and `set_state` takes a state holding (at least) this
  process's rows, whatever process count saved it. A state of the per-process pipelines before streams
  ({"grain": ..., "batches": n}) restores onto the same process count and continues those pipelines.
  Every batch is checked against `vocab_size` so a bad token id stops before the step runs. `info`
  describes the data (documents, skipped records, tokenizer) for logs.
  """

  def __init__(self, start, vocab_size: int, info: dict | None = None, *, rows: range, seq_len: int,
               streams: int, checkpointable: bool = True):
    """start(states) -> iterator of (batch, {"<row>": state}) from `states` (None: the beginning)."""
    self._start = start
    self.rows, self.seq_len, self.streams = rows, seq_len, streams
    self.checkpointable = checkpointable
    self.vocab_size = vocab_size
    self.info = dict(info or {})
    self.batches = 0
    self.ended = False  # a finite run's streams of this process have all ended
    self._states = {str(r): None for r in rows}  # None: from the start
    self._box = [start(None)]  # emptied on close, so Grain's iterators die before interpreter teardown
    self._finalizer = weakref.finalize(self, _close, self._box)

  @property
  def _it(self):
    if not self._box:
      raise DataError("this data iterator was closed")
    return self._box[0]

  def close(self) -> None:
    self._finalizer()

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.ended:
      raise StopIteration
    try:
      batch, states = next(self._it)
    except StopIteration:
      self.ended = True
      raise
    hi = max(int(batch["inputs"].max()), int(batch["targets"].max()))
    lo = min(int(batch["inputs"].min()), int(batch["targets"].min()))
    if hi >= self.vocab_size or lo < 0:
      bad = hi if hi >= self.vocab_size else lo
      raise DataError(f"data batch {self.batches} holds token id {bad} outside [0, model.vocab_size="
                      f"{self.vocab_size}) (tokenizer: {self.info.get('tokenizer', '?')}); use a tokenizer "
                      f"that fits the model's vocabulary or raise model.vocab_size")
    self._states = states
    self.batches += 1
    return batch

  def empty_batch(self) -> dict[str, np.ndarray]:
    """This process's part of a global batch once its own streams have ended (next() raised
    StopIteration) in a finite run while another process's have not: empty rows (all 0; segment_ids 0
    is padding). It counts as a batch, so that every process's position stays at the same step."""
    self.batches += 1
    return {k: np.zeros((len(self.rows), self.seq_len), np.int32) for k in BATCH_KEYS}  # [B_local, T]

  def get_state(self) -> dict:
    if not self.checkpointable:
      raise DataError("an eval data iterator has no checkpointable position")
    return {"streams": self.streams, "batches": self.batches, "rows": dict(self._states)}

  def set_state(self, state: dict) -> None:
    """Continue from `state`: this process's rows of a (merged) stream state saved by any process count
    that divides the batch."""
    if not self.checkpointable:
      raise DataError("an eval data iterator has no checkpointable position")
    try:
      batches = int(state["batches"])
      states = self._own_rows(state)
      it = self._start(states)
    except DataError:
      raise
    except (KeyError, TypeError, ValueError, IndexError, AssertionError) as e:
      why = first_line(e)
      why = why if why == type(e).__name__ else f"{type(e).__name__}: {why}"
      raise DataError(f"data iterator state does not fit this data config ({why}); was data.* "
                      f"changed since it was saved?") from None
    old, self._box[0] = self._box[0], it
    _close([old])
    self._states, self.batches, self.ended = states, batches, False

  def _own_rows(self, state: dict) -> dict:
    if state["streams"] != self.streams:
      raise DataError(f"data iterator state holds {state['streams']} streams (one per row of "
                      f"data.global_batch_size={state['streams']}); this run has {self.streams}: "
                      f"data.global_batch_size cannot change on resume")
    rows = state["rows"]
    missing = [r for r in self.rows if str(r) not in rows]
    if missing:
      raise DataError(f"data iterator state lacks rows {missing[0]}..{missing[-1]} of this process")
    return {str(r): rows[str(r)] for r in self.rows}


def merge_states(states: list[dict]) -> dict:
  """Every process's `get_state()` -> one state holding every stream (restores onto any process count
  that divides the batch). Raises ValueError when they are not one consistent position."""
  if not states or any("rows" not in s for s in states):
    raise ValueError("merge_states needs stream states (get_state of stream iterators)")
  n = states[0]["streams"]
  rows = {}
  for s in states:
    if s["streams"] != n or s["batches"] != states[0]["batches"] or set(rows) & set(s["rows"]):
      where = [(s["streams"], s["batches"]) for s in states]
      raise ValueError(f"data states of different positions (streams, batches): {where}")
    rows.update(s["rows"])
  if set(rows) != {str(r) for r in range(n)}:
    raise ValueError(f"data states hold {len(rows)} of {n} rows")
  return {"streams": n, "batches": states[0]["batches"], "rows": {str(r): rows[str(r)] for r in range(n)}}


def _close(box: list) -> None:
  """Stop Grain's prefetch threads/processes and drop the iterator."""
  if box and hasattr(box[0], "close"):
    box[0].close()
  box.clear()


def local_batch_size(cfg: DataConfig, process_count: int) -> int:
  if cfg.global_batch_size % process_count:
    raise DataError(f"data.global_batch_size ({cfg.global_batch_size}) must be divisible by the "
                    f"process count ({process_count})")
  return cfg.global_batch_size // process_count


def _check_process(process_index: int, process_count: int) -> None:
  if not 0 <= process_index < process_count:
    raise DataError(f"process_index {process_index} is outside [0, process_count={process_count})")


def _rows(cfg: DataConfig, pi: int, pc: int) -> range:
  b = local_batch_size(cfg, pc)
  return range(pi * b, (pi + 1) * b)


# --- synthetic -----------------------------------------------------------------------------------


@functools.cache
def zipf_cdf(vocab_size: int) -> np.ndarray:
  """Cumulative P(token k) = (1 / (k + 1)) / H_V over k < V: Zipf's law, as token frequencies in text roughly
  follow. Uniform tokens leave a model nothing to learn (the loss of a uniform prediction is already ln V), so
  a run's loss could not fall; under Zipf it falls as the model learns the frequencies (one unigram's worth:
  for V = 128256 the entropy is 7.4 nats, against ln V = 11.76), as a run on text does in its first steps."""
  w = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64)  # [V]
  return np.cumsum(w / w.sum())  # [V]


class _SyntheticRows(grain.transforms.Map):
  """Step -> (rows `rows` of synthetic global batch `step`, their states): tokens drawn independently from
  Zipf's law over the vocabulary (`zipf_cdf`); row r depends only on (seed, step, r)."""

  def __init__(self, seed: int, rows: range, seq_len: int, vocab_size: int):
    self.seed, self.rows, self.seq_len, self.vocab_size = seed, rows, seq_len, vocab_size

  def map(self, step: int) -> tuple[dict[str, np.ndarray], dict]:
    cdf = zipf_cdf(self.vocab_size)
    u = np.stack([np.random.default_rng((self.seed, step, r)).random(self.seq_len + 1)
                  for r in self.rows])  # [B_local, T + 1]
    toks = np.minimum(np.searchsorted(cdf, u, side="right"), self.vocab_size - 1).astype(np.int32)  # [B_local, T + 1]
    b, t = len(self.rows), self.seq_len
    batch = {
        "inputs": toks[:, :-1].copy(),  # [B_local, T]
        "targets": toks[:, 1:].copy(),  # [B_local, T]
        "segment_ids": np.ones((b, t), np.int32),  # [B_local, T]
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),  # [B_local, T]
    }
    return batch, {str(r): {"next_index": step + 1} for r in self.rows}


def _synthetic(cfg: DataConfig, vocab_size: int, pi: int, pc: int) -> DataIterator:
  rows = _rows(cfg, pi, pc)

  def start(states: dict | None):
    steps = {0} if states is None else {0 if s is None else int(s["next_index"]) for s in states.values()}
    if len(steps) != 1:
      raise ValueError(f"synthetic rows at different steps {sorted(steps)}")
    ds = grain.MapDataset.range(steps.pop(), 2**62)
    ds = ds.map(_SyntheticRows(cfg.seed, rows, cfg.seq_len, vocab_size))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))

  info = {"type": "synthetic", "tokenizer": "none (random tokens, Zipf-distributed)"}
  return DataIterator(start, vocab_size, info, rows=rows, seq_len=cfg.seq_len, streams=cfg.global_batch_size)


# --- documents -> packed rows ------------------------------------------------------------------


def _report(kind: str, comps, skips: Skips, vocab: sources.Vocab, docs: int, **extra) -> dict:
  info = {"type": kind, "sources": [c.label for c in comps], "documents": docs,
          "skipped": skips.total, "skipped_summary": skips.summary(), "tokenizer": vocab.desc, **extra}
  log.info("data (%s): %d documents from %s; %s; %s", kind, docs, ", ".join(info["sources"]),
           vocab.desc, skips.summary())
  if skips.total:
    log.warning("data (%s): %s", kind, skips.summary())
  return info


def _train_text(cfg: DataConfig, vocab_size: int, pi: int, pc: int) -> DataIterator:
  comps, weights, skips = sources.load_components(cfg, "train")
  vocab = sources.resolve_vocab(cfg, comps, vocab_size)
  k = sources.split_every(cfg)  # 0 with data.eval_paths: nothing is held out of training
  views = [sources.DocIndex(c.source, k, "train") for c in comps]
  for comp, view in zip(comps, views):
    if len(view) == 0:
      n = len(comp.source)
      # (n >= 1: sources.load_components refuses a source without documents)
      more = {"text": " (text files: data.text_split=line makes one per line)",
              "arrayrecord": " (maxlm prepare text_split=line makes one per line of text)"}.get(comp.fmt, "")
      raise DataError(f"data source '{comp.name}' has no training documents: data.eval_fraction "
                      f"{cfg.eval_fraction} holds out one document in {k}, starting with the first, which leaves "
                      f"none of its {n} document{'s' if n != 1 else ''}; set data.eval_fraction=0, evaluate on "
                      f"separate files (data.eval_paths), or give it more documents{more}")
  rows = _rows(cfg, pi, pc)
  info = _report("train", comps, skips, vocab, sum(len(v) for v in views), weights=weights,
                 process=f"{pi}/{pc}", rows=f"{rows.start}..{rows.stop - 1} of {cfg.global_batch_size}")
  return DataIterator(functools.partial(streams.train_pipeline, cfg, comps, views, vocab, weights, rows),
                      vocab_size, info, rows=rows, seq_len=cfg.seq_len, streams=cfg.global_batch_size)


class _NoState(grain.transforms.Map):
  def map(self, batch):
    return batch, None


def _eval_text(cfg: DataConfig, vocab_size: int, pi: int, pc: int) -> DataIterator | None:
  if not cfg.eval_paths and sources.eval_every(cfg.eval_fraction) == 0:
    return None
  comps, _, skips = sources.load_components(cfg, "eval")
  vocab = sources.resolve_vocab(cfg, comps, vocab_size, "eval")
  part = "all" if cfg.eval_paths else "eval"
  k = sources.eval_every(cfg.eval_fraction)
  # Every process packs the same global eval stream and keeps its slice of each global batch:
  # processes see disjoint rows and the same number of batches (collectives stay in step).
  views = [sources.DocIndex(c.source, k, part) for c in comps]
  parts = [sources.doc_blocks(c, vocab, v) for c, v in zip(comps, views)]
  ds = parts[0] if len(parts) == 1 else sources.Concat(parts)
  docs = sum(len(v) for v in views)
  if docs == 0:
    log.warning("data (eval): no held-out documents in %s", ", ".join(c.name for c in comps))
    return None
  rows = _rows(cfg, pi, pc)
  ds = pack(ds.to_iter_dataset(read_options(cfg)), cfg, max(cfg.packing_bins, cfg.global_batch_size),
            shuffle=False, seed=cfg.seed)
  ds = ds.batch(cfg.global_batch_size, drop_remainder=False).map(
      PadRows(rows.start, len(rows), cfg.global_batch_size))
  ds = finish(ds, dataclasses.replace(cfg, worker_count=0)).map(_NoState())
  info = _report("eval", comps, skips, vocab, docs, process=f"{pi}/{pc}")
  return DataIterator(lambda _: iter(ds), vocab_size, info, rows=rows, seq_len=cfg.seq_len,
                      streams=cfg.global_batch_size, checkpointable=False)


# --- public entry points ---------------------------------------------------------------------------


def start_line(info: dict, cfg: DataConfig) -> str:
  """One line for a run's start: what its batches are made of (`info` of the train iterator) and what it
  evaluates on, so that data that is not what was meant shows at once."""
  if info.get("type") == "synthetic":
    return "data: synthetic random tokens (Zipf-distributed), no tokenizer; no eval data"
  weights = info.get("weights") or []
  total = sum(weights) or 1.0
  names = ([f"{n} (weight {w / total:.3g})" for n, w in zip(info["sources"], weights)] if len(weights) > 1
           else info["sources"])  # the share of each source, as the mixture samples them
  k = sources.eval_every(cfg.eval_fraction)
  ev = (f"eval on {cfg.eval_paths}" if cfg.eval_paths else
        f"eval on one document in {k} held out" if k else "no eval data (data.eval_fraction=0)")
  return f"data: {', '.join(names)}: {info['documents']:,} training documents; {info['tokenizer']}; {ev}"


def make_train_iterator(cfg: DataConfig, vocab_size: int, process_index: int = 0,
                        process_count: int = 1) -> DataIterator:
  """Infinite (or `num_epochs`-long) iterator of this process's training batches."""
  _check_process(process_index, process_count)
  cfg = sources.resolve_type(cfg)
  if cfg.type == "synthetic":
    return _synthetic(cfg, vocab_size, process_index, process_count)
  return _train_text(cfg, vocab_size, process_index, process_count)


def make_eval_iterator(cfg: DataConfig, vocab_size: int, process_index: int = 0,
                       process_count: int = 1) -> DataIterator | None:
  """A fresh finite pass over the held-out data, or None when there is none (synthetic data)."""
  _check_process(process_index, process_count)
  cfg = sources.resolve_type(cfg)
  if cfg.type == "synthetic":
    return None
  return _eval_text(cfg, vocab_size, process_index, process_count)


def check_inputs(cfg: DataConfig, vocab_size: int) -> dict:
  """Open and check every training and eval input now, without building a pipeline.

  Stops (DataError) on what the iterators stop on when made: missing or unreadable files, bad
  records (unless skipped), shards whose metadata, record counts or sampled records are wrong, a
  tokenizer that does not load or fit `vocab_size`, eval data tokenized differently from the
  training data. For the trainer before it creates the run directory (make_eval_iterator checks
  the eval inputs as eagerly). Raw text is read (and cached for the iterators); shards open and
  a few records of each are read. Returns {"train_documents": n, "eval_documents": n}.
  """
  cfg = sources.resolve_type(cfg)
  if cfg.type == "synthetic":
    return {"train_documents": 0, "eval_documents": 0}
  comps, _, _ = sources.load_components(cfg, "train")
  vocab = sources.resolve_vocab(cfg, comps, vocab_size)
  k = sources.split_every(cfg)
  out = {"train_documents": sum(len(sources.DocIndex(c.source, k, "train")) for c in comps),
         "eval_documents": 0}
  if cfg.eval_paths:
    comps, _, _ = sources.load_components(cfg, "eval")
    held = sources.resolve_vocab(cfg, comps, vocab_size, "eval")
    if held.sha256 != vocab.sha256:  # resolve_vocab checks it; a bug there must not train on a mismatch
      raise AssertionError(f"eval tokenizer {held.desc} != training tokenizer {vocab.desc}")
    out["eval_documents"] = sum(len(c.source) for c in comps)
  elif k:
    out["eval_documents"] = sum(len(sources.DocIndex(c.source, k, "eval")) for c in comps)
  return out
