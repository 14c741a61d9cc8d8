"""Tokenize text/JSONL/Parquet files into ArrayRecord shards for `data.type=arrayrecord`: the library part of
`maxlm prepare` (its command line, the arguments and what they mean: maxlm/cli/prepare.py).

`prepare(inputs, output, ...)` writes the shards and DIR/maxlm_data.json (format: docs/data_format.md) and
returns that metadata; `summary(meta, output)` is what the command prints. Bad input raises a DataError naming
the file and line, and leaves nothing behind (no shards, no directory it created).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from maxlm.config import DataConfig
from maxlm.data.errors import DataError, Skips, first_line
from maxlm.data.readers import (META_NAME, TEXT_SPLITS, file_format, has_data_format,
                                read_documents, resolve_files)
from maxlm.data.shards import token_dtype
from maxlm.data.tokenizer import KINDS, load_tokenizer, padded_vocab

FORMAT_VERSION = "maxlm-tokens-v1"
SHARD_PATTERN = "shard-{:05d}.array_record"
SHARD_GLOB = "shard-*.array_record"
WRITER_OPTIONS = "group_size:1"  # random access per record, as Grain's reader expects
BATCH_DOCS = 512
EVAL_EVERY = round(1 / DataConfig().eval_fraction)  # training's default held-out split: one document in 50
FORMATS = ("auto", "text", "jsonl", "parquet")


class ShardWriter:
  """Writes records into numbered shards of about `shard_tokens` tokens each, in directory `out`."""

  def __init__(self, out: Path, shard_tokens: int):
    self.out, self.shard_tokens = out, shard_tokens
    self.shards: list[dict] = []
    self._writer = None

  def write(self, ids: np.ndarray) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415
    if self._writer is None or self.shards[-1]["tokens"] >= self.shard_tokens:
      self.close()
      name = SHARD_PATTERN.format(len(self.shards))
      self.shards.append({"file": name, "documents": 0, "tokens": 0})
      self._writer = self._call(ArrayRecordWriter, str(self.out / name), WRITER_OPTIONS)
    self._call(self._writer.write, ids.tobytes())
    self.shards[-1]["documents"] += 1
    self.shards[-1]["tokens"] += len(ids)

  def close(self) -> None:
    if self._writer is not None:
      writer, self._writer = self._writer, None
      self._call(writer.close)

  def _call(self, fn, *args):
    """The writer reports a failed open or write (disk full, permissions) as RuntimeError."""
    try:
      return fn(*args)
    except (RuntimeError, OSError, ValueError) as e:
      raise DataError(f"cannot write '{self.out / self.shards[-1]['file']}': {first_line(e)}") from None


def _inputs(specs: list[str], fmt: str) -> list[tuple[Path, str]]:
  out = []
  for spec in specs:
    for f in resolve_files(spec):
      f_fmt = fmt if fmt != "auto" else file_format(f)
      if f_fmt == "arrayrecord":
        raise DataError(f"'{f}' is already an ArrayRecord file; prepare reads text, JSONL or Parquet")
      out.append((f, f_fmt))
  return out


def _check_output(out: Path, overwrite: bool) -> None:
  """Refuse an output that is not a directory, holds other data, or (without --overwrite) shards."""
  if out.exists() and not out.is_dir():
    raise DataError(f"output '{out}' exists and is not a directory; give a new or empty directory to out=")
  if not out.is_dir():
    return
  if (list(out.glob(SHARD_GLOB)) or (out / META_NAME).exists()) and not overwrite:
    raise DataError(f"output directory '{out}' already holds prepared data; pass --overwrite to replace it")
  other = sorted(f.name for f in out.iterdir() if f.is_file() and has_data_format(f)
                 and f.name != META_NAME and not f.match(SHARD_GLOB))
  if other:
    raise DataError(f"output directory '{out}' holds other data files ({', '.join(other[:3])}); training "
                    f"reads every data file of data.paths=DIR, so give a new or empty directory to out=")


def _make_output(out: Path) -> Path | None:
  """Create `out` (and missing parents); the topmost directory created, to remove on failure."""
  top = None
  for d in [out, *out.parents]:
    if d.exists():
      break
    top = d
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise DataError(f"cannot create output directory '{out}': {e.strerror or first_line(e)}") from None
  return top


def _install(stage: Path, out: Path) -> None:
  """Replace the prepared data in `out` by the files in `stage`; the metadata goes last."""
  try:
    (out / META_NAME).unlink(missing_ok=True)
    for f in out.glob(SHARD_GLOB):
      f.unlink()
    for f in sorted(stage.glob(SHARD_GLOB)):
      f.rename(out / f.name)
    (stage / META_NAME).rename(out / META_NAME)
  except OSError as e:
    raise DataError(f"cannot move the prepared data into '{out}': {e.strerror or first_line(e)}") from None


def prepare(inputs: list[str], output: str, *, tokenizer: str = "", tokenizer_type: str = "auto",
            fmt: str = "auto", field: str = "text", text_split: str = "line",
            shard_tokens: int = 50_000_000, threads: int = 0, skip_bad_records: bool = False,
            overwrite: bool = False, progress: bool = True) -> dict:
  """Tokenize `inputs` into ArrayRecord shards under `output`; returns the metadata written.

  Shards are written into a staging directory inside `output` and moved in at the end: on any
  error nothing is left behind (and `output` itself is removed if this call created it).
  """
  if tokenizer_type not in KINDS:
    raise DataError(f"tokenizer_type must be one of {', '.join(KINDS)}; got {tokenizer_type!r}")
  if fmt not in FORMATS:
    raise DataError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
  if text_split not in TEXT_SPLITS:
    raise DataError(f"text_split must be one of {', '.join(TEXT_SPLITS)}; got {text_split!r}")
  if shard_tokens <= 0:
    raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
  if threads < 0:
    raise DataError(f"threads must be >= 0 (0: all cores), got {threads}")
  files = _inputs(inputs, fmt)
  tok = load_tokenizer(tokenizer, tokenizer_type)
  dtype = np.dtype(token_dtype(tok.vocab_size))
  out = Path(output)
  _check_output(out, overwrite)
  created = _make_output(out)
  try:
    stage = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
  except OSError as e:
    if created is not None:
      shutil.rmtree(created, ignore_errors=True)
    raise DataError(f"cannot write into output directory '{out}': {e.strerror or first_line(e)}") from None
  try:
    meta = _tokenize(files, tok, dtype, stage, field=field, text_split=text_split,
                     shard_tokens=shard_tokens, threads=threads or os.cpu_count() or 1,
                     skip_bad_records=skip_bad_records, progress=progress)
    _install(stage, out)
  except BaseException:
    if created is not None:
      shutil.rmtree(created, ignore_errors=True)
    raise
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return meta


def _tokenize(files, tok, dtype: np.dtype, stage: Path, *, field: str, text_split: str,
              shard_tokens: int, threads: int, skip_bad_records: bool, progress: bool) -> dict:
  """Write every document of `files` as a record of token ids into shards in `stage`, then the metadata."""
  skips, writer, t0 = Skips(skip_bad_records), ShardWriter(stage, shard_tokens), time.time()
  total_bytes = sum(f.stat().st_size for f, _ in files)
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress)
  done_bytes = 0
  try:
    for f, f_fmt in files:
      end = done_bytes + f.stat().st_size
      docs = read_documents(f, f_fmt, skips, field=field, text_split=text_split)
      for batch in _batched(docs, BATCH_DOCS):
        for ids in tok.encode_batch(batch, threads):
          if len(ids) and (ids.min() < 0 or ids.max() >= tok.vocab_size):  # would wrap in `dtype`
            raise DataError(f"tokenizer '{tok.path}' gave token id {int(ids.max())} outside its "
                            f"vocabulary of {tok.vocab_size} for a document of '{f}'")
          writer.write(ids.astype(dtype))
        chars = sum(len(d) + 1 for d in batch)  # about the bytes read; exact at each file's end
        bar.update(max(0, min(chars, end - bar.n)))
        bar.set_postfix(docs=sum(s["documents"] for s in writer.shards),
                        tokens=sum(s["tokens"] for s in writer.shards), refresh=False)
      done_bytes = end
      bar.update(done_bytes - bar.n)
  finally:
    bar.close()
    writer.close()
  if not writer.shards:
    raise DataError(f"no documents in {', '.join(str(f) for f, _ in files)} ({skips.summary()})")
  meta = {
      "format": FORMAT_VERSION, "dtype": dtype.name,
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
  (stage / META_NAME).write_text(json.dumps(meta, indent=1) + "\n")
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
  """What was prepared and how to train (and evaluate) on it."""
  tok = meta["tokenizer"]
  docs = meta["documents"]
  lines = [f"prepared {docs:,} document{'s' if docs != 1 else ''}, {meta['tokens']:,} tokens "
           f"({meta['dtype']}) into {len(meta['shards'])} shard(s) in {output} "
           f"in {meta['seconds']:.1f} s" + (f" ({meta['tokens'] / meta['seconds']:,.0f} tokens/s)"
                                             if meta["seconds"] >= 0.1 else ""),  # a rate of 0.0 s means nothing
           f"tokenizer: {tok['kind']} {tok['path']} (vocab {tok['vocab_size']}, "
           f"BOS {tok['bos_id']}, EOS {tok['eos_id']}; records hold no BOS/EOS)"]
  skipped = meta["skipped"]
  if skipped:
    lines.append(f"skipped {sum(skipped.values()):,} bad records:")
    lines += [f"  {n:,} x {why} (first at {meta['skipped_first'][why]})" for why, n in skipped.items()]
  else:
    lines.append("skipped 0 records")
  lines.append(f"train with: python -m maxlm.train data.type=arrayrecord data.paths={output}")
  lines.append(f"  the model needs model.vocab_size >= {tok['vocab_size']} "
               f"(e.g. model.vocab_size={padded_vocab(tok['vocab_size'])})")
  for n in ("bos", "eos"):
    if tok[f"{n}_id"] < 0:
      lines.append(f"  this tokenizer has no {n.upper()} token: also set data.add_{n}=false "
                   f"or data.{n}_id=<id>")
  lines.append("eval: without data.eval_paths, every k-th document is held out "
               f"(k = round(1/data.eval_fraction): every {EVAL_EVERY}th by default);")
  lines.append("  to evaluate on separate data, prepare it into another directory with the same "
               "tokenizer= and add data.eval_paths=EVAL_DIR (training then uses every document)")
  if docs <= EVAL_EVERY:  # the default split holds out one document, the first: too few to split well
    note = (f"note: only {docs} document{'s' if docs != 1 else ''}: by default training holds out the first for "
            f"eval and trains on the other {docs - 1} (data.eval_fraction=0 trains on all)")
    split = meta.get("text_split", "line")
    if split != "line" and any(i.get("format") == "text" for i in meta.get("inputs", ())):
      note += f"; text_split={split} found few in the text files, text_split=line makes a document per line"
    lines.append(note)
  return "\n".join(lines)


if __name__ == "__main__":  # the old command; the data layer does not import the commands (maxlm/cli/)
  print("maxlm: error: `python -m maxlm.data.prepare INPUT -o DIR --tokenizer PATH ...` is now "
        "`maxlm prepare INPUT... out=DIR tokenizer=PATH ...` (or python -m maxlm.cli prepare ...; "
        "see maxlm prepare --help)", file=sys.stderr)
  sys.exit(2)
