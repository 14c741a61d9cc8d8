"""The text side of a loaded model (`maxlm.Model`): its tokenizer with the BOS it prepends and the ids that stop a
generation, prompts and stop texts as token ids, and the text a generation adds to each prompt.

`run_tokenizer` finds a run's tokenizer (data.tokenizer, else the one its prepared shards record, else the shipped
one; an HF directory's tokenizer.json); `encode_prompts` and `encode_stops` turn text into ids; `completions`
turns `maxlm.generation`'s output back into text (`Model.complete`, which `maxlm generate` prints).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from maxlm.config import DataConfig
from maxlm.data import DataError, Tokenizer, load_tokenizer
from maxlm.data.sources import train_shards_tokenizer
from maxlm.data.tokenizer import special_ids
from maxlm.generation import Generation, GenerationError


@dataclasses.dataclass
class Completions:
  """What `Model.complete` returns, one entry per prompt."""
  texts: list[str]  # the text each generation adds to its prompt (without the stop that ended it)
  tokens: list[list[int]]  # the generated ids (a stop token or sequence that ended the row included)
  prompt_tokens: list[list[int]]  # the prompt's ids as the model read them (BOS first when prepended)
  finish_reasons: list[str]  # "stop" (EOS or a stop text) or "length" (max_new_tokens reached)
  timing: dict[str, float]  # compile_s, prefill_s, decode_s (maxlm.generation)


def run_tokenizer(d: DataConfig, vocab_size: int, extra_eos=()) -> tuple[Tokenizer, int | None, list[int]]:
  """The run's tokenizer (data.tokenizer, else the one its shards record, else the shipped one), the BOS
  to prepend (data.add_bos) and the ids that end a generation (data.eos_id / the tokenizer's EOS, and
  `extra_eos`, e.g. an HF config's eos_token_id list)."""
  path = d.tokenizer
  if not path and d.type != "synthetic":
    rec = train_shards_tokenizer(d)
    path = str(rec["path"]) if rec else ""
  tok = load_tokenizer(path, d.tokenizer_type)
  if tok.vocab_size > vocab_size:
    raise DataError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than the model's "
                    f"model.vocab_size={vocab_size}")
  bos, _ = special_ids(tok, d.add_bos, False, d.bos_id, d.eos_id)
  eos = [d.eos_id if d.eos_id >= 0 else tok.eos_id, *extra_eos]
  return tok, bos, sorted({int(e) for e in eos if e is not None and 0 <= int(e) < vocab_size})


def _encode(tok: Tokenizer, text: str) -> list[int]:
  return [int(i) for i in tok.encode(text)]


def encode_prompts(tok: Tokenizer, texts: Sequence[str], bos_id: int | None, add_bos: bool | None) -> list[list[int]]:
  """Each text's ids, after BOS when the run prepends one (`bos_id`; add_bos=None) or add_bos=True asks for
  it (the tokenizer's own BOS when the run has none). GenerationError when asked for a BOS there is not."""
  bos = bos_id if (bos_id is not None if add_bos is None else add_bos) else None
  if add_bos and bos is None:
    bos = tok.bos_id if tok.bos_id >= 0 else None
    if bos is None:
      raise GenerationError(f"add_bos=true but tokenizer {tok.path} has no BOS token")
  return [([bos] if bos is not None else []) + _encode(tok, t) for t in texts]


def encode_stops(tok: Tokenizer, stops: Sequence[str]) -> list[list[int]]:
  """The ids of each stop text; GenerationError for one that encodes to nothing."""
  seqs = [_encode(tok, s) for s in stops]
  for text, seq in zip(stops, seqs):
    if not seq:
      raise GenerationError(f"stop={text!r} encodes to no tokens")
  return seqs


def completion_text(tok: Tokenizer, prompt: list[int], generated: list[int]) -> str:
  """The text the generated tokens add to the prompt: decoded together with the prompt and cut after it
  (a tokenizer may drop a token's leading space when it starts the decoded text)."""
  head = tok.decode(prompt)
  whole = tok.decode(prompt + generated)
  return whole[len(head):] if whole.startswith(head) else tok.decode(generated)


def strip_stop(tokens: list[int], reason: str, stop_seqs: list[list[int]]) -> list[int]:
  """The generated tokens without the stop token / sequence that ended them (for the text)."""
  if reason != "stop":
    return tokens
  for s in sorted(stop_seqs, key=len, reverse=True):
    if len(tokens) >= len(s) and tokens[-len(s):] == s:
      return tokens[:-len(s)]
  return tokens


def completions(tok: Tokenizer, prompts: list[list[int]], out: Generation, stop_seqs: list[list[int]]) -> Completions:
  """`out` (maxlm.generation's) as text: each row's completion without the stop (one of `stop_seqs`) that ended it."""
  texts = [completion_text(tok, ids, strip_stop(gen, reason, stop_seqs))
           for ids, gen, reason in zip(prompts, out.tokens, out.finish_reasons)]
  return Completions(texts, out.tokens, prompts, out.finish_reasons, out.timing)
