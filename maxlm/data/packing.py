"""Documents -> packed rows, and the read/worker/prefetch options every pipeline shares."""

from __future__ import annotations

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data.errors import DataError

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")


class Chunk(grain.experimental.FlatMapTransform):
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


class Split(grain.transforms.Map):
  """Packed row {io [T, 2], io_segment_ids [T], io_positions [T]} -> the four batch keys."""

  def map(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"inputs": row["io"][:, 0], "targets": row["io"][:, 1],
            "segment_ids": row["io_segment_ids"], "positions": row["io_positions"]}


def pack(ds: grain.IterDataset, cfg: DataConfig, bins: int, shuffle: bool, seed: int) -> grain.IterDataset:
  """Documents -> rows of exactly seq_len tokens (first-fit over `bins` rows, capped segments; with
  `shuffle` each packed group of rows comes out in an order drawn from `seed`)."""
  if cfg.max_segments_per_row < 1:
    raise DataError(f"config key 'data.max_segments_per_row' must be >= 1, got {cfg.max_segments_per_row}")
  ds = grain.experimental.FlatMapIterDataset(ds, Chunk(cfg.seq_len))
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"io": cfg.seq_len}, num_packing_bins=bins, seed=seed,
      shuffle_bins=shuffle, max_sequences_per_bin=cfg.max_segments_per_row)
  return ds.map(Split())


class PadRows(grain.transforms.Map):
  """A batch of rows (maybe short) -> rows [start, start + rows) of it padded to `global_rows` with
  empty rows (all 0: segment_ids 0 is padding)."""

  def __init__(self, start: int, rows: int, global_rows: int):
    self.start, self.rows, self.global_rows = start, rows, global_rows

  def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in batch.items():
      full = np.zeros((self.global_rows, v.shape[1]), np.int32)  # [global B, T]
      full[:len(v)] = v
      out[k] = full[self.start:self.start + self.rows]  # [B_local, T]
    return out


def check_threads(cfg: DataConfig) -> None:
  if cfg.read_threads < 0 or cfg.worker_count < 0 or cfg.prefetch < 0:
    raise DataError("config keys data.read_threads, data.worker_count and data.prefetch must be >= 0")


def read_options(cfg: DataConfig, threads: int | None = None) -> grain.ReadOptions:
  """Grain's reading threads (data.read_threads, or `threads`) and their read-ahead."""
  check_threads(cfg)
  n = cfg.read_threads if threads is None else threads
  return grain.ReadOptions(num_threads=n, prefetch_buffer_size=max(4, 4 * n))


def workers(ds: grain.IterDataset, n: int) -> grain.IterDataset:
  """Run `ds` in `n` Grain worker processes (0: in this process); each worker gets the slice
  `slice(i, None, n)` of `ds`, and their elements are interleaved round-robin."""
  if not n:
    return ds
  from absl import flags  # noqa: PLC0415 - Grain's workers read absl flags; maxlm defines none
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=n))


def prefetch(ds: grain.IterDataset, cfg: DataConfig) -> grain.IterDataset:
  """data.prefetch elements prepared ahead in a background thread."""
  if cfg.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
  return ds


def finish(ds: grain.IterDataset, cfg: DataConfig) -> grain.IterDataset:
  """data.worker_count worker processes, then data.prefetch (the eval and pre-stream pipelines)."""
  check_threads(cfg)
  return prefetch(workers(ds, cfg.worker_count), cfg)
