"""Tokenize text/JSONL/Parquet files into ArrayRecord shards for `data.type=arrayrecord`.

    maxlm prepare INPUT... out=DIR [tokenizer=PATH] [tokenizer_type=auto] [format=auto] [field=text]
                  [text_split=line] [shard_tokens=N] [threads=N] [--skip-bad-records] [--overwrite] [--no-progress]

  INPUT...            files, globs or directories (at least one)
  out=DIR             directory for the shards (new or empty; created if missing) (required)
  tokenizer=PATH      SentencePiece .model, tokenizer.json (or its directory) or tiktoken rank file; default: the
                      shipped 8k SentencePiece trained on the embedded Austen corpus
  tokenizer_type=     auto (detected from the content), sentencepiece, hf or tiktoken
  format=             auto (from each file's extension), text, jsonl or parquet
  field=text          the JSONL field / Parquet column with the text
  text_split=line     text files: a document per non-blank line (line), per blank-line separated paragraph
                      (paragraph) or per file (file)
  shard_tokens=N      start a new shard file after about N tokens (default 50,000,000)
  threads=N           tokenizer threads (default 0: all cores)
  --skip-bad-records  count bad records (listed in the summary) instead of stopping at the first
  --overwrite         replace prepared data already in DIR
  --no-progress       no progress bar (it is shown only when stderr is a terminal)

Documents: text files give one per line, paragraph or file (text_split=); JSONL one per line (the field=
string); Parquet one per row (the field= column). Each document is stored as one record of raw little-endian
token ids (uint16 when the vocabulary has at most 65,536 tokens, else uint32) without BOS/EOS; training adds
those as `data.add_bos`/`data.add_eos` say. DIR/maxlm_data.json records the tokenizer (path, sha256, vocab
size, BOS/EOS ids), the shards with their record counts, and skipped records (format: docs/data_format.md).

Use the tokenizer of the model you will train: training refuses shards made with a different
`data.tokenizer`, and needs model.vocab_size >= the tokenizer's vocabulary.
  train:  maxlm train data.type=arrayrecord data.paths=DIR
  eval:   without data.eval_paths, every k-th document of DIR is held out for eval
          (k = round(1/data.eval_fraction), every 50th by default); to evaluate on separate data,
          prepare it into its own directory with the same tokenizer= and add
          data.eval_paths=EVAL_DIR (training then uses every document of DIR).

Exit codes: 0 done, 2 bad input (one line `maxlm: error: ...` naming the file and line; nothing is left
behind: no shards, no directory it created).
"""

from __future__ import annotations

import sys

from maxlm.cli.grammar import UsageError, command_main, parse_args
from maxlm.data.prepare import prepare, summary

_KEYS = {"out": str, "tokenizer": str, "tokenizer_type": str, "format": str, "field": str, "text_split": str,
         "shard_tokens": int, "threads": int}
_FLAGS = {"--skip-bad-records", "--overwrite", "--no-progress"}
# the spellings before the one grammar (argparse options) -> the key that replaced them
_OLD = {"-o": "out", "--output": "out", **{"--" + k.replace("_", "-"): k for k in _KEYS if k != "out"}}


def _arguments(argv: list[str]) -> tuple[list[str], dict, set[str]]:
  """(inputs, settings, flags), or a UsageError naming the culprit."""
  for word in argv:
    old = word.split("=", 1)[0]
    if old in _OLD:
      raise UsageError(f"prepare: {old} is now {_OLD[old]}=VALUE (maxlm prepare INPUT... out=DIR "
                       f"[tokenizer=PATH] ...; see maxlm prepare --help)")
  own, overrides, flags = parse_args(argv, _KEYS, positional="inputs")
  if overrides:
    raise UsageError(f"prepare: {overrides[0].split('=', 1)[0]} is a config key; prepare takes none "
                     f"(see maxlm prepare --help)")
  if flags - _FLAGS:
    raise UsageError(f"prepare: unknown option {sorted(flags - _FLAGS)[0]} "
                     f"(options: {', '.join(sorted(_FLAGS | {'--help'}))})")
  if not own["inputs"]:
    raise UsageError("prepare: no INPUT given (files, globs or directories; see maxlm prepare --help)")
  if not own.get("out"):
    raise UsageError("prepare: out=<directory> is required")
  return own.pop("inputs"), own, flags


def run(argv: list[str]) -> int:
  """Choices (format=, text_split=, ...) are checked by `prepare` before it reads or creates anything."""
  inputs, own, flags = _arguments(argv)
  meta = prepare(inputs, own["out"], tokenizer=own.get("tokenizer", ""),
                 tokenizer_type=own.get("tokenizer_type", "auto"), fmt=own.get("format", "auto"),
                 field=own.get("field", "text"), text_split=own.get("text_split", "line"),
                 shard_tokens=own.get("shard_tokens", 50_000_000), threads=own.get("threads", 0),
                 skip_bad_records="--skip-bad-records" in flags, overwrite="--overwrite" in flags,
                 progress="--no-progress" not in flags and sys.stderr.isatty())
  print(summary(meta, own["out"]), flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
