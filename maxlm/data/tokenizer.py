"""Offline tokenizers behind one small interface: SentencePiece, HF `tokenizer.json`, tiktoken.

`load_tokenizer(path)` detects the format from the file's content (a Llama 3 `tokenizer.model`
is a tiktoken rank file despite its name); `kind=` forces one. Any failure is a `DataError`.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from maxlm.data.errors import DataError, first_line

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_TOKENIZER = ASSETS / "austen_sp8k.model"  # built by scripts/build_assets.py
SMALL_TOKENIZER = ASSETS / "austen_sp512.model"  # the default run's (configs/default.yml); same script
KINDS = ("auto", "sentencepiece", "hf", "tiktoken")

# Llama 3 pre-tokenizer split and its 256 special tokens placed after its 128,000 BPE ranks. Other
# rank files get only BOS and EOS (the first two of them) right after their ranks.
LLAMA3_RANKS = 128_000
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_NAMED = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                 "<|python_tag|>")
LLAMA3_SPECIALS = (*_LLAMA3_NAMED,  # then reserved tokens 2.. up to 256 specials in all
                   *(f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(_LLAMA3_NAMED) + 2)))
HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
HF_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


class Tokenizer:
  """Text -> int32 token ids. `bos_id`/`eos_id` are -1 when the tokenizer has none."""

  kind = ""

  def __init__(self, path: Path):
    self.path = path
    self.vocab_size = 0
    self.bos_id = -1
    self.eos_id = -1

  def encode(self, text: str) -> np.ndarray:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
    raise NotImplementedError

  def decode(self, ids) -> str:
    raise NotImplementedError

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self.path.read_bytes()).hexdigest()

  def __reduce__(self):  # pickled by path: Grain worker processes reload it
    return (load_tokenizer, (str(self.path), self.kind))

  def __repr__(self) -> str:
    return (f"{self.kind} tokenizer {self.path} (vocab {self.vocab_size}, bos {self.bos_id}, "
            f"eos {self.eos_id})")


class SentencePieceTokenizer(Tokenizer):
  kind = "sentencepiece"

  def __init__(self, path: Path):
    super().__init__(path)
    import sentencepiece as spm  # noqa: PLC0415
    self._sp = spm.SentencePieceProcessor(model_file=str(path))
    self.vocab_size = self._sp.vocab_size()
    self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()

  def encode_batch(self, texts, num_threads=1):
    ids = self._sp.encode(list(texts), num_threads=num_threads)
    return [np.asarray(x, np.int32) for x in ids]

  def decode(self, ids):
    return self._sp.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
  kind = "hf"

  def __init__(self, path: Path):
    super().__init__(path)
    import tokenizers  # noqa: PLC0415
    self._tok = tokenizers.Tokenizer.from_file(str(path))
    # Ids may have gaps (a WordLevel vocab can be sparse): the embedding needs the largest id + 1.
    ids = self._tok.get_vocab(with_added_tokens=True).values()
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    self.bos_id = _first_id(self._tok.token_to_id, HF_BOS)
    self.eos_id = _first_id(self._tok.token_to_id, HF_EOS)

  def encode_batch(self, texts, num_threads=1):
    out = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in out]

  def decode(self, ids):
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
  """A tiktoken BPE rank file (`base64-token rank` per line) with Llama 3's pattern.

  Specials follow the ranks: Llama 3's 256 for a Llama-3-sized file (128,000 ranks: BOS 128000,
  EOS 128001, vocabulary 128,256), else only BOS and EOS (vocabulary = ranks + 2).
  """

  kind = "tiktoken"

  def __init__(self, path: Path):
    super().__init__(path)
    import tiktoken  # noqa: PLC0415
    from tiktoken.load import load_tiktoken_bpe  # noqa: PLC0415
    ranks = load_tiktoken_bpe(str(path))
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
      raise ValueError("ranks are not 0..N-1")
    names = LLAMA3_SPECIALS if n == LLAMA3_RANKS else LLAMA3_SPECIALS[:2]
    specials = {tok: n + i for i, tok in enumerate(names)}
    self._enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=specials)
    self.vocab_size = n + len(specials)
    self.bos_id, self.eos_id = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]

  def encode_batch(self, texts, num_threads=1):
    # encode_ordinary: text that spells a special token stays plain text.
    ids = self._enc.encode_ordinary_batch(list(texts), num_threads=max(1, num_threads))
    return [np.asarray(x, np.int32) for x in ids]

  def decode(self, ids):
    return self._enc.decode([int(i) for i in ids])


_CLASSES = {c.kind: c for c in (SentencePieceTokenizer, HFTokenizer, TiktokenTokenizer)}


def _first_id(lookup, names) -> int:
  for name in names:
    i = lookup(name)
    if i is not None:
      return i
  return -1


def detect_kind(path: Path) -> str:
  """Guess the format from the first bytes: JSON -> hf, `base64 rank` lines -> tiktoken."""
  head = path.read_bytes()[:4096]
  if head.lstrip().startswith(b"{"):
    return "hf"
  first = head.split(b"\n", 1)[0].strip()
  if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", first):
    return "tiktoken"
  return "sentencepiece"


def tokenizer_path(path: str | Path) -> Path:
  """`data.tokenizer` as a path: "" is the shipped 8k model; a bare file name that is not in the working
  directory but is in maxlm/assets/ (`austen_sp512.model`) is that shipped file, so configs can name one
  wherever maxlm is installed or run from."""
  if not str(path):
    return DEFAULT_TOKENIZER
  p = Path(path)
  if len(p.parts) == 1 and not p.exists() and (ASSETS / p).is_file():
    return ASSETS / p
  return p


def load_tokenizer(path: str | Path = "", kind: str = "auto") -> Tokenizer:
  """Load a tokenizer from a local file (or a directory holding tokenizer.json/tokenizer.model).

  `path=""` is the shipped 8k SentencePiece BPE trained on the embedded Austen corpus; a bare name of a
  shipped file (`austen_sp512.model`) loads that one (`tokenizer_path`).
  """
  if kind not in KINDS:
    raise DataError(f"config key 'data.tokenizer_type' must be one of {', '.join(KINDS)}; got {kind!r}")
  if "://" in str(path):
    raise DataError(f"tokenizer '{path}' is a URL; tokenizers load offline from a local path")
  p = tokenizer_path(path)
  if p.is_dir():
    found = [p / n for n in ("tokenizer.json", "tokenizer.model") if (p / n).is_file()]
    if not found:
      raise DataError(f"tokenizer directory '{p}' holds neither tokenizer.json nor tokenizer.model")
    p = found[0]
  if not p.is_file():
    raise DataError(f"tokenizer file '{p}' not found")
  try:
    kind = detect_kind(p) if kind == "auto" else kind
    tok = _CLASSES[kind](p)
  except Exception as e:  # noqa: BLE001 - the libraries raise many types; report one line
    raise DataError(f"cannot load tokenizer '{p}' as {kind}: {first_line(e)}") from None
  if tok.vocab_size <= 0:
    raise DataError(f"tokenizer '{p}' ({kind}) has an empty vocabulary")
  return tok


def special_ids(tok: Tokenizer, add_bos: bool, add_eos: bool, bos_id: int = -1,
                eos_id: int = -1) -> tuple[int | None, int | None]:
  """The BOS/EOS ids to add around each document (None = don't add), from config or tokenizer."""
  out = []
  for name, add, override, own in (("bos", add_bos, bos_id, tok.bos_id),
                                    ("eos", add_eos, eos_id, tok.eos_id)):
    if not add:
      out.append(None)
      continue
    i = override if override >= 0 else own
    if i < 0:
      raise DataError(f"tokenizer '{tok.path}' has no {name.upper()} token; set data.{name}_id=<id> "
                      f"or data.add_{name}=false")
    if i >= tok.vocab_size:
      raise DataError(f"data.{name}_id={i} is outside the tokenizer's vocabulary ({tok.vocab_size})")
    out.append(int(i))
  return out[0], out[1]


def padded_vocab(n: int) -> int:
  """`n` rounded up to a multiple of 128 (embedding and LM-head shapes that tile well)."""
  return -(-n // 128) * 128


def vocab_hint(n: int) -> str:
  """What to set for a model to hold an `n`-token vocabulary."""
  return f"set model.vocab_size={padded_vocab(n)} ({n} rounded up to a multiple of 128; at least {n})"


def check_vocab(tok: Tokenizer, vocab_size: int) -> None:
  """Stop before training when the tokenizer can emit ids the model's embedding cannot hold."""
  if tok.vocab_size > vocab_size:
    raise DataError(f"tokenizer '{tok.path}' has {tok.vocab_size} tokens but model.vocab_size is "
                    f"{vocab_size}; {vocab_hint(tok.vocab_size)}")
