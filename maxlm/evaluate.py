"""The one evaluation loop: a token-weighted loss over batches, used by the trainer's periodic eval and by
`Model.eval` (`maxlm eval`).

`token_weighted(run_batch, batches, max_batches, on_batch)` runs each batch through `run_batch` (a jitted eval
step that returns the summed token loss `loss_sum` and the token count `tokens`), adds them up, and returns the
sums: the loss is sum of token losses / number of tokens, never a mean of batch means. `on_batch(batch)` lets a
caller count something more per batch (`maxlm eval` counts the bytes of the text for bits per byte).

`evaluate_params` evaluates a model's parameters with the trainer's own eval step and reports loss, perplexity
and bits per byte (`summarize`, `segment_bytes`); `eval_batches` reads a config's eval data for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import flax
import jax
import numpy as np

from maxlm.config import Config
from maxlm.data import DataError, Tokenizer
from maxlm.layers import resolve_backend
from maxlm.model import Transformer
from maxlm.scope import model_scope
from maxlm.parallel.sharding import batch_sharding, replicated
from maxlm.step import make_eval_step


def perplexity(loss: float) -> float:
  """exp(loss), the loss clamped at 700 nats so that a diverged run's perplexity stays a finite float (exp(709.8)
  is the largest)."""
  return math.exp(min(loss, 700.0))


@dataclasses.dataclass(frozen=True)
class Sums:
  loss_sum: float
  tokens: float
  batches: int

  @property
  def loss(self) -> float:
    return self.loss_sum / self.tokens

  @property
  def perplexity(self) -> float:
    return perplexity(self.loss)


def token_weighted(run_batch: Callable[[dict], dict], batches: Iterable[dict], max_batches: int = 0,
                   on_batch: Callable[[dict], None] | None = None) -> Sums:
  """Sums of the token losses and tokens over `batches` (at most `max_batches`; 0 = all)."""
  loss_sum, tokens, n = 0.0, 0.0, 0
  for batch in batches:
    if max_batches and n >= max_batches:
      break
    out = jax.device_get(run_batch(batch))
    loss_sum += float(out["loss_sum"])
    tokens += float(out["tokens"])
    if on_batch is not None:
      on_batch(batch)
    n += 1
  return Sums(loss_sum, tokens, n)


@flax.struct.dataclass
class _Weights:
  """What the eval step reads of a train state."""
  params: Any
  model_state: Any


def segment_bytes(tok: Tokenizer, targets: np.ndarray, segment_ids: np.ndarray, skip_ids=()) -> int:
  """UTF-8 bytes of the decoded target tokens of every segment (row-wise, segment_ids > 0), without
  `skip_ids` (BOS/EOS). targets, segment_ids: [B, T]."""
  skip = np.asarray(sorted(set(int(i) for i in skip_ids if i is not None and i >= 0)), np.int32)
  total = 0
  for row_t, row_s in zip(targets, segment_ids):
    for s in np.unique(row_s[row_s > 0]):
      ids = row_t[(row_s == s) & ~np.isin(row_t, skip)]
      if ids.size:
        total += len(tok.decode(ids.tolist()).encode("utf-8"))
  return total


def summarize(loss_sum: float, tokens: float, n_bytes: int) -> dict:
  """loss (nats/token), perplexity and bits per byte from the summed NLL, token and byte counts."""
  loss = loss_sum / tokens
  return {"loss": loss, "perplexity": perplexity(loss),
          "bits_per_byte": loss_sum / (math.log(2) * n_bytes) if n_bytes else None,
          "tokens": int(tokens), "bytes": int(n_bytes)}


def evaluate_params(cfg: Config, params, mesh, tok: Tokenizer, skip_ids, batches, max_batches: int = 0) -> dict:
  """Token-weighted loss over `batches` (dicts of int32 [B, T] inputs/targets/segment_ids/positions), with the
  bytes of their text (`tok`'s decoding, without `skip_ids`) for bits per byte."""
  # The trainer's own eval step (the same loss, chunked over the LM head when model.loss_chunk > 0).
  step = jax.jit(make_eval_step(Transformer(cfg.model, max_segments=cfg.data.max_segments_per_row),
                                packed=True))
  weights = _Weights(params, {})
  dp = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  n_bytes = [0]

  def run_batch(batch):
    rows = batch["targets"].shape[0]
    where = batch_sharding(mesh) if rows % dp == 0 else replicated(mesh)  # rows split over data x fsdp x expert
    with model_scope(cfg.model, resolve_backend(cfg.model.backend), mesh, quantized=False):
      return step(weights, jax.device_put(dict(batch), where))

  def count_bytes(batch):
    n_bytes[0] += segment_bytes(tok, batch["targets"], batch["segment_ids"], skip_ids)

  sums = token_weighted(run_batch, batches, max_batches, on_batch=count_bytes)  # the trainer's loop too
  if sums.tokens == 0:
    raise DataError("the eval data holds no tokens")
  return {**summarize(sums.loss_sum, sums.tokens, n_bytes[0]), "batches": sums.batches}


def eval_batches(cfg: Config):
  """An iterator (close it after use) over the eval data of `cfg`: data.eval_paths, else the held-out split of
  the configured data. A run trained on synthetic tokens reads its data.eval_paths as text."""
  from maxlm.data import make_eval_iterator  # noqa: PLC0415 - Grain starts only when there is work
  d = cfg.data
  if d.eval_paths and d.type == "synthetic":  # a run on random tokens, evaluated on files
    d = dataclasses.replace(d, type="text")
  it = make_eval_iterator(d, cfg.model.vocab_size)
  if it is None:
    raise DataError(f"no eval data for data.type={d.type}: give files with data.type=text|jsonl|parquet "
                    f"data.eval_paths=..., or a data.eval_fraction > 0 of the configured data")
  return it
