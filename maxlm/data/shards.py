"""Prepared token shards: `maxlm_data.json`, random access to ArrayRecord records, validation.

Opening a `ShardSource` checks what can be checked cheaply before training starts: every shard
opens, holds as many records as `maxlm_data.json` lists for it, and a sample of its records (the
first, the last and a few spread between) decode to whole token ids below the shards' vocabulary.
Every record read later is checked the same way. Errors are one-line `DataError`s naming the
shard file and the record index inside it. The format is described in docs/data_format.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maxlm.data.errors import DataError, first_line
from maxlm.data.readers import META_NAME

DTYPES = ("uint16", "uint32")
READER_OPTIONS = "readahead_buffer_size:0"  # random access: no read-ahead
SAMPLE_SPREAD = 4  # records checked when a shard opens: the first, the last and 3 between


def token_dtype(vocab_size: int) -> str:
  """The narrowest dtype that holds every id of a `vocab_size`-token vocabulary."""
  return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _meta_error(path: Path, what: str) -> DataError:
  return DataError(f"'{path}' is not a valid {META_NAME}: {what}; make shards with "
                   "maxlm prepare")


def read_meta(directory: Path) -> dict:
  """A shard directory's `maxlm_data.json`, with its required fields checked."""
  path = directory / META_NAME
  if not path.is_file():
    raise DataError(f"'{directory}' has no {META_NAME}; make ArrayRecord shards with "
                    "maxlm prepare")
  try:
    meta = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise _meta_error(path, f"{type(e).__name__}: {first_line(e)}") from None
  tok = meta.get("tokenizer") if isinstance(meta, dict) else None
  if not isinstance(tok, dict):
    raise _meta_error(path, "no 'tokenizer' object")
  if meta.get("dtype") not in DTYPES:
    raise _meta_error(path, f"'dtype' is {meta.get('dtype')!r}, not one of {', '.join(DTYPES)}")
  if not isinstance(tok.get("sha256"), str):
    raise _meta_error(path, "no 'tokenizer.sha256'")
  n = tok.get("vocab_size")
  if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
    raise _meta_error(path, f"'tokenizer.vocab_size' is {n!r}, not a positive integer")
  if np.iinfo(meta["dtype"]).max < n - 1:
    raise _meta_error(path, f"'dtype' {meta['dtype']} cannot hold the ids of a {n}-token vocabulary")
  shards = meta.get("shards", [])
  if not isinstance(shards, list) or not all(
      isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("documents"), int)
      for s in shards):
    raise _meta_error(path, "'shards' is not a list of {\"file\": name, \"documents\": count}")
  return meta


def load_meta(files: list[Path]) -> tuple[dict, dict[str, int]]:
  """The metadata shared by the shards `files` and the record count listed for each of them."""
  metas = {d: read_meta(d) for d in sorted({f.parent for f in files})}
  first_dir, first = next(iter(metas.items()))
  expected: dict[str, int] = {}
  for d, m in metas.items():
    if (m["dtype"], m["tokenizer"]["sha256"]) != (first["dtype"], first["tokenizer"]["sha256"]):
      raise DataError(f"shards in '{d}' and '{first_dir}' were made with different tokenizers or "
                      f"dtypes; list them as separate data.type=mixture entries")
    for s in m.get("shards", []):
      if not (d / s["file"]).is_file():
        raise DataError(f"'{d / META_NAME}' lists shard '{s['file']}' but '{d / s['file']}' is missing")
      expected[str(d / s["file"])] = s["documents"]
  for f in files:
    if metas[f.parent].get("shards") and str(f) not in expected:
      raise DataError(f"ArrayRecord shard '{f}' is not listed in '{f.parent / META_NAME}' (a shard of "
                      f"another prepare run?); keep each prepared dataset in its own directory")
  return first, expected


class ShardSource:
  """Random access to the records of several ArrayRecord files (prepared token shards).

  `read(indices)` makes one batched read per file and `tokens(indices)` decodes and checks the
  records; readers open lazily in each process. A global record index maps to (file, index in
  that file) through `locate`, which every message uses.
  """

  def __init__(self, files: list[Path], dtype: str, vocab_size: int,
               expected: dict[str, int] | None = None):
    self.files = [str(f) for f in files]
    self.dtype, self.vocab_size = np.dtype(dtype).newbyteorder("<"), vocab_size
    counts = [self._check_file(f, (expected or {}).get(f)) for f in self.files]
    self._ends = np.cumsum(counts, dtype=np.int64)  # [files]
    self._readers: dict[int, object] = {}

  def _reader(self, f: str):
    """An open reader of `f`. A damaged file opens "not ok" (0 records); close() tells why."""
    from array_record.python.array_record_module import ArrayRecordReader  # noqa: PLC0415
    why = "not ok"
    try:
      reader = ArrayRecordReader(f, READER_OPTIONS)
      if reader.ok():
        return reader
      reader.close()
    except Exception as e:  # noqa: BLE001 - the C++ reader raises RuntimeError/ValueError/OSError
      why = first_line(e)
    raise DataError(f"cannot open ArrayRecord shard '{f}' (truncated, damaged or not an ArrayRecord "
                    f"file?): {why}")

  def _check_file(self, f: str, expected: int | None) -> int:
    """Open `f`, check its record count and a sample of its records; its number of records."""
    reader = self._reader(f)
    try:
      try:
        n = int(reader.num_records())
      except Exception as e:  # noqa: BLE001 - as in _reader
        raise DataError(f"cannot open ArrayRecord shard '{f}': {first_line(e)}") from None
      if expected is not None and n != expected:
        raise DataError(f"ArrayRecord shard '{f}' holds {n} records but {META_NAME} lists {expected} "
                        f"(truncated or replaced?); prepare it again")
      sample = sorted({n * j // SAMPLE_SPREAD for j in range(SAMPLE_SPREAD)} | {n - 1}) if n else []
      for i, rec in zip(sample, self._read_file(reader, f, sample)):
        self._decode(rec, f, i)
    except BaseException:
      _close(reader, f, quiet=True)  # the first error is the one to report
      raise
    _close(reader, f)
    return n

  def _read_file(self, reader, f: str, local: list[int]) -> list[bytes]:
    """Records `local` of file `f`; a failure names the first record that cannot be read."""
    try:
      return reader.read(local)
    except Exception as e:  # noqa: BLE001 - as in _reader
      bad, why = f"records {local[0]}..{local[-1]}" if len(local) > 1 else f"record {local[0]}", e
      one = self._reader(f)
      try:
        for i in local:  # find the bad record: read them one at a time
          try:
            one.read([i])
          except Exception as e1:  # noqa: BLE001 - as in _reader
            bad, why = f"record {i}", e1
            break
      finally:
        _close(one, f, quiet=True)
      raise DataError(f"cannot read {bad} of ArrayRecord shard '{f}': {first_line(why)}") from None

  def _decode(self, rec: bytes, f: str, i: int) -> np.ndarray:
    if len(rec) % self.dtype.itemsize:
      raise DataError(f"corrupt record {i} in ArrayRecord shard '{f}': {len(rec)} bytes is not a "
                      f"whole number of {self.dtype.name} token ids")
    ids = np.frombuffer(rec, self.dtype)  # [n]
    if len(ids) and int(ids.max()) >= self.vocab_size:
      raise DataError(f"corrupt record {i} in ArrayRecord shard '{f}': token id {int(ids.max())} is "
                      f">= the shards' vocabulary size {self.vocab_size} ({META_NAME})")
    return ids

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def locate(self, i: int) -> tuple[str, int]:
    """Global record index -> (shard file, record index inside it)."""
    f = int(np.searchsorted(self._ends, i, side="right"))
    return self.files[f], int(i - (self._ends[f - 1] if f else 0))

  def __getitem__(self, i: int) -> bytes:
    return self.read([i])[0]

  def read(self, indices: list[int]) -> list[bytes]:
    return [rec for rec, _, _ in self._read(indices)]

  def tokens(self, indices: list[int]) -> list[np.ndarray]:
    """The records `indices` as (little-endian) token id arrays, each checked."""
    return [self._decode(rec, f, i) for rec, f, i in self._read(indices)]

  def _read(self, indices: list[int]) -> list[tuple[bytes, str, int]]:
    idx = np.asarray(indices, np.int64)  # [n]
    if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
      raise IndexError(f"record index out of range [0, {len(self)})")
    which = np.searchsorted(self._ends, idx, side="right")  # [n]
    out: list = [None] * len(idx)
    for f in np.unique(which).tolist():
      sel = np.flatnonzero(which == f)  # [m]
      local = (idx[sel] - (self._ends[f - 1] if f else 0)).tolist()
      reader = self._readers.get(f)
      if reader is None:
        reader = self._readers[f] = self._reader(self.files[f])
      for j, i, rec in zip(sel.tolist(), local, self._read_file(reader, self.files[f], local)):
        out[j] = (rec, self.files[f], i)
    return out

  def __getstate__(self):
    return {**self.__dict__, "_readers": {}}


def _close(reader, f: str, quiet: bool = False) -> None:
  """Close an ArrayRecord reader; a damaged file can make close() raise (an empty RuntimeError)."""
  try:
    reader.close()
  except Exception as e:  # noqa: BLE001 - as in ShardSource._reader
    if not quiet:
      raise DataError(f"cannot read ArrayRecord shard '{f}': {first_line(e)} on close "
                      f"(truncated or damaged file?)") from None
