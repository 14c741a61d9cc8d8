"""Write configs/convergence/data/copy.txt.xz, the corpus of the cpu suite's `copy` case (reproducible).

  python scripts/make_convergence_data.py

Each line (one document) is 8 words drawn at random from 64 common words that the shipped Austen
tokenizer keeps as single tokens, then the same 8 words again. The first half carries log(64) = 4.16
nats a token; the second half is free for a model that attends exactly 8 tokens back, which needs
working relative positions (RoPE). A broken RoPE leaves the copy unlearned or blurred, a loss gap of
tenths of a nat on the whole split where the embedded-prose cases move by hundredths.
"""

from __future__ import annotations

import lzma
from pathlib import Path

import numpy as np
import sentencepiece as spm

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "configs" / "convergence" / "data" / "copy.txt.xz"
TOKENIZER = ROOT / "maxlm" / "assets" / "austen_sp8k.model"
WORDS, HALF, DOCS, SEED = 64, 8, 3000, 0


def main() -> None:
  sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
  words = []
  for i in range(sp.get_piece_size()):
    piece = sp.id_to_piece(i)
    w = piece[1:]
    if piece.startswith("\u2581") and w.isalpha() and w.islower() and len(w) >= 3 and sp.encode(f"{w} {w}") == [i, i]:
      words.append(w)
    if len(words) == WORDS:
      break
  rng = np.random.default_rng(SEED)
  lines = []
  for _ in range(DOCS):
    half = [words[j] for j in rng.integers(0, WORDS, HALF)]
    lines.append(" ".join(half + half))
  OUT.parent.mkdir(parents=True, exist_ok=True)
  OUT.write_bytes(lzma.compress(("\n".join(lines) + "\n").encode(), preset=9))
  print(f"{OUT}: {DOCS} documents of {2 * HALF} words from {WORDS} single-token words, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
  main()
