"""Reading documents from raw text files: text, JSONL and Parquet (prepared shards: shards.py).

Every bad record is reported through `Skips.bad` with `file:line` (or `file:row N`): a one-line
`DataError`, or a count when `skip_bad_records` is on. Text files may be .gz/.bz2/.xz compressed.
A file that cannot be read (I/O error, corrupt compression or Parquet page) is a `DataError` naming
it, whichever reader meets it.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path

from maxlm.data.errors import DataError, Skips, first_line

TEXT_SPLITS = ("line", "paragraph", "file")
FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl", ".parquet": "parquet", ".array_record": "arrayrecord",
           ".arrayrecord": "arrayrecord"}
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
META_NAME = "maxlm_data.json"  # written next to prepared shards by maxlm.data.prepare
# What reading a damaged or unreadable file raises (gzip: zlib.error, BadGzipFile; bz2: OSError;
# xz: LZMAError; truncated streams: EOFError; pyarrow: OSError subclasses).
READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error)


def split_list(value: str) -> list[str]:
  """'a, b,,c' -> ['a', 'b', 'c'] (config lists are comma-separated strings)."""
  return [v.strip() for v in str(value).split(",") if v.strip()]


def file_format(path: Path) -> str:
  """The format implied by a file name (compression suffix ignored)."""
  suffixes = [s.lower() for s in path.suffixes]
  if suffixes and suffixes[-1] in OPENERS:
    suffixes = suffixes[:-1]
  if suffixes and suffixes[-1] in FORMATS:
    return FORMATS[suffixes[-1]]
  raise DataError(f"cannot tell the format of '{path}' from its name; use one of "
                  f"{', '.join(sorted(FORMATS))} (optionally .gz/.bz2/.xz for text and JSONL)")


def resolve_files(spec: str) -> list[Path]:
  """Expand one path entry: a file, a glob, or a directory (its data files, sorted)."""
  p = Path(spec).expanduser()
  if any(c in spec for c in "*?["):
    files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
      raise DataError(f"no files match '{spec}'")
    return files
  if p.is_dir():
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name != META_NAME and has_data_format(f))
    if not files:
      raise DataError(f"directory '{spec}' holds no data files ({', '.join(sorted(FORMATS))})")
    return files
  if not p.exists():
    raise DataError(f"data file '{spec}' not found")
  return [p]


def has_data_format(path: Path) -> bool:
  """Whether the name of `path` tells a data format (see FORMATS)."""
  try:
    file_format(path)
    return True
  except DataError:
    return False


def read_documents(path: Path, fmt: str, skips: Skips, *, field: str = "text",
                   text_split: str = "line") -> Iterator[str]:
  """Yield the non-empty documents of one text/JSONL/Parquet file."""
  if not path.is_file():
    raise DataError(f"data file '{path}' not found")
  reader = {"text": _text_docs, "jsonl": _jsonl_docs, "parquet": _parquet_docs}.get(fmt)
  if reader is None:
    raise DataError(f"'{path}' is {fmt}, not a text/JSONL/Parquet file")
  if text_split not in TEXT_SPLITS:
    raise DataError(f"config key 'data.text_split' must be one of {', '.join(TEXT_SPLITS)}; "
                    f"got {text_split!r}")
  n, before = 0, skips.total
  try:
    for doc in reader(path, skips, field=field, text_split=text_split):
      n += 1
      yield doc
  except READ_ERRORS as e:
    raise DataError(f"cannot read '{path}': {first_line(e)}") from None
  if n == 0 and skips.total == before:
    skips.bad(str(path), "empty file (no documents)")


def _open(path: Path):
  opener = OPENERS.get(path.suffix.lower(), open)
  try:
    return opener(path, "rb")
  except OSError as e:
    raise DataError(f"cannot open '{path}': {e.strerror or e}") from None


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
  with _open(path) as f:  # read errors: read_documents
    yield from enumerate(f, 1)


def _decode(raw: bytes, where: str, skips: Skips) -> str | None:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    skips.bad(where, f"non-UTF-8 bytes (byte {e.start} is 0x{raw[e.start]:02x})")
    return None


def _text_docs(path: Path, skips: Skips, *, text_split: str, **_) -> Iterator[str]:
  """line: each non-blank line; paragraph: blank-line separated blocks; file: the whole file."""
  if text_split == "line":
    for n, raw in _lines(path):
      text = _decode(raw, f"{path}:{n}", skips)
      if text is not None and text.strip():
        yield text.rstrip("\r\n")
    return
  para: list[str] = []
  bad = False
  for n, raw in _lines(path):
    text = _decode(raw, f"{path}:{n}", skips)
    if text is None:
      bad = True  # the whole paragraph (or file) is one record
    elif text_split == "paragraph" and not text.strip():
      if para and not bad:
        yield "".join(para).rstrip("\r\n")
      para, bad = [], False
    else:
      para.append(text)
  if para and not bad and "".join(para).strip():
    yield "".join(para).rstrip("\r\n")


def _jsonl_docs(path: Path, skips: Skips, *, field: str, **_) -> Iterator[str]:
  for n, raw in _lines(path):
    where = f"{path}:{n}"
    line = _decode(raw, where, skips)
    if line is None or not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      skips.bad(where, f"malformed JSON ({e.msg} at column {e.colno})")
      continue
    if not isinstance(rec, dict):
      skips.bad(where, f"JSON line is a {type(rec).__name__}, not an object")
    elif field not in rec:
      skips.bad(where, f"missing field '{field}' (set data.field; keys: {', '.join(list(rec)[:8])})")
    elif not isinstance(rec[field], str):
      skips.bad(where, f"field '{field}' is {type(rec[field]).__name__}, not a string")
    elif rec[field].strip():
      yield rec[field]


def _parquet_docs(path: Path, skips: Skips, *, field: str, **_) -> Iterator[str]:
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415
  try:
    pf = pq.ParquetFile(path, page_checksum_verification=True)  # pages written with checksums
  except (pa.ArrowException, OSError) as e:
    raise DataError(f"'{path}' is not a readable Parquet file: {first_line(e)}") from None
  names = pf.schema_arrow.names
  if field not in names:
    skips.bad(str(path), f"missing column '{field}' (set data.field; columns: {', '.join(names[:8])})",
              n=max(1, pf.metadata.num_rows))
    return
  typ = pf.schema_arrow.field(field).type
  if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_binary(typ)
          or pa.types.is_large_binary(typ)):
    skips.bad(str(path), f"column '{field}' has type {typ}, not string", n=max(1, pf.metadata.num_rows))
    return
  row, batches = 0, pf.iter_batches(columns=[field], batch_size=8192)
  while True:
    try:  # pages are decoded here: a damaged one raises OSError or ArrowInvalid
      batch = next(batches, None)
    except (pa.ArrowException, OSError) as e:
      raise DataError(f"cannot read '{path}' (Parquet, after row {row}): {first_line(e)}") from None
    if batch is None:
      return
    for value in batch.column(0).to_pylist():
      where = f"{path}:row {row}"
      row += 1
      if value is None:
        skips.bad(where, f"null in column '{field}'")
        continue
      if isinstance(value, bytes):
        value = _decode(value, where, skips)
      if value is not None and value.strip():
        yield value

