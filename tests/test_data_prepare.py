"""`maxlm prepare` end to end: shards, metadata, training from them, bad input."""

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
from maxlm.cli.prepare import main
from maxlm.data.prepare import prepare, summary
from maxlm.data.readers import META_NAME

from test_data_pipeline import _check_state_restore
from test_data_readers import _corrupt_parquet


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
  meta["tokenizer"]["vocab_size"] = 100  # shards that lie about their vocabulary: found on opening
  (out / META_NAME).write_text(json.dumps(meta))
  with pytest.raises(DataError, match=r"corrupt record 0 in ArrayRecord shard .*shard-00000.array_record': "
                                      r"token id \d+ is >= the shards' vocabulary size 100"):
    make_train_iterator(cfg, 100)
  meta["tokenizer"]["vocab_size"] = 8192
  (out / META_NAME).write_text(json.dumps(meta))
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
  assert main([str(bad), f"out={out}", "field=body", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{bad}:2: malformed JSON" in err
  assert not list(out.glob("*.array_record"))  # nothing half-written is left
  assert main([str(bad), str(tmp / "a.txt"), f"out={out}", "field=body", "--no-progress",
               "--skip-bad-records"]) == 0
  text = capsys.readouterr().out
  assert "prepared 32 documents" in text and "skipped 2 bad records" in text
  assert "1 x malformed JSON" in text and "1 x missing field 'body'" in text
  assert f"{bad}:3" in text
  assert main([str(bad), f"out={out}", "--no-progress"]) == 2  # already prepared: no overwrite
  assert "--overwrite" in capsys.readouterr().err
  assert main([str(tmp / "missing.txt"), f"out={tmp / 'o2'}", "--no-progress"]) == 2
  assert "not found" in capsys.readouterr().err
  assert main([str(tmp / "a.txt"), f"out={tmp / 'o3'}", f"tokenizer={bad}", "--no-progress"]) == 2
  assert "cannot load tokenizer" in capsys.readouterr().err


def test_cli_module_entry_point(inputs):
  """The module runs as documented; without a terminal there is no progress bar, so stderr is empty."""
  tmp, _ = inputs
  r = subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", str(tmp / "a.txt"), f"out={tmp / 'cli'}"],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "prepared 30 documents" in r.stdout and r.stderr == ""


def _run_all(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
  """Run several prepare commands at once (each pays the import time; they overlap)."""
  procs = [subprocess.Popen([sys.executable, "-m", "maxlm.cli", "prepare", *a], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for a in argvs]
  out = []
  for a, p in zip(argvs, procs):
    stdout, stderr = p.communicate(timeout=300)
    out.append(subprocess.CompletedProcess(a, p.returncode, stdout, stderr))
  return out


def test_cli_bad_input_is_one_line_and_leaves_nothing(inputs):
  """Each bad input: exit 2, stderr exactly one line `maxlm: error: ...` naming the culprit, nothing
  written (no output directory, whether or not its parent existed)."""
  tmp, _ = inputs
  bad_json = tmp / "bad.jsonl"
  bad_json.write_text('{"body": "good"}\n' * 600 + '{"body": \n')  # after the first batch of documents
  bad_pq = tmp / "bad.parquet"
  _corrupt_parquet(bad_pq, "snappy")  # a damaged data page behind an intact footer
  outs = [tmp / f"out{i}" / "nested" for i in range(6)]
  cases = [  # (argv, what the one line must contain)
      ([str(tmp / "missing.txt"), f"out={outs[0]}"], f"data file '{tmp / 'missing.txt'}' not found"),
      ([str(tmp / "a.txt"), f"out={tmp / 'b.jsonl'}"], f"output '{tmp / 'b.jsonl'}' exists and is not"),
      ([str(tmp / "a.txt"), f"out={outs[2]}", f"tokenizer={tmp / 'no.model'}"],
       f"tokenizer file '{tmp / 'no.model'}' not found"),
      ([str(bad_pq), f"out={outs[3]}"], f"cannot read '{bad_pq}' (Parquet, after row 0)"),
      ([str(bad_json), f"out={outs[4]}", "field=body"], f"{bad_json}:601: malformed JSON"),
      ([str(tmp / "a.txt")], "prepare: out=<directory> is required"),
      ([str(tmp / "a.txt"), f"out={outs[1]}", "format=csv"], "format must be one of auto, text, jsonl, parquet"),
      ([str(tmp / "a.txt"), "-o", str(outs[5])], "prepare: -o is now out=VALUE"),  # the spelling before
  ]
  before = (tmp / "b.jsonl").read_bytes()
  for (argv, want), r in zip(cases, _run_all([c[0] for c in cases])):
    assert r.returncode == 2, (argv, r.stderr)
    assert r.stderr.startswith("maxlm: error: ") and r.stderr.count("\n") == 1, (argv, r.stderr)
    assert want in r.stderr, (want, r.stderr)
    assert r.stdout == ""
  assert not any(o.parent.exists() for o in outs)  # directories prepare created are gone again
  assert (tmp / "b.jsonl").read_bytes() == before


@pytest.mark.parametrize("argv, want", [
    (["a.txt", "-o", "x"], "-o is now out=VALUE"),
    (["a.txt", "--output=x"], "--output is now out=VALUE"),
    (["a.txt", "out=x", "--tokenizer", "t.model"], "--tokenizer is now tokenizer=VALUE"),
    (["a.txt", "out=x", "--tokenizer-type", "hf"], "--tokenizer-type is now tokenizer_type=VALUE"),
    (["a.txt", "out=x", "--text-split", "file"], "--text-split is now text_split=VALUE"),
    (["a.txt", "out=x", "--shard-tokens", "9"], "--shard-tokens is now shard_tokens=VALUE"),
    (["a.txt", "out=x", "--progress"], "unknown option --progress"),
    (["a.txt", "out=x", "data.field=body"], "data.field is a config key; prepare takes none"),
    (["out=x"], "no INPUT given"),
    (["a.txt", "out=x", "threads=two"], "threads='two' is not an int"),
    (["a.txt", "out=x", "tokenizer_type=bpe"], "tokenizer_type must be one of auto, sentencepiece, hf, tiktoken"),
    (["a.txt", "out=x", "text_split=page"], "text_split must be one of"),
    (["a.txt", "out=x", "threads=-1"], "threads must be >= 0"),
])
def test_bad_arguments_and_old_spellings_are_one_line_exit_2(inputs, monkeypatch, capsys, argv, want):
  """The spellings before the one grammar (`-o DIR`, `--tokenizer PATH`) name the new one; nothing is made."""
  tmp, _ = inputs
  monkeypatch.chdir(tmp)
  assert main(argv) == 2
  captured = capsys.readouterr()
  assert captured.err.startswith("maxlm: error: ") and captured.err.count("\n") == 1 and want in captured.err
  assert captured.out == "" and not (tmp / "x").exists()


def test_old_module_command_names_the_new_one(inputs):
  """`python -m maxlm.data.prepare` (the data layer cannot import the commands) fails in one line, exit 2."""
  tmp, _ = inputs
  r = subprocess.run([sys.executable, "-m", "maxlm.data.prepare", str(tmp / "a.txt"), "-o", str(tmp / "x")],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
  assert r.stderr.startswith("maxlm: error: ") and "is now `maxlm prepare INPUT... out=DIR" in r.stderr
  assert not (tmp / "x").exists()


def test_overwrite_failure_keeps_old_data(inputs, capsys):
  """--overwrite replaces prepared data only once the new data is complete: a failing run keeps it."""
  tmp, _ = inputs
  out = tmp / "shards"
  prepare([str(tmp / "a.txt")], str(out), progress=False)
  old = {f.name: f.read_bytes() for f in out.iterdir()}
  (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
  assert main([str(tmp / "bad.jsonl"), f"out={out}", "--overwrite", "--no-progress"]) == 2
  assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
  assert {f.name: f.read_bytes() for f in out.iterdir()} == old  # no staging directory left either
  assert main([str(tmp / "b.jsonl"), f"out={out}", "--overwrite", "field=body", "--no-progress"]) == 0
  assert json.loads((out / META_NAME).read_text())["documents"] == 30
  assert sorted(f.name for f in out.iterdir()) == [META_NAME, "shard-00000.array_record"]


def test_summary_and_help_tell_how_to_train_and_evaluate(inputs, capsys):
  """The printed train command works as printed, and the eval advice (data.eval_paths=DIR) works too."""
  tmp, docs = inputs
  assert main([str(tmp / "a.txt"), f"out={tmp / 'train'}", "--no-progress"]) == 0
  text = capsys.readouterr().out
  line = next(x for x in text.splitlines() if x.startswith("train with: python -m maxlm.train "))
  overrides = dict(kv.split("=", 1) for kv in line.split("python -m maxlm.train ")[1].split())
  assert overrides == {"data.type": "arrayrecord", "data.paths": str(tmp / "train")}
  assert "model.vocab_size >= 8192" in text and "data.eval_paths=EVAL_DIR" in text
  assert "every k-th document is held out" in text and "every 50th by default" in text
  assert main([str(tmp / "b.jsonl"), f"out={tmp / 'held'}", "field=body", "--no-progress"]) == 0
  cfg = DataConfig(type=overrides["data.type"], paths=overrides["data.paths"], eval_paths=str(tmp / "held"),
                   seq_len=32, global_batch_size=4, num_epochs=1)
  assert make_train_iterator(cfg, 8192).info["documents"] == 30  # nothing held out of training
  assert make_eval_iterator(cfg, 8192).info["documents"] == 30  # the separate eval set
  assert main(["--help"]) == 0
  help_text = capsys.readouterr().out
  for part in ("data.eval_paths=EVAL_DIR", "every k-th document", "without BOS/EOS",
               "uint16 when the vocabulary has at most 65,536 tokens", "docs/data_format.md",
               *(f"\n  {k}" for k in ("INPUT...", "out=DIR", "tokenizer=PATH", "tokenizer_type=", "format=", "field=",
                                      "text_split=", "shard_tokens=N", "threads=N", "--skip-bad-records",
                                      "--overwrite", "--no-progress"))):  # every argument is explained
    assert part in help_text, part


def _wordlevel(path):
  """A WordLevel tokenizer.json of 70,000 tokens: specials 0-2, then word `t{i}` has id i (3..69,999)."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, 70_000)}
  t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  t.save(str(path))


def test_vocab_over_65535_round_trips_as_uint32(tmp_path):
  """Ids above 65,535 survive prepare -> shards -> training batches unchanged (a uint16 store would
  wrap them): every segment equals BOS + the ids the words name + EOS, chunked as packing does."""
  _wordlevel(tmp_path / "tokenizer.json")
  rng = np.random.default_rng(0)  # mostly ids above 65,535, some below
  docs = [" ".join(f"t{i}" for i in rng.integers(60_000, 70_000, rng.integers(1, 12))) for _ in range(50)]
  (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n")
  meta = prepare([str(tmp_path / "docs.txt")], str(tmp_path / "shards"),
                 tokenizer=str(tmp_path / "tokenizer.json"), progress=False)
  assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_000
  cfg = DataConfig(type="arrayrecord", paths=str(tmp_path / "shards"), seq_len=16, global_batch_size=2,
                   eval_fraction=0, num_epochs=1, shuffle=False, max_segments_per_row=16)
  got = []
  for b in make_train_iterator(cfg, 70_016):
    for inp, tgt, seg in zip(b["inputs"], b["targets"], b["segment_ids"]):
      for s in range(1, seg.max() + 1):
        got.append(tuple(inp[seg == s].tolist()) + (int(tgt[seg == s][-1]),))
  want = []
  for d in docs:
    ids = [1] + [int(w[1:]) for w in d.split()] + [2]
    want += [tuple(ids[s:s + 17]) for s in range(0, len(ids) - 1, 16)]
  assert sorted(got) == sorted(want)
  assert max(max(p) for p in got) > 65_535


def test_summary_gives_a_rate_only_for_a_measurable_time():
  """A tiny input prepared in 0.0 s (rounded) gets no tokens/s (it printed 2,410,000,000,000 tokens/s); 2.0 s
  gets tokens / seconds."""
  meta = {"documents": 3, "tokens": 2410, "dtype": "uint16", "shards": ["s0"], "skipped": {},
          "tokenizer": {"kind": "sentencepiece", "path": "t.model", "vocab_size": 8192, "bos_id": 1, "eos_id": 2}}
  assert "tokens/s" not in summary({**meta, "seconds": 0.0}, "out").splitlines()[0]
  assert summary({**meta, "seconds": 2.0}, "out").splitlines()[0].endswith("in 2.0 s (1,205 tokens/s)")


def test_summary_notes_too_few_documents_for_the_default_split(tmp_path, capsys):
  """A file with no blank lines prepared with text_split=paragraph is one document, which the default eval
  split takes whole: the summary says so and names the levers; training then agrees with the count it gave."""
  (tmp_path / "prose.txt").write_text("".join(f"line {i} of prose with no blank line\n" for i in range(60)))
  assert main([str(tmp_path / "prose.txt"), f"out={tmp_path / 'one'}", "text_split=paragraph", "--no-progress"]) == 0
  text = capsys.readouterr().out
  assert text.splitlines()[0].startswith("prepared 1 document, ")
  assert ("note: only 1 document: by default training holds out the first for eval and trains on the other 0 "
          "(data.eval_fraction=0 trains on all); text_split=paragraph found few in the text files, text_split=line "
          "makes a document per line") in text.splitlines()
  with pytest.raises(DataError, match="has no training documents"):
    make_train_iterator(DataConfig(type="arrayrecord", paths=str(tmp_path / "one"), seq_len=16, global_batch_size=2),
                        8192)
  # 50 lines, one document each: still noted (one held out, 49 to train on, as training counts them); 60: not
  (tmp_path / "fifty.txt").write_text("".join(f"doc {i}\n" for i in range(50)))
  assert main([str(tmp_path / "fifty.txt"), f"out={tmp_path / 'fifty'}", "--no-progress"]) == 0
  assert "note: only 50 documents: by default training holds out the first for eval and trains on the other 49 " \
         "(data.eval_fraction=0 trains on all)" in capsys.readouterr().out.splitlines()
  cfg = DataConfig(type="arrayrecord", paths=str(tmp_path / "fifty"), seq_len=16, global_batch_size=2, num_epochs=1)
  assert make_train_iterator(cfg, 8192).info["documents"] == 49
  assert main([str(tmp_path / "prose.txt"), f"out={tmp_path / 'sixty'}", "--no-progress"]) == 0
  assert "note:" not in capsys.readouterr().out
