"""Evaluate a checkpoint: `maxlm eval checkpoint=DIR [data.KEY=VALUE ...]` prints loss, perplexity, bits per byte.

checkpoint: a run directory, its checkpoints/ directory or one step directory (newest complete step), or
a Hugging Face directory. The data is the run's configured data (its held-out split: every
round(1/data.eval_fraction)-th document) unless overridden, e.g. `data.type=text
data.eval_paths=new.txt` (then every document of those files; the format comes from the extension,
and a run trained on synthetic tokens reads them as text). Any config key may be overridden
(`train.eval_steps=N` limits the batches, `data.seq_len`, `data.global_batch_size`, `model.dtype`, ...).

Prints one JSON line: loss (mean next-token NLL in nats over every target token: the sum over all
batches divided by the token count, not a mean of batch means), perplexity = exp(loss), tokens,
bytes, bits_per_byte = loss * tokens / (ln 2 * bytes), batches, step, time_s. `bytes` is the UTF-8
length of the evaluated text: for every packed segment (a document, or a piece of a document split
across rows), its target tokens without BOS/EOS ids, decoded by the tokenizer, encoded as UTF-8.

Exit codes: 0 done, 2 bad argument, config or data, 3 missing or unusable checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any

import flax
import jax
import numpy as np

from maxlm.checkpoint.paths import step_number
from maxlm.cli import UsageError, command_main, parse_args
from maxlm.data import DataError, Tokenizer
from maxlm.evaluate import token_weighted
from maxlm.inference import Loaded, load
from maxlm.layers import resolve_backend
from maxlm.model import Transformer
from maxlm.scope import model_scope
from maxlm.sharding import batch_sharding, replicated
from maxlm.step import make_eval_step

_KEYS = {"checkpoint": str}


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
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
          "bits_per_byte": loss_sum / (math.log(2) * n_bytes) if n_bytes else None,
          "tokens": int(tokens), "bytes": int(n_bytes)}


def evaluate(loaded: Loaded, batches, max_batches: int = 0) -> dict:
  """Token-weighted loss over `batches` (dicts of int32 [B, T] inputs/targets/segment_ids/positions)."""
  cfg, mesh = loaded.cfg, loaded.mesh
  # The trainer's own eval step (the same loss, chunked over the LM head when model.loss_chunk > 0).
  step = jax.jit(make_eval_step(Transformer(cfg.model, max_segments=cfg.data.max_segments_per_row),
                                packed=True))
  weights = _Weights(loaded.params, {})

  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  tok = loaded.tokenizer
  skip = [loaded.bos_id, *loaded.stop_ids, tok.bos_id, tok.eos_id]
  n_bytes = [0]

  def run_batch(batch):
    rows = batch["targets"].shape[0]
    where = batch_sharding(mesh) if rows % dp == 0 else replicated(mesh)  # rows split over data x fsdp
    with model_scope(cfg.model, resolve_backend(cfg.model.backend), mesh, quantized=False):
      return step(weights, jax.device_put(dict(batch), where))

  def count_bytes(batch):
    n_bytes[0] += segment_bytes(tok, batch["targets"], batch["segment_ids"], skip)

  sums = token_weighted(run_batch, batches, max_batches, on_batch=count_bytes)  # the trainer's loop too
  if sums.tokens == 0:
    raise DataError("the eval data holds no tokens")
  return {**summarize(sums.loss_sum, sums.tokens, n_bytes[0]), "batches": sums.batches}


def run(argv: list[str]) -> int:
  t0 = time.perf_counter()
  own, overrides, flags = parse_args(argv, _KEYS)
  if flags:
    raise UsageError(f"unknown option {sorted(flags)[0]} (options: --help)")
  if not own.get("checkpoint"):
    raise UsageError("checkpoint=<run, checkpoint or Hugging Face directory> is required")
  loaded = load(own["checkpoint"], overrides)
  from maxlm.data import make_eval_iterator  # noqa: PLC0415 - Grain starts only when there is work
  d = loaded.cfg.data
  if d.eval_paths and d.type == "synthetic":  # a run on random tokens, evaluated on files
    d = dataclasses.replace(d, type="text")
  it = make_eval_iterator(d, loaded.cfg.model.vocab_size)
  if it is None:
    raise DataError(f"no eval data for data.type={d.type}: give files with data.type=text|jsonl|parquet "
                    f"data.eval_paths=..., or a data.eval_fraction > 0 of the configured data")
  try:
    out = evaluate(loaded, it, loaded.cfg.train.eval_steps)
  finally:
    it.close()
  # The step of a checkpoint step directory; None for an HF directory or a `convert hf-to-maxlm` tree.
  out["step"] = step_number(loaded.step_dir) if loaded.step_dir is not None else None
  out["checkpoint"] = str(loaded.step_dir or own["checkpoint"])
  out["time_s"] = round(time.perf_counter() - t0, 3)
  print(json.dumps(out), flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
