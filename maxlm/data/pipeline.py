"""Train/eval iterators: Grain pipelines from documents to packed [B, T] int32 batches."""

from __future__ import annotations

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data.errors import DataError, log

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")


class DataIterator:
  """Iterator of batches (dicts of np.int32 [B_local, T]) with checkpointable Grain state.

  Every batch is checked against `vocab_size` so a bad token id stops before the step runs.
  `info` describes the data (documents, skipped records, tokenizer) for logs.
  """

  def __init__(self, it, vocab_size: int, info: dict | None = None):
    self._it = it
    self.vocab_size = vocab_size
    self.info = dict(info or {})
    self.batches = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._it)
    hi = max(int(batch["inputs"].max()), int(batch["targets"].max()))
    if hi >= self.vocab_size or min(int(batch["inputs"].min()), int(batch["targets"].min())) < 0:
      raise DataError(f"data batch {self.batches} holds token id {hi} outside [0, model.vocab_size="
                      f"{self.vocab_size}) (tokenizer: {self.info.get('tokenizer', '?')}); use a tokenizer "
                      f"that fits the model's vocabulary or raise model.vocab_size")
    self.batches += 1
    return batch

  def get_state(self) -> dict:
    return {"grain": self._it.get_state(), "batches": self.batches}

  def set_state(self, state: dict) -> None:
    self._it.set_state(state["grain"])
    self.batches = int(state["batches"])


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


# --- public entry points ---------------------------------------------------------------------------


def make_train_iterator(cfg: DataConfig, vocab_size: int, process_index: int = 0,
                        process_count: int = 1) -> DataIterator:
  """Infinite (or `num_epochs`-long) iterator of this process's training batches."""
  _check_process(process_index, process_count)
  if cfg.type == "synthetic":
    return _synthetic(cfg, vocab_size, process_index, process_count)
  raise DataError(f"data.type={cfg.type!r} is not implemented yet")


def make_eval_iterator(cfg: DataConfig, vocab_size: int, process_index: int = 0,
                       process_count: int = 1) -> DataIterator | None:
  """A fresh finite pass over the held-out data, or None when there is none (synthetic data)."""
  _check_process(process_index, process_count)
  if cfg.type == "synthetic":
    return None
  raise DataError(f"data.type={cfg.type!r} is not implemented yet")
