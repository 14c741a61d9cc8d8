"""Tokenize text/JSONL/Parquet files into ArrayRecord shards for `data.type=arrayrecord`.

  python -m maxlm.data.prepare INPUT [INPUT ...] --output DIR [--tokenizer PATH]
      [--format auto|text|jsonl|parquet] [--field text] [--text-split line|paragraph|file]
      [--shard-tokens 50000000] [--threads N] [--skip-bad-records] [--overwrite]

INPUT is a file, a glob or a directory. Documents: text files give one per non-blank line
(`--text-split line`), per blank-line separated paragraph, or per file; JSONL one per line (the
`--field` string); Parquet one per row (the `--field` column). Each document is stored as one
record of raw token ids (uint16 when the vocabulary fits, else uint32) without BOS/EOS; those are
added when training, as `data.add_bos`/`data.add_eos` say. DIR/maxlm_data.json records the
tokenizer (path, sha256, vocab size, BOS/EOS ids), counts and skipped records. Exit code 2 on bad
input, with a one-line message naming the file and line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from maxlm.data.errors import DataError, Skips
from maxlm.data.readers import META_NAME, TEXT_SPLITS, file_format, read_documents, resolve_files
from maxlm.data.tokenizer import KINDS, load_tokenizer

FORMAT_VERSION = "maxlm-tokens-v1"
SHARD_PATTERN = "shard-{:05d}.array_record"
WRITER_OPTIONS = "group_size:1"  # random access per record, as Grain's reader expects
BATCH_DOCS = 512


class ShardWriter:
  """Writes records into numbered shards of about `shard_tokens` tokens each."""

  def __init__(self, out: Path, shard_tokens: int):
    self.out, self.shard_tokens = out, shard_tokens
    self.shards: list[dict] = []
    self._writer = None

  def write(self, ids: np.ndarray) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415
    if self._writer is None or self.shards[-1]["tokens"] >= self.shard_tokens:
      self.close()
      name = SHARD_PATTERN.format(len(self.shards))
      self._writer = ArrayRecordWriter(str(self.out / name), WRITER_OPTIONS)
      self.shards.append({"file": name, "documents": 0, "tokens": 0})
    self._writer.write(ids.tobytes())
    self.shards[-1]["documents"] += 1
    self.shards[-1]["tokens"] += len(ids)

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def _inputs(specs: list[str], fmt: str) -> list[tuple[Path, str]]:
  out = []
  for spec in specs:
    for f in resolve_files(spec):
      f_fmt = fmt if fmt != "auto" else file_format(f)
      if f_fmt == "arrayrecord":
        raise DataError(f"'{f}' is already an ArrayRecord file; prepare reads text, JSONL or Parquet")
      out.append((f, f_fmt))
  return out


def _clear_output(out: Path, overwrite: bool) -> None:
  old = sorted(out.glob("shard-*.array_record")) + ([out / META_NAME] if (out / META_NAME).exists() else [])
  if old and not overwrite:
    raise DataError(f"output directory '{out}' already holds prepared data; pass --overwrite to replace it")
  for f in old:
    f.unlink()
  out.mkdir(parents=True, exist_ok=True)


def prepare(inputs: list[str], output: str, *, tokenizer: str = "", tokenizer_type: str = "auto",
            fmt: str = "auto", field: str = "text", text_split: str = "line",
            shard_tokens: int = 50_000_000, threads: int = 0, skip_bad_records: bool = False,
            overwrite: bool = False, progress: bool = True) -> dict:
  """Tokenize `inputs` into ArrayRecord shards under `output`; returns the metadata written."""
  if fmt not in ("auto", "text", "jsonl", "parquet"):
    raise DataError(f"--format must be auto, text, jsonl or parquet; got {fmt!r}")
  if shard_tokens <= 0:
    raise DataError(f"--shard-tokens must be positive, got {shard_tokens}")
  files = _inputs(inputs, fmt)
  tok = load_tokenizer(tokenizer, tokenizer_type)
  dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
  out = Path(output)
  _clear_output(out, overwrite)
  threads = threads or os.cpu_count() or 1
  skips, writer, t0 = Skips(skip_bad_records), ShardWriter(out, shard_tokens), time.time()
  total_bytes = sum(f.stat().st_size for f, _ in files)
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress)
  done_bytes = 0
  try:
    for f, f_fmt in files:
      end = done_bytes + f.stat().st_size
      docs = read_documents(f, f_fmt, skips, field=field, text_split=text_split)
      for batch in _batched(docs, BATCH_DOCS):
        for ids in tok.encode_batch(batch, threads):
          writer.write(ids.astype(dtype))
        chars = sum(len(d) + 1 for d in batch)  # about the bytes read; exact at each file's end
        bar.update(max(0, min(chars, end - bar.n)))
        bar.set_postfix(docs=sum(s["documents"] for s in writer.shards),
                        tokens=sum(s["tokens"] for s in writer.shards), refresh=False)
      done_bytes = end
      bar.update(done_bytes - bar.n)
  except BaseException:
    writer.close()
    for s in writer.shards:  # no half-prepared directory is left behind
      (out / s["file"]).unlink(missing_ok=True)
    raise
  finally:
    writer.close()
    bar.close()
  if not writer.shards:
    raise DataError(f"no documents in {', '.join(str(f) for f, _ in files)} ({skips.summary()})")
  meta = {
      "format": FORMAT_VERSION, "dtype": np.dtype(dtype).name,
      "tokenizer": {"path": str(tok.path), "kind": tok.kind, "sha256": tok.sha256,
                    "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
      "documents": sum(s["documents"] for s in writer.shards),
      "tokens": sum(s["tokens"] for s in writer.shards),
      "shards": writer.shards,
      "inputs": [{"file": str(f), "format": f_fmt} for f, f_fmt in files],
      "field": field, "text_split": text_split,
      "skipped": dict(skips.counts), "skipped_first": skips.first,
      "seconds": round(time.time() - t0, 2),
  }
  (out / META_NAME).write_text(json.dumps(meta, indent=1) + "\n")
  return meta


def _batched(it, n: int):
  batch = []
  for x in it:
    batch.append(x)
    if len(batch) == n:
      yield batch
      batch = []
  if batch:
    yield batch


def summary(meta: dict, output: str) -> str:
  lines = [f"prepared {meta['documents']:,} documents, {meta['tokens']:,} tokens "
           f"({meta['dtype']}) into {len(meta['shards'])} shard(s) in {output} "
           f"in {meta['seconds']:.1f} s ({meta['tokens'] / max(meta['seconds'], 1e-9):,.0f} tokens/s)",
           f"tokenizer: {meta['tokenizer']['kind']} {meta['tokenizer']['path']} "
           f"(vocab {meta['tokenizer']['vocab_size']})"]
  skipped = meta["skipped"]
  if skipped:
    lines.append(f"skipped {sum(skipped.values()):,} bad records:")
    lines += [f"  {n:,} x {why} (first at {meta['skipped_first'][why]})" for why, n in skipped.items()]
  else:
    lines.append("skipped 0 records")
  lines.append(f"train with: data.type=arrayrecord data.paths={output}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m maxlm.data.prepare", description=__doc__.split("\n\n")[0],
                               epilog=__doc__.split("\n\n", 2)[2],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("inputs", nargs="+", help="files, globs or directories")
  ap.add_argument("--output", "-o", required=True, help="directory for the shards")
  ap.add_argument("--tokenizer", default="", help="tokenizer file ('' = shipped Austen 8k SentencePiece)")
  ap.add_argument("--tokenizer-type", default="auto", choices=KINDS)
  ap.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"))
  ap.add_argument("--field", default="text", help="JSONL field / Parquet column with the text")
  ap.add_argument("--text-split", default="line", choices=TEXT_SPLITS)
  ap.add_argument("--shard-tokens", type=int, default=50_000_000)
  ap.add_argument("--threads", type=int, default=0, help="tokenizer threads (0 = all cores)")
  ap.add_argument("--skip-bad-records", action="store_true", help="count bad records instead of stopping")
  ap.add_argument("--overwrite", action="store_true")
  ap.add_argument("--no-progress", action="store_true")
  args = ap.parse_args(argv)
  try:
    meta = prepare(args.inputs, args.output, tokenizer=args.tokenizer, tokenizer_type=args.tokenizer_type,
                   fmt=args.format, field=args.field, text_split=args.text_split,
                   shard_tokens=args.shard_tokens, threads=args.threads,
                   skip_bad_records=args.skip_bad_records, overwrite=args.overwrite,
                   progress=not args.no_progress)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(summary(meta, args.output))
  return 0


if __name__ == "__main__":
  sys.exit(main())
