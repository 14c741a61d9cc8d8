"""Rebuild the shipped data assets in maxlm/assets/ (reproducible; about 15 s on 2 cores).

  python scripts/build_assets.py [--src ../shared/data/austen_all.txt.xz] [--baselines]

1. austen.txt.xz: Jane Austen's six novels, one paragraph per line (blank-line separated
   paragraphs of the source with their line wrapping joined by single spaces), xz -9e.
2. austen_sp8k.model: an 8192-token SentencePiece BPE (unk/bos/eos = 0/1/2, byte fallback,
   digits split, no normalisation) trained on the training split only: the held-out documents
   (every round(1/eval_fraction)-th paragraph, the default DataConfig's split) are excluded.
3. austen_sp512.model: the same with 512 tokens (256 of them the byte fallback), the tokenizer of
   the default run (configs/default.yml): a cheap LM head for a CPU-sized model.
SentencePiece's BPE trainer is deterministic for a given input and options (single pass, no
sampling: input_sentence_size=0, shuffle_input_sentence=False), so reruns give the same bytes.
--baselines prints unigram/bigram cross-entropies (nats/token) of the held-out split under
that tokenizer, the reference points a trained model's eval loss should beat.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import lzma
import math
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece as spm

from maxlm.config import DataConfig
from maxlm.data.sources import EMBEDDED_CORPUS, eval_every
from maxlm.data.tokenizer import DEFAULT_TOKENIZER, SMALL_TOKENIZER

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT.parent / "shared" / "data" / "austen_all.txt.xz"
SRC_SHA256 = "65b434d16a8755142bfa95ba19c5f9abd0d30cf3dffe3b6793e834f9f56dcc96"
TOKENIZERS = {DEFAULT_TOKENIZER: 8192, SMALL_TOKENIZER: 512}  # file -> vocabulary size


def paragraphs(raw: str) -> list[str]:
  return [" ".join(p.split()) for p in re.split(r"\n\s*\n", raw) if p.strip()]


def train_tokenizer(docs: list[str], out: Path, vocab: int) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    os.chdir(tmp)  # model_prefix is stored in the model: keep it free of the temp path
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix="sp", model_type="bpe", vocab_size=vocab,
        character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=1 << 17, input_sentence_size=0, shuffle_input_sentence=False,
        num_threads=2, minloglevel=2)
    out.write_bytes(Path(f"{tmp}/sp.model").read_bytes())
    os.chdir(ROOT)


def baselines(train: list[str], held: list[str], model: Path, vocab: int) -> None:
  sp = spm.SentencePieceProcessor(model_file=str(model))
  tr = [np.array([1, *ids, 2]) for ids in sp.encode(train)]
  ev = [np.array([1, *ids, 2]) for ids in sp.encode(held)]
  uni = collections.Counter(int(t) for d in tr for t in d[1:])
  big = collections.Counter((int(a), int(b)) for d in tr for a, b in zip(d[:-1], d[1:]))
  ctx = collections.Counter(int(a) for d in tr for a in d[:-1])
  n_uni, v = sum(uni.values()), vocab
  nll_u = nll_b = count = 0.0
  for d in ev:
    for a, b in zip(d[:-1].tolist(), d[1:].tolist()):
      pu = (uni[b] + 1) / (n_uni + v)  # add-one unigram
      lam = ctx[a] / (ctx[a] + 10.0)  # bigram interpolated with the unigram (Witten-Bell-like)
      pb = lam * big[(a, b)] / max(ctx[a], 1) + (1 - lam) * pu
      nll_u -= math.log(pu)
      nll_b -= math.log(pb)
      count += 1
  print(f"{model.name}: held-out split: {len(held)} paragraphs, {int(count)} predicted tokens")
  print(f"  unigram {nll_u / count:.3f} nats/token, interpolated bigram {nll_b / count:.3f} nats/token")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--src", type=Path, default=SRC)
  ap.add_argument("--baselines", action="store_true")
  args = ap.parse_args()
  raw = lzma.decompress(args.src.read_bytes())
  if hashlib.sha256(raw).hexdigest() != SRC_SHA256:
    raise SystemExit(f"{args.src}: unexpected content (sha256 of the raw text differs)")
  docs = paragraphs(raw.decode("utf-8"))
  EMBEDDED_CORPUS.write_bytes(lzma.compress(("\n".join(docs) + "\n").encode(),
                                            preset=9 | lzma.PRESET_EXTREME))
  k = eval_every(DataConfig().eval_fraction)
  train = [d for i, d in enumerate(docs) if not k or i % k]
  held = [d for i, d in enumerate(docs) if k and i % k == 0]
  for path, vocab in TOKENIZERS.items():
    train_tokenizer(train, path, vocab)
  for p in (EMBEDDED_CORPUS, *TOKENIZERS):
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    print(f"{p.relative_to(ROOT)}: {p.stat().st_size:,} bytes, sha256 {digest}")
  print(f"{len(docs)} paragraphs ({len(train)} train, {len(held)} held out: every {k}th)")
  if args.baselines:
    for path, vocab in TOKENIZERS.items():
      baselines(train, held, path, vocab)


if __name__ == "__main__":
  main()
