"""Document readers: text splits, compression, JSONL fields, Parquet columns, every bad input."""

import bz2
import gzip
import json
import lzma
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxlm.config import DataConfig
from maxlm.data import DataError, make_train_iterator
from maxlm.data.errors import Skips, first_line
from maxlm.data.readers import file_format, read_documents, resolve_files, split_list


def _read(path, fmt=None, skip=False, **kw):
  skips = Skips(skip)
  docs = list(read_documents(path, fmt or file_format(path), skips, **kw))
  return docs, skips


def _one_line_error(match, fn, *args, **kw):
  with pytest.raises(DataError, match=match) as e:
    fn(*args, **kw)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_text_splits(tmp_path):
  f = tmp_path / "a.txt"
  f.write_text("first line\nsecond\n\n  \nthird para\ncontinues\n")
  assert _read(f)[0] == ["first line", "second", "third para", "continues"]
  assert _read(f, text_split="paragraph")[0] == ["first line\nsecond", "third para\ncontinues"]
  assert _read(f, text_split="file")[0] == ["first line\nsecond\n\n  \nthird para\ncontinues"]


def test_compressed_text_and_jsonl(tmp_path):
  (tmp_path / "a.txt.xz").write_bytes(lzma.compress(b"one\ntwo\n"))
  (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x", "id": 1}\n\n{"text": "y"}\n'))
  assert _read(tmp_path / "a.txt.xz")[0] == ["one", "two"]
  assert _read(tmp_path / "b.jsonl.gz")[0] == ["x", "y"]
  assert [p.name for p in resolve_files(str(tmp_path))] == ["a.txt.xz", "b.jsonl.gz"]
  assert [p.name for p in resolve_files(str(tmp_path / "*.xz"))] == ["a.txt.xz"]


def test_jsonl_field_and_parquet_column(tmp_path):
  f = tmp_path / "d.jsonl"
  f.write_text(json.dumps({"body": "hello", "text": "t"}) + "\n" + json.dumps({"body": ""}) + "\n")
  assert _read(f, field="body")[0] == ["hello"]  # empty text is not a document
  p = tmp_path / "d.parquet"
  pq.write_table(pa.table({"content": ["a b", "c"], "n": [1, 2]}), p)
  assert _read(p, field="content")[0] == ["a b", "c"]


def test_missing_and_empty_files(tmp_path):
  _one_line_error("data file '.*nope.txt' not found", resolve_files, str(tmp_path / "nope.txt"))
  _one_line_error("no files match", resolve_files, str(tmp_path / "*.jsonl"))
  _one_line_error("cannot tell the format", file_format, tmp_path / "x.csv")
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  msg = _one_line_error("empty file", _read, empty)
  assert str(empty) in msg and "skip_bad_records" in msg
  (tmp_path / "blank.jsonl").write_text("\n\n")
  _one_line_error("blank.jsonl: empty file", _read, tmp_path / "blank.jsonl")
  docs, skips = _read(empty, skip=True)
  assert docs == [] and skips.counts == {"empty file (no documents)": 1}


def test_non_utf8(tmp_path):
  f = tmp_path / "bad.txt"
  f.write_bytes(b"good line\nbad \xff line\nlast\n")
  _one_line_error(r"bad.txt:2: non-UTF-8 bytes \(byte 4 is 0xff\)", _read, f)
  docs, skips = _read(f, skip=True)
  assert docs == ["good line", "last"] and skips.total == 1
  assert "1 non-UTF-8 bytes" in skips.summary() and "bad.txt:2" in skips.summary()
  docs, skips = _read(f, skip=True, text_split="file")  # the whole file is the bad record
  assert docs == [] and skips.total == 1


def test_malformed_jsonl(tmp_path):
  f = tmp_path / "d.jsonl"
  f.write_text('{"text": "ok"}\n{"text": "broken\n[1, 2]\n{"other": "x"}\n{"text": 5}\n{"text": "fine"}\n')
  _one_line_error(r"d.jsonl:2: malformed JSON", _read, f)
  docs, skips = _read(f, skip=True)
  assert docs == ["ok", "fine"]
  assert skips.total == 4
  reasons = " | ".join(skips.counts)
  for part in ("malformed JSON", "not an object", "missing field 'text'", "is int, not a string"):
    assert part in reasons


def test_missing_field_names_line(tmp_path):
  f = tmp_path / "d.jsonl"
  f.write_text('{"text": "ok"}\n{"body": "x"}\n')
  msg = _one_line_error("missing field 'text'", _read, f)
  assert msg.startswith(f"{f}:2:") and "keys: body" in msg


def test_parquet_errors(tmp_path):
  p = tmp_path / "d.parquet"
  pq.write_table(pa.table({"content": ["a", None, "b"]}), p)
  _one_line_error(r"missing column 'text' .*columns: content", _read, p)
  _one_line_error(r"d.parquet:row 1: null in column 'content'", _read, p, field="content")
  docs, skips = _read(p, skip=True, field="content")
  assert docs == ["a", "b"] and skips.total == 1
  docs, skips = _read(p, skip=True)  # every row of the file lacks the column
  assert docs == [] and skips.total == 3
  ints = tmp_path / "i.parquet"
  pq.write_table(pa.table({"text": [1, 2]}), ints)
  _one_line_error("has type int64, not string", _read, ints)
  fake = tmp_path / "fake.parquet"
  fake.write_text("not parquet")
  _one_line_error("fake.parquet' is not a readable Parquet file", _read, fake)


def test_split_list():
  assert split_list(" a.txt, b.txt,,") == ["a.txt", "b.txt"]
  assert split_list("") == []


def _flip(data: bytes, pos: int, n: int = 4) -> bytes:
  return data[:pos] + bytes(b ^ 0xFF for b in data[pos:pos + n]) + data[pos + n:]


@pytest.mark.parametrize("suffix,compress", [(".txt.gz", gzip.compress), (".jsonl.xz", lzma.compress),
                                             (".txt.bz2", bz2.compress)])
def test_damaged_compressed_files(tmp_path, suffix, compress):
  """Bytes flipped anywhere in a compressed file, or the file cut short: a one-line DataError naming it,
  whatever the decompressor raises (gzip: zlib.error, BadGzipFile, EOFError; xz: LZMAError; bz2: OSError)."""
  lines = [json.dumps({"text": f"doc {i}"}) if "jsonl" in suffix else f"doc {i}" for i in range(3000)]
  data = compress(("\n".join(lines) + "\n").encode())
  f = tmp_path / f"d{suffix}"
  variants = [_flip(data, p) for p in range(20, len(data) - 8, len(data) // 12)] + [data[:len(data) // 2]]
  for bad in variants:  # garbage may decode before a checksum fails: then a record is reported first
    f.write_bytes(bad)
    _one_line_error(re.escape(str(f)), _read, f)


def _corrupt_parquet(path, compression, checksum=False):
  """A Parquet file whose column chunk bytes are overwritten in the middle; the footer stays intact.

  With `checksum`, one byte is changed where decoding without checksums succeeds with wrong text.
  """
  docs = [f"document {i} " + "word " * (i % 30) for i in range(2000)]
  pq.write_table(pa.table({"text": docs}), path, compression=compression, use_dictionary=False,
                 write_page_checksum=checksum)
  col = pq.ParquetFile(path).metadata.row_group(0).column(0)
  start, size = col.data_page_offset, col.total_compressed_size
  data = path.read_bytes()
  assert start + size < len(data) - 8  # the page region lies before the footer, which we keep
  if not checksum:
    mid = start + size // 2
    path.write_bytes(data[:mid] + b"\xff" * 64 + data[mid + 64:])
    return
  for pos in range(start + size // 4, start + size, 7):
    path.write_bytes(_flip(data, pos, 1))
    try:
      if pq.read_table(path).column("text").to_pylist() != docs:
        return  # silently wrong without the checksum
    except (pa.ArrowException, OSError):
      continue
  raise AssertionError("no silently corrupting byte found")


@pytest.mark.parametrize("compression,checksum", [("snappy", False), ("none", False), ("zstd", True)])
def test_parquet_corrupt_data_page(tmp_path, compression, checksum):
  """A damaged data page behind a good footer is a one-line DataError naming the file (pyarrow raises
  OSError or ArrowInvalid; zstd data without page checksums can decode silently, so that case is written
  with checksums, which the reader verifies)."""
  p = tmp_path / "c.parquet"
  _corrupt_parquet(p, compression, checksum)
  _one_line_error(f"cannot read '{p}' \\(Parquet, after row 0\\)", _read, p)
  with pytest.raises(DataError, match="cannot read"):  # a damaged page is not a record to skip
    _read(p, skip=True)
  with pytest.raises(DataError, match=f"cannot read '{p}'"):  # and training stops the same way
    make_train_iterator(DataConfig(type="parquet", paths=str(p), skip_bad_records=True), 8192)


def test_messages_are_one_line(tmp_path):
  """Whatever a message quotes (here a JSON key with line breaks), a DataError is one line."""
  f = tmp_path / "d.jsonl"
  f.write_text(json.dumps({"first\nkey\r\u2028x": "v"}) + "\n")
  msg = _one_line_error("missing field 'text'", _read, f)
  assert len(msg.splitlines()) == 1 and "first\\nkey\\r\\u2028x" in msg
  assert first_line(RuntimeError("")) == "RuntimeError"  # the library errors with empty messages
  assert first_line(OSError("\n  Couldn't read\nmore")) == "Couldn't read"
