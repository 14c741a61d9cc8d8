"""Sample text from a checkpoint: `maxlm generate checkpoint=DIR prompt="..." max_new_tokens=N [--json]`.

checkpoint: a run directory, its checkpoints/ directory or one step directory (the newest complete step
is used), or a Hugging Face directory (config.json + *.safetensors). The tokenizer is the run's
(data.tokenizer: SentencePiece, tokenizer.json or tiktoken; the shipped Austen tokenizer by default) or
the HF directory's tokenizer.json.

Arguments (key=value; `prompt=` and `stop=` may be repeated; prompts decode together as one batch):
  prompt=TEXT          text to continue (required)
  max_new_tokens=N     tokens to generate per prompt (default 64)
  temperature=T        0 = greedy (default); > 0 samples
  top_k=K              keep the K most likely tokens (0 = off)
  top_p=P              keep the most likely tokens whose probabilities sum to P (1 = off)
  seed=S               sampling seed (default 0): the same seed gives the same text
  stop=TEXT            also stop when the generated text ends with TEXT's tokens (EOS always stops)
  add_bos=true|false   prepend BOS to the prompt (default: data.add_bos, as the run trained)
  max_length=N         longest prompt + new tokens (default: the run's data.seq_len / HF's
                       max_position_embeddings)
  model.KEY=VALUE      config overrides, e.g. model.backend=flax model.dtype=float32;
                       data.tokenizer=PATH uses another tokenizer
  --json               print one JSON object per prompt: prompt, text, tokens, finish_reason, timing

Exit codes: 0 done, 2 bad argument, config or tokenizer, 3 missing or unusable checkpoint.
"""

from __future__ import annotations

import json
import sys
import time

from maxlm.cli import UsageError, command_main, parse_args
from maxlm.data import Tokenizer
from maxlm.generation import check_settings, generate
from maxlm.inference import load

_KEYS = {"checkpoint": str, "prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int,
         "top_p": float, "seed": int, "stop": str, "add_bos": bool, "max_length": int}
_REPEATED = ("prompt", "stop")


def _encode(tok: Tokenizer, text: str) -> list[int]:
  return [int(i) for i in tok.encode(text)]


def completion_text(tok: Tokenizer, prompt: list[int], generated: list[int]) -> str:
  """The text the generated tokens add to the prompt: decoded together with the prompt and cut after it
  (a tokenizer may drop a token's leading space when it starts the decoded text)."""
  head = tok.decode(prompt)
  whole = tok.decode(prompt + generated)
  return whole[len(head):] if whole.startswith(head) else tok.decode(generated)


def _strip_stop(tokens: list[int], reason: str, stop_seqs: list[list[int]]) -> list[int]:
  """The generated tokens without the stop token / sequence that ended them (for the printed text)."""
  if reason != "stop":
    return tokens
  for s in sorted(stop_seqs, key=len, reverse=True):
    if len(tokens) >= len(s) and tokens[-len(s):] == s:
      return tokens[:-len(s)]
  return tokens


def run(argv: list[str]) -> int:
  t_start = time.perf_counter()
  own, overrides, flags = parse_args(argv, _KEYS, _REPEATED)
  bad = flags - {"--json"}
  if bad:
    raise UsageError(f"unknown option {sorted(bad)[0]} (options: --json, --help)")
  if not own.get("checkpoint"):
    raise UsageError("checkpoint=<run, checkpoint or Hugging Face directory> is required")
  if not own["prompt"]:
    raise UsageError("prompt=<text> is required")
  check_settings(own.get("max_new_tokens", 64), own.get("temperature", 0.0), own.get("top_k", 0),
                 own.get("top_p", 1.0))
  loaded = load(own["checkpoint"], overrides)
  tok = loaded.tokenizer
  bos = loaded.bos_id if own.get("add_bos", loaded.bos_id is not None) else None
  if own.get("add_bos") and bos is None:
    bos = tok.bos_id if tok.bos_id >= 0 else None
    if bos is None:
      raise UsageError(f"add_bos=true but tokenizer {tok.path} has no BOS token")
  prompts = [([bos] if bos is not None else []) + _encode(tok, p) for p in own["prompt"]]
  stop_seqs = [_encode(tok, s) for s in own["stop"]]
  for text, seq in zip(own["stop"], stop_seqs):
    if not seq:
      raise UsageError(f"stop={text!r} encodes to no tokens")
  max_length = own.get("max_length", loaded.max_length)
  load_s = time.perf_counter() - t_start
  out = generate(loaded.cfg.model, loaded.params, prompts, own.get("max_new_tokens", 64),
                 temperature=own.get("temperature", 0.0), top_k=own.get("top_k", 0),
                 top_p=own.get("top_p", 1.0), seed=own.get("seed", 0), stop_tokens=loaded.stop_ids,
                 stop_sequences=stop_seqs, max_length=max_length, mesh=loaded.mesh)
  n_new = sum(len(t) for t in out.tokens)
  timing = {"load_s": round(load_s, 3), **{k: round(v, 3) for k, v in out.timing.items()},
            "tokens_per_s": round(n_new / out.timing["decode_s"], 1) if out.timing["decode_s"] > 0 else None}
  stops = [[s] for s in loaded.stop_ids] + stop_seqs
  for text, ids, gen, reason in zip(own["prompt"], prompts, out.tokens, out.finish_reasons):
    completion = completion_text(tok, ids, _strip_stop(gen, reason, stops))
    if "--json" in flags:
      print(json.dumps({"prompt": text, "text": completion, "tokens": gen, "prompt_tokens": ids,
                        "finish_reason": reason, "timing": timing}), flush=True)
    else:
      print(text + completion, flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
