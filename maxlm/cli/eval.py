"""Evaluate a checkpoint: `maxlm eval checkpoint=DIR [data.KEY=VALUE ...]` prints loss, perplexity, bits per byte.

checkpoint: a run directory, its checkpoints/ directory or one step directory (newest complete step), or
a Hugging Face directory. The data is the run's configured data (its held-out split: every
round(1/data.eval_fraction)-th document) unless overridden: `data.eval_paths=new.txt` evaluates every
document of those files (the format comes from the extension, and a run trained on synthetic tokens reads
them as text); `data.paths=other.jsonl` the held-out split of other files (their format from their names, as
in training, unless data.type is given). Any config key may be overridden
(`train.eval_steps=N` limits the batches, `data.seq_len`, `data.global_batch_size`, `model.dtype`, ...).

Prints one JSON line: loss (mean next-token NLL in nats over every target token: the sum over all
batches divided by the token count, not a mean of batch means), perplexity = exp(loss), tokens,
bytes, bits_per_byte = loss * tokens / (ln 2 * bytes), batches, step, time_s. `bytes` is the UTF-8
length of the evaluated text: for every packed segment (a document, or a piece of a document split
across rows), its target tokens without BOS/EOS ids, decoded by the tokenizer, encoded as UTF-8.

Exit codes: 0 done, 2 bad argument, config or data, 3 missing or unusable checkpoint.
"""

from __future__ import annotations

import json
import sys
import time

from maxlm.checkpoint.paths import step_number
from maxlm.cli import checkpoint_arg
from maxlm.cli.grammar import UsageError, command_main, parse_args

_KEYS = {"checkpoint": str}


def run(argv: list[str]) -> int:
  t0 = time.perf_counter()
  own, overrides, flags = parse_args(argv, _KEYS)
  if flags:
    raise UsageError(f"unknown option {sorted(flags)[0]} (options: --help)")
  model = checkpoint_arg.load_model(checkpoint_arg.required(own), overrides)
  out = model.eval()  # the config's eval data, train.eval_steps batches (maxlm/evaluate.py)
  # The step of a checkpoint step directory; None for an HF directory or a `convert hf-to-maxlm` tree.
  out["step"] = step_number(model.step_dir) if model.step_dir is not None else None
  out["checkpoint"] = str(model.step_dir or own["checkpoint"])
  out["time_s"] = round(time.perf_counter() - t0, 3)
  print(json.dumps(out), flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
