"""The per-process training pipelines of maxlm before data streams, kept so that a run whose checkpoint
holds per-process data states (`{"grain": ..., "batches": n}`) continues with the same batches.

Process p of P read every P-th training document (p, p + P, ...), shuffled, and packed them into its own
rows; synthetic rows depended on (data.seed, p, step). Such a state restores only onto the same process
count and data config, and the run then stays on these pipelines (its checkpoints keep the old format).
"""

from __future__ import annotations

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data import sources
from maxlm.data.errors import DataError
from maxlm.data.packing import PadRows, finish, pack, read_options


class GrainStates:
  """A Grain iterator -> (batch, {"grain": its state after the batch})."""

  def __init__(self, it):
    self._it = it

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._it)
    return batch, {"grain": self._it.get_state()}

  def close(self) -> None:
    if hasattr(self._it, "close"):
      self._it.close()


class SyntheticBatch(grain.transforms.Map):
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


def _restored(ds: grain.IterDataset, state) -> GrainStates:
  it = iter(ds)
  try:
    it.set_state(state)
  except BaseException:
    if hasattr(it, "close"):
      it.close()
    raise
  return GrainStates(it)


def synthetic(cfg: DataConfig, vocab_size: int, pi: int, pc: int, state) -> GrainStates:
  ds = grain.MapDataset.range(2**62).map(
      SyntheticBatch(cfg.seed, pi, cfg.global_batch_size // pc, cfg.seq_len, vocab_size))
  return _restored(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)), state)


def train_text(cfg: DataConfig, comps, vocab, weights, pi: int, pc: int, state) -> GrainStates:
  k = sources.split_every(cfg)
  parts = []
  for c, comp in enumerate(comps):
    view = sources.DocIndex(comp.source, k, "train", pi, pc)
    if len(view) == 0:
      raise DataError(f"data source '{comp.name}' has no training documents for process {pi} of {pc} "
                      f"({len(comp.source)} documents, eval_fraction {cfg.eval_fraction})")
    parts.append(sources.doc_blocks(
        comp, vocab, view, shuffle_seed=(cfg.seed + 7919 * c) % 2**31 if cfg.shuffle else None,
        epochs=cfg.num_epochs if cfg.num_epochs > 0 else None))
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
  ds = ds.to_iter_dataset(read_options(cfg))
  b = cfg.global_batch_size // pc
  ds = pack(ds, cfg, max(cfg.packing_bins, b), shuffle=cfg.shuffle, seed=cfg.seed)
  # A finite run's last partial batch is padded with empty rows (segment_ids 0), not dropped.
  return _restored(finish(ds.batch(b).map(PadRows(0, b, b)), cfg), state)
