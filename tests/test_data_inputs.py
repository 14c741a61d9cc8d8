"""`check_inputs`: every training and eval input opened and checked before a run starts."""

import base64
import dataclasses

import pytest

from maxlm.config import DataConfig
from maxlm.data import DataError, check_inputs, make_eval_iterator, make_train_iterator
from maxlm.data.prepare import prepare

from test_data_pipeline import _expected_pieces, _pieces

DOCS = [f"document {i} says hello to the world" for i in range(40)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """Training text, eval text, eval shards (default tokenizer) and shards of a byte-level tokenizer."""
  tmp = tmp_path_factory.mktemp("inputs")
  (tmp / "train.txt").write_text("\n".join(DOCS) + "\n")
  (tmp / "held.txt").write_text("held out one\nheld out two\nheld out three\n")
  prepare([str(tmp / "held.txt")], str(tmp / "held_shards"), progress=False)
  (tmp / "bytes.tiktoken").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n"
                                              for i in range(256)))
  prepare([str(tmp / "held.txt")], str(tmp / "byte_shards"), tokenizer=str(tmp / "bytes.tiktoken"),
          progress=False)
  prepare([str(tmp / "train.txt")], str(tmp / "train_shards"), progress=False)
  return tmp


def _cfg(tmp, **kw):
  return DataConfig(**{**dict(type="text", paths=str(tmp / "train.txt"), seq_len=32, global_batch_size=4,
                              eval_fraction=0.1, num_epochs=1), **kw})


def _error(cfg) -> str:
  with pytest.raises(DataError) as e:
    check_inputs(cfg, 8192)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_counts(data):
  assert check_inputs(_cfg(data), 8192) == {"train_documents": 36, "eval_documents": 4}
  cfg = _cfg(data, eval_paths=str(data / "held.txt"))
  assert check_inputs(cfg, 8192) == {"train_documents": 40, "eval_documents": 3}
  assert check_inputs(DataConfig(type="synthetic"), 8192) == {"train_documents": 0, "eval_documents": 0}
  assert check_inputs(_cfg(data, eval_fraction=0.0), 8192) == {"train_documents": 40, "eval_documents": 0}


def test_bad_eval_inputs_found_up_front(data, tmp_path):
  """Each bad eval input stops check_inputs (no iterator, no batch) with the key and the culprit."""
  msg = _error(_cfg(data, eval_paths=str(tmp_path / "nope.txt")))
  assert msg == f"data.eval_paths: data file '{tmp_path / 'nope.txt'}' not found"
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n{"text": \n')
  assert _error(_cfg(data, eval_paths=str(bad))).startswith(f"data.eval_paths: {bad}:2: malformed JSON")
  (tmp_path / "empty.txt").write_text("\n")
  assert "empty file" in _error(_cfg(data, eval_paths=str(tmp_path / "empty.txt")))
  shards = tmp_path / "held_shards"
  shards.mkdir()
  for f in (data / "held_shards").iterdir():
    (shards / f.name).write_bytes(f.read_bytes()[:1000] if f.suffix == ".array_record" else f.read_bytes())
  msg = _error(_cfg(data, eval_paths=str(shards)))
  shard = shards / "shard-00000.array_record"
  assert msg.startswith(f"data.eval_paths: cannot open ArrayRecord shard '{shard}'")
  assert check_inputs(_cfg(data), 8192)  # the training inputs alone are fine


def test_eval_shards_with_raw_text_training(data):
  """Prepared eval shards serve a raw-text run (their format comes from their names), and must have been
  made with the tokenizer that training uses."""
  cfg = _cfg(data, eval_paths=str(data / "held_shards"))
  assert check_inputs(cfg, 8192) == {"train_documents": 40, "eval_documents": 3}
  held = ["held out one", "held out two", "held out three"]
  assert _pieces(list(make_eval_iterator(cfg, 8192)), cap=64) == _expected_pieces(held, 32)
  msg = _error(_cfg(data, eval_paths=str(data / "byte_shards")))
  assert "were tokenized with" in msg and "bytes.tiktoken" in msg
  with pytest.raises(DataError, match="were tokenized with"):  # the eval iterator checks it too
    make_eval_iterator(_cfg(data, eval_paths=str(data / "byte_shards")), 8192)


def test_eval_shards_with_shard_training(data):
  """Training and eval shards both trusted from their metadata must agree on the tokenizer."""
  cfg = DataConfig(type="arrayrecord", paths=str(data / "train_shards"), eval_paths=str(data / "held_shards"),
                   seq_len=32, global_batch_size=4)
  assert check_inputs(cfg, 8192) == {"train_documents": 40, "eval_documents": 3}
  next(make_train_iterator(cfg, 8192))  # what was checked also trains
  byte_shards = dataclasses.replace(cfg, eval_paths=str(data / "byte_shards"))
  msg = _error(byte_shards)
  want = f"shards '{data / 'byte_shards'}' were tokenized with {data / 'bytes.tiktoken'} but the training"
  assert msg.startswith(want)
  with pytest.raises(DataError, match="were tokenized with"):  # the eval iterator checks it too
    make_eval_iterator(byte_shards, 8192)
  byte_train = dataclasses.replace(cfg, paths=str(data / "byte_shards"), eval_paths=str(data / "held.txt"))
  msg = _error(byte_train)  # raw eval text would be tokenized with the default, not the shards' tokenizer
  assert msg.startswith(f"the training shards were tokenized with {data / 'bytes.tiktoken'}, not with ")


def test_data_type_auto_reads_the_format_from_the_file_names(data, tmp_path):
  """data.paths without data.type (the default `auto`) trains on those files, never on the shipped corpus."""
  from maxlm.data import resolve_type
  (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
  auto = DataConfig(seq_len=32, global_batch_size=4)
  assert auto.type == "auto" and resolve_type(auto).type == "embedded"
  cases = {str(data / "train.txt"): "text", str(tmp_path / "a.jsonl"): "jsonl",
           str(data / "train_shards"): "arrayrecord",
           f"{data / 'train.txt'},{tmp_path / 'a.jsonl'}": "mixture"}  # two entries of two formats
  for paths, want in cases.items():
    assert resolve_type(dataclasses.replace(auto, paths=paths)).type == want, paths
  assert resolve_type(dataclasses.replace(auto, paths=f"{data / 'train.txt'}", weights="1")).type == "mixture"
  # The batches are those of the files: the same as with the type given.
  got = next(make_train_iterator(_cfg(data, type="auto"), 8192))
  want = next(make_train_iterator(_cfg(data), 8192))
  assert (got["inputs"] == want["inputs"]).all()
  assert check_inputs(_cfg(data, type="auto"), 8192)["train_documents"] == check_inputs(_cfg(data), 8192)[
      "train_documents"]


def test_data_paths_with_a_type_that_ignores_them_is_refused(data, tmp_path):
  for typ, what in (("embedded", "the shipped corpus"), ("synthetic", "random tokens")):
    msg = _error(_cfg(data, type=typ))
    assert msg.startswith(f"data.paths is set, but data.type={typ} does not read files (it would train on {what})")
  (tmp_path / "notes").write_text("a\n")
  assert "cannot tell the format of" in _error(_cfg(data, type="auto", paths=str(tmp_path / "notes")))
  assert "no files match" in _error(_cfg(data, type="auto", paths=str(tmp_path / "*.nothing")))
