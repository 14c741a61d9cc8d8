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

from maxlm.cli import checkpoint_arg
from maxlm.cli.grammar import UsageError, command_main, parse_args
from maxlm.generation import check_settings

_KEYS = {"checkpoint": str, "prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int,
         "top_p": float, "seed": int, "stop": str, "add_bos": bool, "max_length": int}
_REPEATED = ("prompt", "stop")


def run(argv: list[str]) -> int:
  t_start = time.perf_counter()
  own, overrides, flags = parse_args(argv, _KEYS, _REPEATED)
  bad = flags - {"--json"}
  if bad:
    raise UsageError(f"unknown option {sorted(bad)[0]} (options: --json, --help)")
  checkpoint = checkpoint_arg.required(own)
  if not own["prompt"]:
    raise UsageError("prompt=<text> is required")
  settings = {"max_new_tokens": own.get("max_new_tokens", 64), "temperature": own.get("temperature", 0.0),
              "top_k": own.get("top_k", 0), "top_p": own.get("top_p", 1.0)}
  check_settings(**settings)  # before the weights are read
  model = checkpoint_arg.load_model(checkpoint, overrides)
  load_s = time.perf_counter() - t_start
  out = model.complete(own["prompt"], **settings, seed=own.get("seed", 0), stop=own["stop"],
                       add_bos=own.get("add_bos"), max_length=own.get("max_length"))
  n_new = sum(len(t) for t in out.tokens)
  timing = {"load_s": round(load_s, 3), **{k: round(v, 3) for k, v in out.timing.items()},
            "tokens_per_s": round(n_new / out.timing["decode_s"], 1) if out.timing["decode_s"] > 0 else None}
  for text, ids, gen, reason, completion in zip(own["prompt"], out.prompt_tokens, out.tokens, out.finish_reasons,
                                                out.texts):
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
