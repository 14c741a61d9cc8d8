"""Train/eval iterators: Grain pipelines from documents to packed [B, T] int32 batches."""

from __future__ import annotations

import dataclasses
import weakref

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data import sources
from maxlm.data.errors import DataError, Skips, first_line, log

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")


class DataIterator:
  """Iterator of batches (dicts of np.int32 [B_local, T]) with checkpointable Grain state.

  Every batch is checked against `vocab_size` so a bad token id stops before the step runs.
  `info` describes the data (documents, skipped records, tokenizer) for logs.
  """

  def __init__(self, it, vocab_size: int, info: dict | None = None):
    self._box = [it]  # emptied on close, so Grain's iterators die before interpreter teardown
    self.vocab_size = vocab_size
    self.info = dict(info or {})
    self.batches = 0
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
    batch = next(self._it)
    hi = max(int(batch["inputs"].max()), int(batch["targets"].max()))
    lo = min(int(batch["inputs"].min()), int(batch["targets"].min()))
    if hi >= self.vocab_size or lo < 0:
      bad = hi if hi >= self.vocab_size else lo
      raise DataError(f"data batch {self.batches} holds token id {bad} outside [0, model.vocab_size="
                      f"{self.vocab_size}) (tokenizer: {self.info.get('tokenizer', '?')}); use a tokenizer "
                      f"that fits the model's vocabulary or raise model.vocab_size")
    self.batches += 1
    return batch

  def get_state(self) -> dict:
    return {"grain": self._it.get_state(), "batches": self.batches}

  def set_state(self, state: dict) -> None:
    """Restore a `get_state()` of an iterator made from the same data config (worker_count too)."""
    try:
      self._it.set_state(state["grain"])
      self.batches = int(state["batches"])
    except (KeyError, TypeError, ValueError, IndexError, AssertionError) as e:
      why = first_line(e)
      why = why if why == type(e).__name__ else f"{type(e).__name__}: {why}"
      raise DataError(f"data iterator state does not fit this data config ({why}); was data.* "
                      f"changed since it was saved?") from None


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


# --- synthetic -----------------------------------------------------------------------------------


class _SyntheticBatch(grain.transforms.Map):
  """Step index -> one random batch; depends only on (seed, process_index, step)."""

  def __init__(self, seed: int, process_index: int, batch: int, seq_len: int, vocab_size: int):
    self.key = (seed, process_index)
    self.shape = (batch, seq_len + 1)
    self.vocab_size = vocab_size

  def map(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((*self.key, step))
    toks = rng.integers(0, self.vocab_size, self.shape, dtype=np.int32)  # [B, T + 1]
    b, t = self.shape[0], self.shape[1] - 1
    return {
        "inputs": toks[:, :-1].copy(),  # [B, T]
        "targets": toks[:, 1:].copy(),  # [B, T]
        "segment_ids": np.ones((b, t), np.int32),  # [B, T]
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),  # [B, T]
    }


def _synthetic(cfg: DataConfig, vocab_size: int, process_index: int, process_count: int):
  ds = grain.MapDataset.range(2**62).map(
      _SyntheticBatch(cfg.seed, process_index, local_batch_size(cfg, process_count), cfg.seq_len,
                      vocab_size))
  it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))
  return DataIterator(it, vocab_size, {"type": "synthetic", "tokenizer": "none (random tokens)"})


# --- documents -> packed rows ------------------------------------------------------------------


class _Chunk(grain.experimental.FlatMapTransform):
  """A block of documents' ids -> shifted (inputs, targets) pieces of <= seq_len tokens.

  Shifting happens per document before packing, so every kept position has its next token
  as target within the same document. A document longer than seq_len + 1 tokens becomes several
  pieces, each its own segment with positions from 0 (no attention across pieces).
  """

  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.max_fan_out = 1 << 20

  def flat_map(self, docs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    t, out = self.seq_len, []
    for ids in docs:
      pairs = np.stack([ids[:-1], ids[1:]], axis=-1)  # [n - 1, 2]: (input, target)
      out += [{"io": pairs[s:s + t]} for s in range(0, len(pairs), t)]
    return out


class _Split(grain.transforms.Map):
  """Packed row {io [T, 2], io_segment_ids [T], io_positions [T]} -> the four batch keys."""

  def map(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"inputs": row["io"][:, 0], "targets": row["io"][:, 1],
            "segment_ids": row["io_segment_ids"], "positions": row["io_positions"]}


def _pack(ds: grain.IterDataset, cfg: DataConfig, bins: int, shuffle: bool) -> grain.IterDataset:
  """Documents -> rows of exactly seq_len tokens (first-fit over `bins` rows, capped segments)."""
  if cfg.max_segments_per_row < 1:
    raise DataError(f"config key 'data.max_segments_per_row' must be >= 1, got {cfg.max_segments_per_row}")
  ds = grain.experimental.FlatMapIterDataset(ds, _Chunk(cfg.seq_len))
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"io": cfg.seq_len}, num_packing_bins=bins, seed=cfg.seed,
      shuffle_bins=shuffle, max_sequences_per_bin=cfg.max_segments_per_row)
  return ds.map(_Split())


def _read_options(cfg: DataConfig) -> grain.ReadOptions:
  if cfg.read_threads < 0 or cfg.worker_count < 0 or cfg.prefetch < 0:
    raise DataError("config keys data.read_threads, data.worker_count and data.prefetch must be >= 0")
  return grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=max(4, 4 * cfg.read_threads))


def _finish(ds: grain.IterDataset, cfg: DataConfig) -> grain.IterDataset:
  if cfg.worker_count:
    from absl import flags  # noqa: PLC0415 - Grain's workers read absl flags; maxlm defines none
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
  if cfg.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
  return ds


def _report(kind: str, comps, skips: Skips, vocab: sources.Vocab, docs: int, **extra) -> dict:
  info = {"type": kind, "sources": [c.name for c in comps], "documents": docs,
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
  parts, docs = [], 0
  for c, comp in enumerate(comps):
    view = sources.DocIndex(comp.source, k, "train", pi, pc)
    if len(view) == 0:
      raise DataError(f"data source '{comp.name}' has no training documents for process {pi} of {pc} "
                      f"({len(comp.source)} documents, eval_fraction {cfg.eval_fraction})")
    docs += len(view)
    parts.append(sources.doc_blocks(
        comp, vocab, view, shuffle_seed=(cfg.seed + 7919 * c) % 2**31 if cfg.shuffle else None,
        epochs=cfg.num_epochs if cfg.num_epochs > 0 else None))
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
  ds = ds.to_iter_dataset(_read_options(cfg))
  b = local_batch_size(cfg, pc)
  ds = _pack(ds, cfg, max(cfg.packing_bins, b), shuffle=cfg.shuffle)
  # A finite run's last partial batch is padded with empty rows (segment_ids 0), not dropped.
  ds = _finish(ds.batch(b).map(_ProcessRows(0, b, b)), cfg)
  info = _report("train", comps, skips, vocab, docs, weights=weights, process=f"{pi}/{pc}")
  return DataIterator(iter(ds), vocab_size, info)


class _ProcessRows(grain.transforms.Map):
  """A global eval batch (maybe short) -> this process's rows, padded with empty rows."""

  def __init__(self, start: int, rows: int, global_rows: int):
    self.start, self.rows, self.global_rows = start, rows, global_rows

  def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in batch.items():
      full = np.zeros((self.global_rows, v.shape[1]), np.int32)  # [global B, T]
      full[:len(v)] = v
      out[k] = full[self.start:self.start + self.rows]  # [B_local, T]
    return out


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
  b = local_batch_size(cfg, pc)
  ds = _pack(ds.to_iter_dataset(_read_options(cfg)), cfg, max(cfg.packing_bins, cfg.global_batch_size),
             shuffle=False)
  ds = ds.batch(cfg.global_batch_size, drop_remainder=False).map(
      _ProcessRows(pi * b, b, cfg.global_batch_size))
  info = _report("eval", comps, skips, vocab, docs, process=f"{pi}/{pc}")
  return DataIterator(iter(_finish(ds, dataclasses.replace(cfg, worker_count=0))), vocab_size, info)


# --- public entry points ---------------------------------------------------------------------------


def make_train_iterator(cfg: DataConfig, vocab_size: int, process_index: int = 0,
                        process_count: int = 1) -> DataIterator:
  """Infinite (or `num_epochs`-long) iterator of this process's training batches."""
  _check_process(process_index, process_count)
  if cfg.type == "synthetic":
    return _synthetic(cfg, vocab_size, process_index, process_count)
  return _train_text(cfg, vocab_size, process_index, process_count)


def make_eval_iterator(cfg: DataConfig, vocab_size: int, process_index: int = 0,
                       process_count: int = 1) -> DataIterator | None:
  """A fresh finite pass over the held-out data, or None when there is none (synthetic data)."""
  _check_process(process_index, process_count)
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
