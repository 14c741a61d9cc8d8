"""Prepared ArrayRecord shards that are damaged or inconsistent: one-line errors naming shard and record."""

import json
import lzma
import shutil

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from maxlm.config import DataConfig
from maxlm.data import DataError, make_train_iterator
from maxlm.data.prepare import prepare
from maxlm.data.readers import META_NAME
from maxlm.data.sources import EMBEDDED_CORPUS

SHARD0, SHARD1 = "shard-00000.array_record", "shard-00001.array_record"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """400 Austen paragraphs in two shards, the first holding more records than the second."""
  tmp = tmp_path_factory.mktemp("prepared")
  paras = lzma.open(EMBEDDED_CORPUS, "rt").read().splitlines()[:400]
  (tmp / "austen.txt").write_text("\n".join(paras) + "\n")
  meta = prepare([str(tmp / "austen.txt")], str(tmp / "shards"), shard_tokens=22_000, progress=False)
  counts = [s["documents"] for s in meta["shards"]]
  assert len(counts) == 2 and counts[0] > counts[1] > 0, counts
  return tmp / "shards"


@pytest.fixture
def shards(prepared, tmp_path):
  """A private copy of the prepared shards, to damage."""
  return shutil.copytree(prepared, tmp_path / "shards")


def _cfg(path, **kw):
  return DataConfig(**{**dict(type="arrayrecord", paths=str(path), seq_len=64, global_batch_size=4,
                              eval_fraction=0.0, num_epochs=1, shuffle=False), **kw})


def _epoch_error(path) -> str:
  """The DataError of opening the shards or of reading them for one epoch; it must be one line."""
  with pytest.raises(DataError) as e:
    for _ in make_train_iterator(_cfg(path), 8192):
      pass
  msg = str(e.value)
  assert "\n" not in msg and "\r" not in msg
  return msg


def _num_records(path) -> int:
  r = ArrayRecordReader(str(path))
  n = r.num_records()
  r.close()
  return n


def _unreadable(path, i) -> bool:
  """Whether record i of `path` fails to read, asked of array_record directly."""
  try:
    r = ArrayRecordReader(str(path), "readahead_buffer_size:0")
    r.read([i])
    r.close()
    return False
  except Exception:
    return True


def test_intact_shards_read_fully(shards):
  """The reference for the damage tests: the intact copy gives every record (no false alarm)."""
  n = sum(_num_records(shards / s) for s in (SHARD0, SHARD1))
  assert n == 400
  batches = list(make_train_iterator(_cfg(shards), 8192))
  assert sum(int((b["positions"] == 0).sum()) for b in batches) >= 400  # >= 1 segment per document


def test_truncated_shard(shards):
  """Truncation anywhere (incl. exactly at the 64 KiB block boundary, where the library's error has an
  empty message) is a one-line DataError naming the shard, when it is opened."""
  data = (shards / SHARD1).read_bytes()
  assert len(data) > 65537
  for cut in (0, 100, 40_000, 65_536, 65_537, len(data) - 200, len(data) - 1):
    (shards / SHARD1).write_bytes(data[:cut])
    msg = _epoch_error(shards)
    assert f"'{shards / SHARD1}'" in msg, (cut, msg)
    with pytest.raises(DataError):  # found up front, before any batch is asked for
      make_train_iterator(_cfg(shards), 8192)


def test_flipped_bytes_name_shard_and_record(shards):
  """Flipped bytes in the records of the second shard: a one-line error naming that shard and the index
  (inside that file) of a record that array_record itself cannot read."""
  data = (shards / SHARD1).read_bytes()
  n1 = _num_records(shards / SHARD1)
  used = len(data[:65_536].rstrip(b"\0"))  # records come first; the rest of the block is padding
  for frac in (0.25, 0.5, 0.75):
    pos = int(used * frac)
    bad = bytearray(data)
    bad[pos:pos + 8] = bytes(b ^ 0x5A for b in bad[pos:pos + 8])
    (shards / SHARD1).write_bytes(bytes(bad))
    msg = _epoch_error(shards)
    assert f"'{shards / SHARD1}'" in msg, (frac, msg)
    i = int(msg.split("record ")[1].split()[0])
    assert 0 <= i < n1 and _unreadable(shards / SHARD1, i), (frac, msg)  # a local index (n0 > n1)


def _write_shard(path, records):
  w = ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    w.write(r)
  w.close()


def _set_listed(shards, name, documents):
  meta = json.loads((shards / META_NAME).read_text())
  meta["shards"] = [s for s in meta["shards"] if s["file"] != name] + [{"file": name, "documents": documents,
                                                                          "tokens": 0}]
  (shards / META_NAME).write_text(json.dumps(meta))


@pytest.mark.parametrize("bad,why", [
    (np.array([5, 6, 7], "<u2").tobytes() + b"\x01", "7 bytes is not a whole number of uint16 token ids"),
    (np.array([5, 9000, 7], "<u2").tobytes(), "token id 9000 is >= the shards' vocabulary size 8192"),
], ids=["odd_length", "id_over_vocab"])
def test_bad_record_found_while_training(shards, bad, why):
  """A bad record that the check on opening does not sample (record 13 of 50: samples are the first,
  the last and every quarter) stops training with its shard file and its index in that file."""
  good = np.array([5, 6, 7], "<u2").tobytes()
  _write_shard(shards / SHARD1, [good] * 13 + [bad] + [good] * 36)
  _set_listed(shards, SHARD1, 50)
  it = make_train_iterator(_cfg(shards), 8192)  # opens: record 13 is not sampled
  with pytest.raises(DataError) as e:
    list(it)
  assert str(e.value).startswith(f"corrupt record 13 in ArrayRecord shard '{shards / SHARD1}': {why}")


def test_metadata_checked_up_front(shards):
  """maxlm_data.json that disagrees with the shards stops when the source is opened, naming the culprit."""
  meta = json.loads((shards / META_NAME).read_text())
  n1 = meta["shards"][1]["documents"]

  def expect(match, **change):
    (shards / META_NAME).write_text(json.dumps({**meta, **change}))
    with pytest.raises(DataError, match=match) as e:
      make_train_iterator(_cfg(shards), 8192)
    assert "\n" not in str(e.value)

  expect(r"maxlm_data.json' is not a valid maxlm_data.json: 'dtype' is 'int16'", dtype="int16")
  tok = {**meta["tokenizer"], "vocab_size": 70_000}
  expect(r"'dtype' uint16 cannot hold the ids of a 70000-token vocabulary", tokenizer=tok)
  miscount = [meta["shards"][0], {**meta["shards"][1], "documents": n1 + 1}]
  expect(rf"shard '{shards / SHARD1}' holds {n1} records but maxlm_data.json lists {n1 + 1}", shards=miscount)
  tok = {**meta["tokenizer"], "vocab_size": 200}  # metadata that lies about the vocabulary
  expect(rf"corrupt record 0 in ArrayRecord shard '{shards / SHARD0}': token id \d+ is >= the shards' "
         r"vocabulary size 200", tokenizer=tok)
  gone = "shard-00007.array_record"
  expect(rf"lists shard '{gone}' but '{shards / gone}' is missing",
         shards=meta["shards"] + [{"file": gone, "documents": 1}])
  (shards / META_NAME).write_text(json.dumps(meta))
  shutil.copy(shards / SHARD1, shards / "shard-00002.array_record")  # a stray shard from elsewhere
  with pytest.raises(DataError, match="shard-00002.array_record' is not listed in"):
    make_train_iterator(_cfg(shards), 8192)

