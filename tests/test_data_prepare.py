"""`python -m maxlm.data.prepare` end to end: shards, metadata, training from them, bad input."""

import base64
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxlm.config import DataConfig
from maxlm.data import BATCH_KEYS, DataError, load_tokenizer, make_eval_iterator, make_train_iterator
from maxlm.data.prepare import main, prepare
from maxlm.data.readers import META_NAME

from test_data_pipeline import _check_state_restore


@pytest.fixture
def inputs(tmp_path):
  docs = [f"Document number {i} says " + "hello world " * (i % 40) for i in range(90)]
  (tmp_path / "a.txt").write_text("\n".join(docs[:30]) + "\n")
  (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[30:60]))
  pq.write_table(pa.table({"body": docs[60:]}), tmp_path / "c.parquet")
  return tmp_path, docs


def _records(out):
  from array_record.python.array_record_module import ArrayRecordReader
  meta = json.loads((out / META_NAME).read_text())
  recs = []
  for s in meta["shards"]:
    r = ArrayRecordReader(str(out / s["file"]))
    recs += [np.frombuffer(x, meta["dtype"]) for x in r.read_all()]
    r.close()
  return meta, recs


def test_prepare_all_formats(inputs):
  tmp, docs = inputs
  out = tmp / "shards"
  meta = prepare([str(tmp / "a.txt"), str(tmp / "b.jsonl"), str(tmp / "c.parquet")], str(out),
                 field="body", shard_tokens=500, progress=False)
  meta2, recs = _records(out)
  assert meta == meta2
  tok = load_tokenizer()
  assert len(recs) == meta["documents"] == 90
  for rec, doc in zip(recs, docs):
    np.testing.assert_array_equal(rec, tok.encode(doc))  # raw ids, no BOS/EOS stored
  assert meta["tokens"] == sum(len(r) for r in recs)
  assert len(meta["shards"]) > 1 and all(s["tokens"] > 0 for s in meta["shards"])
  assert meta["dtype"] == "uint16" and meta["tokenizer"]["sha256"] == tok.sha256
  assert meta["skipped"] == {}


def test_shards_train_like_raw_text(inputs):
  tmp, docs = inputs
  out = tmp / "shards"
  prepare([str(tmp / "a.txt")], str(out), shard_tokens=100, progress=False)
  common = dict(seq_len=32, global_batch_size=4, eval_fraction=0.1)
  raw = DataConfig(type="text", paths=str(tmp / "a.txt"), **common)
  shards = DataConfig(type="arrayrecord", paths=str(out), **common)
  it_a, it_b = make_train_iterator(raw, 8192), make_train_iterator(shards, 8192)
  for _ in range(6):
    a, b = next(it_a), next(it_b)
    assert all(np.array_equal(a[k], b[k]) for k in BATCH_KEYS)
  ev_a, ev_b = list(make_eval_iterator(raw, 8192)), list(make_eval_iterator(shards, 8192))
  assert len(ev_a) == len(ev_b) and all(np.array_equal(a[k], b[k]) for a, b in zip(ev_a, ev_b)
                                         for k in BATCH_KEYS)
  _check_state_restore(shards, 8192)
  _check_state_restore(DataConfig(type="mixture", paths=f"{out},{tmp / 'a.txt'}", weights="2,1",
                                  **common), 8192, process_index=1, process_count=2)


def test_shard_vocab_checks(inputs):
  tmp, _ = inputs
  out = tmp / "shards"
  prepare([str(tmp / "a.txt")], str(out), progress=False)
  cfg = DataConfig(type="arrayrecord", paths=str(out), seq_len=32, global_batch_size=4)
  with pytest.raises(DataError, match="8192-token tokenizer .* model.vocab_size is 1000"):
    make_train_iterator(cfg, 1000)
  meta = json.loads((out / META_NAME).read_text())
  meta["tokenizer"]["vocab_size"] = 100  # shards that lie about their vocabulary
  (out / META_NAME).write_text(json.dumps(meta))
  with pytest.raises(DataError, match=r"data batch 0 holds token id \d+ outside \[0, model.vocab_size=100\)"):
    next(make_train_iterator(cfg, 100))
  other = tmp / "bytes.tiktoken"  # a byte-level tiktoken vocabulary: not the shards' tokenizer
  other.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
  with pytest.raises(DataError, match="were tokenized with"):
    make_train_iterator(DataConfig(type="arrayrecord", paths=str(out), tokenizer=str(other)), 8192)
  (out / META_NAME).unlink()
  with pytest.raises(DataError, match="has no maxlm_data.json"):
    make_train_iterator(cfg, 8192)


def test_cli_summary_and_bad_records(inputs, capsys):
  tmp, _ = inputs
  bad = tmp / "bad.jsonl"
  bad.write_text('{"body": "good"}\n{"body": \n{"text": "x"}\n{"body": "also good"}\n')
  out = tmp / "out"
  assert main([str(bad), "-o", str(out), "--field", "body", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{bad}:2: malformed JSON" in err
  assert not list(out.glob("*.array_record"))  # nothing half-written is left
  assert main([str(bad), str(tmp / "a.txt"), "-o", str(out), "--field", "body", "--no-progress",
               "--skip-bad-records"]) == 0
  text = capsys.readouterr().out
  assert "prepared 32 documents" in text and "skipped 2 bad records" in text
  assert "1 x malformed JSON" in text and "1 x missing field 'body'" in text
  assert f"{bad}:3" in text
  assert main([str(bad), "-o", str(out), "--no-progress"]) == 2  # already prepared: no overwrite
  assert "--overwrite" in capsys.readouterr().err
  assert main([str(tmp / "missing.txt"), "-o", str(tmp / "o2"), "--no-progress"]) == 2
  assert "not found" in capsys.readouterr().err
  assert main([str(tmp / "a.txt"), "-o", str(tmp / "o3"), "--tokenizer", str(bad), "--no-progress"]) == 2
  assert "cannot load tokenizer" in capsys.readouterr().err


def test_cli_module_entry_point(inputs):
  tmp, _ = inputs
  r = subprocess.run([sys.executable, "-m", "maxlm.data.prepare", str(tmp / "a.txt"), "-o",
                      str(tmp / "cli")], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "prepared 30 documents" in r.stdout and "prepare" in r.stderr  # tqdm bar on stderr


def test_corrupt_shard_record(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  src = tmp_path / "a.txt"
  src.write_text("one document\nanother document\n")
  out = tmp_path / "shards"
  prepare([str(src)], str(out), progress=False)
  w = ArrayRecordWriter(str(out / "shard-00001.array_record"), "group_size:1")
  w.write(b"\x01\x02\x03")  # 3 bytes: not whole uint16 token ids
  w.close()
  cfg = DataConfig(type="arrayrecord", paths=str(out), seq_len=16, global_batch_size=2, eval_fraction=0)
  with pytest.raises(DataError, match="corrupt record 2 in ArrayRecord shards"):
    next(make_train_iterator(cfg, 8192))
  (out / "shard-00001.array_record").write_bytes(b"not an array record file")
  with pytest.raises(DataError, match="cannot open ArrayRecord shard .*shard-00001"):
    make_train_iterator(cfg, 8192)
