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

import dataclasses
import json
import sys
import time
from pathlib import Path

from maxlm.api import Model, find_step_dir, is_hf_dir, read_step_config
from maxlm.checkpoint import CheckpointError
from maxlm.cli import command_main
from maxlm.config import Config, DataConfig, load_config
from maxlm.data import DataError, Tokenizer, load_tokenizer
from maxlm.data.sources import train_shards_tokenizer
from maxlm.data.tokenizer import special_ids
from maxlm.errors import BadInput
from maxlm.generation import check_settings, generate

_KEYS = {"checkpoint": str, "prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int,
         "top_p": float, "seed": int, "stop": str, "add_bos": bool, "max_length": int}
_REPEATED = ("prompt", "stop")


class UsageError(BadInput, ValueError):
  """A bad command-line argument (one line)."""


@dataclasses.dataclass
class Loaded:
  """A model ready for inference: its run config (model and data sections), parameters, tokenizer."""
  cfg: Config
  params: object
  tokenizer: Tokenizer | None
  bos_id: int | None  # prepended to prompts (None: nothing)
  stop_ids: list[int]  # EOS and the like
  max_length: int | None
  source: str  # "run" or "hf"
  step_dir: Path | None = None
  mesh: object = None  # the parameters' mesh


def parse_args(argv: list[str], keys: dict[str, type], repeated=()) -> tuple[dict, list[str], set[str]]:
  """key=value words -> (own settings, config overrides (dotted keys), --flags)."""
  own: dict = {k: [] for k in repeated}
  overrides, flags = [], set()
  for word in argv:
    if word.startswith("--") and "=" not in word:
      flags.add(word)
      continue
    if "=" not in word:
      raise UsageError(f"argument {word!r} is not key=value (see --help)")
    key, value = word.split("=", 1)
    if "." in key:
      overrides.append(word)
      continue
    if key not in keys:
      raise UsageError(f"unknown argument {key!r} (arguments: {', '.join(keys)}; config keys are dotted, "
                       f"e.g. model.dtype=float32)")
    own[key] = _convert(key, value, keys[key]) if key not in repeated else own[key] + [value]
  return own, overrides, flags


def _convert(key: str, value: str, typ: type):
  try:
    if typ is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError
      return value.lower() in ("true", "1")
    return typ(value)
  except ValueError:
    raise UsageError(f"argument {key}={value!r} is not {'a boolean' if typ is bool else 'an ' + typ.__name__}"
                     ) from None


def _tokenizer(d: DataConfig, vocab_size: int, extra_eos=()) -> tuple[Tokenizer, int | None, list[int]]:
  """The run's tokenizer (data.tokenizer, else the one its shards record, else the shipped one), the BOS
  to prepend (data.add_bos) and the ids that end a generation (data.eos_id / the tokenizer's EOS)."""
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


def _checkpoint_error(e: CheckpointError, checkpoint: str) -> CheckpointError:
  """The error, naming the `checkpoint=` argument once."""
  msg, path = str(e).replace("checkpoint.load_params=", "checkpoint="), str(Path(checkpoint))
  if msg.startswith(f"{path}: "):
    msg = msg[len(path) + 2:]
  return CheckpointError(msg if msg.startswith("checkpoint=") else f"checkpoint={checkpoint}: {msg}")


def load(checkpoint: str, overrides: list[str] | None = None) -> Loaded:
  """Load a run/checkpoint/step directory or a Hugging Face directory (`maxlm.Model.from_pretrained`) with
  its tokenizer, for inference. overrides: dotted config keys over the checkpoint's config; of the model
  only model.backend, model.dtype and model.param_dtype may change (`data.eval_paths=...` etc. freely)."""
  path = Path(checkpoint)
  if not checkpoint or not path.exists():
    raise CheckpointError(f"checkpoint={checkpoint}: no such file or directory")
  overrides = list(overrides or [])
  fixed = [o.split("=", 1)[0] for o in overrides if o.startswith("model.")
           and o.split("=", 1)[0] not in ("model.backend", "model.dtype", "model.param_dtype")]
  load_config(overrides)  # unknown keys and bad values stop here, before any weights are read
  if fixed:
    raise UsageError(f"{fixed[0]} is fixed by the checkpoint; of the model only model.backend, model.dtype "
                     f"and model.param_dtype may be overridden")
  try:
    step = None if is_hf_dir(path) else find_step_dir(path)
    want = load_config(overrides, base=read_step_config(step) if step else None).model
    model = Model.from_pretrained(path, backend=want.backend, dtype=want.dtype, param_dtype=want.param_dtype)
  except CheckpointError as e:
    raise _checkpoint_error(e, checkpoint) from None
  cfg = load_config(overrides, base=model.config)
  hf = model.hf_config or {}
  eos = hf.get("eos_token_id")
  tok, bos, stops = _tokenizer(cfg.data, cfg.model.vocab_size, eos if isinstance(eos, list) else [eos])
  max_length = hf.get("max_position_embeddings") if step is None else cfg.data.seq_len
  return Loaded(cfg, model.params, tok, bos, stops, max_length, "run" if step else "hf", step, model.mesh)


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
