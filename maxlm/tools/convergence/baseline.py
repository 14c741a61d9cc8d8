"""Count-based reference points for an eval loss: unigram and smoothed bigram cross-entropies.

A trained language model's held-out loss means little on its own; what it beats does. This module
counts unigrams and bigrams on the training split of a `DataConfig` (the same documents, tokenizer and
BOS/EOS the trainer uses) and scores the held-out split (the same pairs the trainer's eval predicts:
every (token, next token) of every held-out document, chunking never drops one) with

* add-k bigram: p(b|a) = (c(a,b) + k) / (c(a) + k V);
* interpolated bigram: p(b|a) = l(a) c(a,b)/c(a) + (1 - l(a)) p1(b), l(a) = c(a) / (c(a) + beta), with p1 the
  add-one unigram (Jelinek-Mercer interpolation whose weight grows with the context count, as in
  Witten-Bell);

each with its smoothing constant (k, beta) tuned *on the held-out split itself*: the baseline is as
good as a bigram can be made there, an optimistic bar for the model to clear. `bigram` is the better
of the two.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from maxlm.config import DataConfig
from maxlm.data import sources
from maxlm.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class Baselines:
  """Cross-entropies in nats per predicted token of the held-out split."""
  unigram: float  # add-one
  add_k: float
  k: float
  interpolated: float
  beta: float
  eval_tokens: int  # predicted tokens (pairs) in the held-out split
  train_tokens: int

  @property
  def bigram(self) -> float:
    return min(self.add_k, self.interpolated)

  def describe(self) -> str:
    return (f"bigram {self.bigram:.3f} nats/token on {self.eval_tokens} held-out predictions (interpolated "
            f"{self.interpolated:.3f} at beta={self.beta:.3g}, add-k {self.add_k:.3f} at k={self.k:.3g}; "
            f"unigram {self.unigram:.3f}; {self.train_tokens} training tokens)")


def split_documents(cfg: DataConfig, vocab_size: int, part: str) -> list[np.ndarray]:
  """The `part` ('train' or 'eval') documents of `cfg` as token arrays with BOS/EOS, as the trainer reads them."""
  if cfg.type == "synthetic":
    raise DataError("data.type=synthetic has no text to count bigrams on")
  comps, _, _ = sources.load_components(cfg, part)
  vocab = sources.resolve_vocab(cfg, comps, vocab_size, part)
  k = sources.split_every(cfg)
  if part == "eval" and not cfg.eval_paths and not k:
    raise DataError("no held-out split (data.eval_fraction=0 and no data.eval_paths)")
  view_part = "all" if part == "eval" and cfg.eval_paths else part
  docs = []
  for c in comps:
    for block in sources.doc_blocks(c, vocab, sources.DocIndex(c.source, k, view_part)):
      docs += block
  return docs


def pairs(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """(context, next token) of every position that has a next token in the same document."""
  a = [d[:-1] for d in docs if len(d) > 1]
  b = [d[1:] for d in docs if len(d) > 1]
  if not a:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  return np.concatenate(a).astype(np.int64), np.concatenate(b).astype(np.int64)  # [N], [N]


def _golden(f, lo: float, hi: float, iters: int = 60) -> float:
  """Minimizer of a unimodal f on [lo, hi] (golden-section search in the given coordinates)."""
  g = (math.sqrt(5) - 1) / 2
  c, d = hi - g * (hi - lo), lo + g * (hi - lo)
  fc, fd = f(c), f(d)
  for _ in range(iters):
    if fc < fd:
      hi, d, fd = d, c, fc
      c = hi - g * (hi - lo)
      fc = f(c)
    else:
      lo, c, fc = c, d, fd
      d = lo + g * (hi - lo)
      fd = f(d)
  return (lo + hi) / 2


def bigram_baselines(train_docs: list[np.ndarray], eval_docs: list[np.ndarray], vocab_size: int) -> Baselines:
  """Unigram, add-k and interpolated bigram cross-entropies of `eval_docs` from counts on `train_docs`."""
  ta, tb = pairs(train_docs)
  ea, eb = pairs(eval_docs)
  if not len(ea) or not len(ta):
    raise DataError("the bigram baseline needs training and held-out documents with at least two tokens")
  v = int(vocab_size)
  uni = np.bincount(tb, minlength=v).astype(np.float64)  # [V] counts of predicted tokens
  ctx = np.bincount(ta, minlength=v).astype(np.float64)  # [V] counts of contexts
  keys, counts = np.unique(ta * v + tb, return_counts=True)
  q = ea * v + eb
  at = np.clip(np.searchsorted(keys, q), 0, len(keys) - 1)
  c_ab = np.where(keys[at] == q, counts[at], 0).astype(np.float64)  # [N_eval]
  c_a = ctx[ea]  # [N_eval]
  p1 = (uni[eb] + 1.0) / (uni.sum() + v)  # [N_eval] add-one unigram

  def add_k(log_k: float) -> float:
    k = math.exp(log_k)
    return float(-np.mean(np.log((c_ab + k) / (c_a + k * v))))

  def interp(log_beta: float) -> float:
    beta = math.exp(log_beta)
    lam = c_a / (c_a + beta)
    p = lam * c_ab / np.maximum(c_a, 1.0) + (1 - lam) * p1
    return float(-np.mean(np.log(p)))

  log_k = _golden(add_k, math.log(1e-6), math.log(10.0))
  log_beta = _golden(interp, math.log(1e-3), math.log(1e4))
  return Baselines(unigram=float(-np.mean(np.log(p1))), add_k=add_k(log_k), k=math.exp(log_k),
                   interpolated=interp(log_beta), beta=math.exp(log_beta), eval_tokens=int(len(ea)),
                   train_tokens=int(sum(len(d) for d in train_docs)))


def data_baselines(cfg: DataConfig, vocab_size: int) -> Baselines:
  """`bigram_baselines` of `cfg`'s training and held-out splits."""
  return bigram_baselines(split_documents(cfg, vocab_size, "train"), split_documents(cfg, vocab_size, "eval"),
                          vocab_size)
