"""Pipeline tests: batch contract, synthetic data, state determinism, sharding, packing."""

import dataclasses
import math
import hashlib
import json
import logging
import lzma
import re
import threading

import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import (BATCH_KEYS, DataError, load_tokenizer, make_eval_iterator, make_train_iterator,
                        merge_states)
from maxlm.data.pipeline import DataIterator, start_line
from maxlm.data.sources import EMBEDDED_CORPUS
from maxlm.data.tokenizer import DEFAULT_TOKENIZER


def _hash(batches) -> str:
  h = hashlib.sha256()
  for b in batches:
    for k in BATCH_KEYS:
      h.update(k.encode() + np.ascontiguousarray(b[k]).tobytes())
  return h.hexdigest()


def _take(it, n):
  return [next(it) for _ in range(n)]


def _check_state_restore(cfg, vocab, **kw):
  it = make_train_iterator(cfg, vocab, **kw)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # survives a JSON round trip
  want = _hash(_take(it, 5))
  fresh = make_train_iterator(cfg, vocab, **kw)
  fresh.set_state(state)
  assert _hash(_take(fresh, 5)) == want


def test_synthetic_contract_and_determinism():
  cfg = DataConfig(type="synthetic", seq_len=16, global_batch_size=8, seed=3)
  b = next(make_train_iterator(cfg, 100, process_index=1, process_count=2))
  assert set(b) == set(BATCH_KEYS)
  for k in BATCH_KEYS:
    assert b[k].shape == (4, 16) and b[k].dtype == np.int32
  assert 0 <= b["inputs"].min() and b["inputs"].max() < 100
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  assert (b["segment_ids"] == 1).all()
  np.testing.assert_array_equal(b["positions"], np.tile(np.arange(16), (4, 1)))
  again = next(make_train_iterator(cfg, 100, process_index=1, process_count=2))
  np.testing.assert_array_equal(b["inputs"], again["inputs"])
  other = next(make_train_iterator(cfg, 100, process_index=0, process_count=2))
  assert not np.array_equal(b["inputs"], other["inputs"])
  reseeded = next(make_train_iterator(dataclasses.replace(cfg, seed=4), 100, 1, 2))
  assert not np.array_equal(b["inputs"], reseeded["inputs"])
  assert make_eval_iterator(cfg, 100) is None


def test_synthetic_tokens_follow_zipf():
  """Token k has probability (1 / (k + 1)) / H_V (the reference is written here from the law itself): the
  observed frequencies of the first ranks and of the tail agree within 5 standard errors of a binomial count."""
  v, n = 1000, 16 * 4096
  cfg = DataConfig(type="synthetic", seq_len=4096, global_batch_size=16, seed=0)
  toks = next(make_train_iterator(cfg, v))["inputs"].ravel()
  assert toks.size == n and toks.min() >= 0 and toks.max() < v
  h = sum(1.0 / k for k in range(1, v + 1))
  counts = np.bincount(toks, minlength=v)
  for ranks in ([0], [1], [2], [9], list(range(100, 1000))):
    p = sum(1.0 / (k + 1) for k in ranks) / h
    got = counts[ranks].sum()
    assert abs(got - n * p) < 5 * math.sqrt(n * p * (1 - p)), (ranks, got, n * p)


def test_synthetic_state_restore():
  _check_state_restore(DataConfig(type="synthetic", seq_len=8, global_batch_size=2), 50)


def test_synthetic_benchmark_shape_is_cheap():
  cfg = DataConfig(type="synthetic", seq_len=4096, global_batch_size=4)
  b = _take(make_train_iterator(cfg, 128256), 3)[-1]
  assert b["inputs"].shape == (4, 4096) and b["inputs"].max() < 128256


def test_bad_process_arguments():
  cfg = DataConfig(type="synthetic", global_batch_size=6)
  with pytest.raises(DataError, match="divisible"):
    make_train_iterator(cfg, 10, 0, 4)
  with pytest.raises(DataError, match="process_index"):
    make_train_iterator(cfg, 10, 2, 2)


# --- real text: packing, sharding, epochs, eval, state --------------------------------------------

WORDS = "the a cat sat on mat of Emma was very happy and Mr Knightley said no".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """60 documents of 1..120 words (some longer than seq_len tokens), one per line."""
  rng = np.random.default_rng(0)
  docs = [f"doc{i} " + " ".join(rng.choice(WORDS, rng.integers(1, 120))) for i in range(60)]
  path = tmp_path_factory.mktemp("corpus") / "docs.txt"
  path.write_text("\n".join(docs) + "\n")
  return path, docs


def _cfg(path, **kw):
  base = dict(type="text", paths=str(path), seq_len=32, global_batch_size=4, eval_fraction=0.0,
              num_epochs=1, max_segments_per_row=8, packing_bins=8)
  return DataConfig(**{**base, **kw})


def _expected_pieces(docs, seq_len):
  tok = load_tokenizer()
  out = []
  for d in docs:
    ids = [1, *tok.encode(d).tolist(), 2]
    out += [tuple(ids[s:min(s + seq_len + 1, len(ids))]) for s in range(0, len(ids) - 1, seq_len)]
  return sorted(out)


def _pieces(batches, cap):
  """Check the packing invariants of every row; return each segment's tokens (inputs + last target)."""
  out = []
  for b in batches:
    for inp, tgt, seg, pos in zip(b["inputs"], b["targets"], b["segment_ids"], b["positions"]):
      used = int((seg > 0).sum())
      assert (seg[used:] == 0).all() and (inp[used:] == 0).all()  # padding only at the end
      assert (tgt[used:] == 0).all() and (pos[used:] == 0).all()
      assert seg[0] == 1 if used else True
      assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all()
      assert seg.max() <= cap
      for s in range(1, seg.max() + 1):
        m = np.flatnonzero(seg == s)
        assert len(m) and (np.diff(m) == 1).all()
        np.testing.assert_array_equal(pos[m], np.arange(len(m)))  # positions restart per document
        np.testing.assert_array_equal(tgt[m][:-1], inp[m][1:])  # shifted inside the document
        out.append(tuple(inp[m].tolist()) + (int(tgt[m][-1]),))
  return sorted(out)


def test_packing_invariants_and_exact_content(corpus):
  path, docs = corpus
  cfg = _cfg(path, max_segments_per_row=3)
  batches = list(make_train_iterator(cfg, 8192))
  assert all(b[k].shape == (4, 32) and b[k].dtype == np.int32 for b in batches for k in BATCH_KEYS)
  assert _pieces(batches, cap=3) == _expected_pieces(docs, 32)
  assert max(int(b["segment_ids"].max()) for b in batches) == 3  # the cap binds here


def _reference_pieces(docs, seq_len, bos, eos):
  """What packing must emit, written from the batch contract and independent of maxlm: each document is
  [BOS] + SentencePiece ids + [EOS] (as configured), shifted by one token (input i -> target i + 1) and cut
  into chunks of <= seq_len (input, target) pairs; a chunk is stored as its inputs plus its last target,
  so consecutive chunks of a document share one token."""
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=str(DEFAULT_TOKENIZER))
  out = []
  for d in docs:
    ids = [sp.bos_id()] * bos + sp.encode(d) + [sp.eos_id()] * eos
    out += [tuple(ids[s:s + seq_len + 1]) for s in range(0, len(ids) - 1, seq_len)]
  return sorted(out)


@pytest.fixture(scope="module")
def austen(tmp_path_factory):
  """Real text: 150 Austen paragraphs (many longer than the 64-token rows used below), one per line."""
  paras = lzma.open(EMBEDDED_CORPUS, "rt").read().splitlines()[1000:1150]
  path = tmp_path_factory.mktemp("austen") / "austen.txt"
  path.write_text("\n".join(paras) + "\n")
  return path, paras


@pytest.mark.parametrize("shuffle,bos,eos", [(False, True, True), (True, True, True), (True, False, True),
                                             (False, True, False), (True, False, False)])
def test_packing_against_reference(austen, shuffle, bos, eos):
  """One epoch of packed rows holds every document's tokens exactly once, as the reference cuts them, and
  every row keeps the packing invariants (_pieces); long documents are split; the segment cap holds."""
  path, paras = austen
  cfg = _cfg(path, seq_len=64, max_segments_per_row=4, shuffle=shuffle, add_bos=bos, add_eos=eos)
  batches = list(make_train_iterator(cfg, 8192))
  want = _reference_pieces(paras, 64, bos, eos)
  assert sum(len(p) == 65 for p in want) > len(paras) // 2  # many full chunks: long documents split
  assert _pieces(batches, cap=4) == want
  assert max(int(b["segment_ids"].max()) for b in batches) == 4  # the cap binds here


def test_processes_disjoint_and_complete(corpus):
  path, docs = corpus
  cfg = _cfg(path, global_batch_size=6)
  per_process = [_pieces(list(make_train_iterator(cfg, 8192, p, 3)), cap=8) for p in range(3)]
  merged = sorted(x for pieces in per_process for x in pieces)
  assert merged == _expected_pieces(docs, 32)  # complete, and no piece twice
  assert all(per_process)


def test_epochs_reshuffle(corpus):
  path, docs = corpus
  batches = list(make_train_iterator(_cfg(path, num_epochs=2, seq_len=256), 8192))
  pieces = _pieces(batches, cap=8)
  assert pieces == sorted(_expected_pieces(docs, 256) * 2)
  tok, seen = load_tokenizer(), []
  for b in batches:
    for inp, seg in zip(b["inputs"], b["segment_ids"]):
      for s in range(1, seg.max() + 1):
        text = tok.decode(inp[seg == s])
        seen += [int(text[3:].split()[0])] if text.startswith("doc") else []
  first = sorted(range(60), key=seen.index)
  second = sorted(range(60), key=lambda d: len(seen) - 1 - seen[::-1].index(d))
  rank = {d: i for i, d in enumerate(second)}
  discordant = sum(rank[a] > rank[b] for i, a in enumerate(first) for b in first[i + 1:])
  assert discordant > 0.25 * 60 * 59 / 2  # the second epoch is in a new order (~0.5 when random)


def test_seed_changes_order(corpus):
  path, _ = corpus
  a = next(make_train_iterator(_cfg(path, seed=1), 8192))
  b = next(make_train_iterator(_cfg(path, seed=2), 8192))
  assert not np.array_equal(a["inputs"], b["inputs"])


def test_state_restore_embedded_default():
  cfg = DataConfig(seq_len=64, global_batch_size=4)
  assert cfg.type == "auto"  # the default: no data.paths, so the embedded corpus
  _check_state_restore(cfg, 8192)
  _check_state_restore(dataclasses.replace(cfg, prefetch=0, read_threads=0), 8192, process_index=1,
                       process_count=2)


def test_mixture_weights_and_state(tmp_path):
  (tmp_path / "a.txt").write_text("".join(f"apple {i}\n" for i in range(300)))
  (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": f"banana {i}"}) + "\n" for i in range(300)))
  cfg = DataConfig(type="mixture", paths=f"{tmp_path}/a.txt,{tmp_path}/b.jsonl", weights="3,1",
                   seq_len=64, global_batch_size=4, eval_fraction=0.0)
  tok = load_tokenizer()
  apple, banana = tok.encode("apple")[0], tok.encode("banana")[0]
  # Each stream (row) mixes blocks of 64 documents A A A B A A A B ... (Grain's selection for 3:1) and packs
  # them over 64 bins, so after 4 x 64 rows it has emitted exactly 4 packed groups: a prefix of its
  # document sequence. A prefix of D documents holds 0.75 D ones from a.txt give or take 48 (it ends inside
  # the A A A blocks at worst: 192 of 192 instead of 144), and every document here is one row segment.
  batches = _take(make_train_iterator(cfg, 8192), 256)
  for r in range(4):
    heads = np.concatenate([b["inputs"][r][b["positions"][r] == 1] for b in batches])  # [documents of row r]
    n_a, n_b = int((heads == apple).sum()), int((heads == banana).sum())
    assert n_a + n_b == len(heads) and abs(n_a - 0.75 * len(heads)) <= 48, (r, n_a, n_b)
  _check_state_restore(cfg, 8192)
  held = [f"apple {i}" for i in range(0, 300, 10)] + [f"banana {i}" for i in range(0, 300, 10)]
  evals = list(make_eval_iterator(dataclasses.replace(cfg, eval_fraction=0.1), 8192))
  assert _pieces(evals, cap=64) == _expected_pieces(held, 64)  # every source's held-out part
  with pytest.raises(DataError, match="needs 2 positive numbers"):
    make_train_iterator(dataclasses.replace(cfg, weights="1"), 8192)


def test_eval_split_disjoint_and_multiprocess(corpus):
  path, docs = corpus
  cfg = _cfg(path, eval_fraction=0.1, num_epochs=1)
  train = _pieces(list(make_train_iterator(cfg, 8192)), cap=8)
  held = [d for i, d in enumerate(docs) if i % 10 == 0]
  single = list(make_eval_iterator(cfg, 8192))
  assert _pieces(single, cap=8) == _expected_pieces(held, 32)
  assert train == _expected_pieces([d for i, d in enumerate(docs) if i % 10], 32)
  assert list(make_eval_iterator(cfg, 8192))  # a fresh pass each call
  two = [list(make_eval_iterator(cfg, 8192, p, 2)) for p in range(2)]
  assert len(two[0]) == len(two[1]) == len(single)  # same number of batches on every process
  for step, b in enumerate(single):
    for k in BATCH_KEYS:
      np.testing.assert_array_equal(np.concatenate([two[0][step][k], two[1][step][k]]), b[k])
  assert make_eval_iterator(_cfg(path), 8192) is None  # no split, no eval_paths


def test_eval_paths_turn_off_the_split(corpus, tmp_path):
  """With data.eval_paths, eval reads those files and training every one of its documents, whatever
  data.eval_fraction says (here 0.1, which would otherwise hold out 6 of the 60)."""
  path, docs = corpus
  held = tmp_path / "held.txt"
  held.write_text("held out one\nheld out two\n")
  cfg = _cfg(path, eval_paths=str(held), eval_fraction=0.1)
  assert _pieces(list(make_eval_iterator(cfg, 8192)), cap=8) == _expected_pieces(
      ["held out one", "held out two"], 32)
  it = make_train_iterator(cfg, 8192)
  assert it.info["documents"] == 60
  assert _pieces(list(it), cap=8) == _expected_pieces(docs, 32)  # each document once, none held out
  embedded = make_train_iterator(DataConfig(eval_paths=str(held)), 8192)  # the default corpus too
  assert embedded.info["documents"] == sum(1 for line in lzma.open(EMBEDDED_CORPUS, "rt") if line.strip())


def test_bad_config_and_skips(tmp_path):
  with pytest.raises(DataError, match="data.type' must be one of"):
    make_train_iterator(DataConfig(type="csv"), 8192)
  with pytest.raises(DataError, match="needs data.paths"):
    make_train_iterator(DataConfig(type="jsonl"), 8192)
  with pytest.raises(DataError, match="eval_fraction"):
    make_train_iterator(DataConfig(eval_fraction=0.9), 8192)
  (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
  with pytest.raises(DataError, match="looks like jsonl but is read as text; set data.type=jsonl"):
    make_train_iterator(DataConfig(type="text", paths=str(tmp_path / "x.jsonl")), 8192)
  bad = tmp_path / "d.jsonl"
  bad.write_text('{"text": "fine document"}\n{oops\n' * 4)
  with pytest.raises(DataError, match=r"d.jsonl:2: malformed JSON"):
    make_train_iterator(DataConfig(type="jsonl", paths=str(bad), eval_fraction=0), 8192)
  it = make_train_iterator(DataConfig(type="jsonl", paths=str(bad), eval_fraction=0,
                                      skip_bad_records=True), 8192)
  assert it.info["skipped"] == 4 and "4 malformed JSON" in it.info["skipped_summary"]
  assert next(it)["segment_ids"].max() >= 1


def test_worker_processes_give_the_same_batches(corpus):
  """Grain worker processes only move work: 1 worker gives the batches of none, and a position saved with 1
  restores with 2 (each owns 2 of the 4 streams) and continues with the same batches to the end."""
  path, docs = corpus
  cfg = _cfg(path, num_epochs=1)
  want = list(make_train_iterator(cfg, 8192))
  assert _pieces(want, cap=8) == _expected_pieces(docs, 32)
  it = make_train_iterator(dataclasses.replace(cfg, worker_count=1), 8192)
  head = _take(it, 2)
  state = json.loads(json.dumps(it.get_state()))
  assert _hash(head + list(it)) == _hash(want)
  fresh = make_train_iterator(dataclasses.replace(cfg, worker_count=2), 8192)
  fresh.set_state(state)
  assert _hash(list(fresh)) == _hash(want[2:])


def test_state_from_another_config_is_a_data_error():
  it = make_train_iterator(DataConfig(type="synthetic", seq_len=8, global_batch_size=2), 50)
  with pytest.raises(DataError, match="state does not fit"):
    it.set_state({"grain": {"unexpected": 1}, "batches": 3})


# --- eval iterators, synthetic positions, merged states -----------------------------------------


def test_eval_packs_the_held_out_documents_in_order_and_slices_rows_per_process(corpus, caplog):
  """eval_fraction 0.1 holds out documents 0, 10, ..., 50; eval packs them unshuffled (the seed changes
  nothing), every process keeps its rows of each global batch (the last one padded with empty rows), and
  an eval iterator has no checkpointable position."""
  path, docs = corpus
  cfg = _cfg(path, eval_fraction=0.1)
  held = [d for i, d in enumerate(docs) if i % 10 == 0]
  it = make_eval_iterator(cfg, 8192)
  single = list(it)
  assert _pieces(single, cap=8) == _expected_pieces(held, 32)
  assert {k: it.info[k] for k in ("type", "sources", "documents", "process")} == {
      "type": "eval", "sources": [str(path)], "documents": 6, "process": "0/1"}
  assert it.empty_batch()["inputs"].shape == (4, 32)
  with pytest.raises(DataError, match="^an eval data iterator has no checkpointable position$"):
    it.get_state()
  with pytest.raises(DataError, match="^an eval data iterator has no checkpointable position$"):
    it.set_state({"streams": 4, "batches": 0, "rows": {}})
  it.close()
  reseeded = make_eval_iterator(dataclasses.replace(cfg, seed=7), 8192)
  assert _hash(reseeded) == _hash(single)
  reseeded.close()
  halves = [make_eval_iterator(cfg, 8192, p, 2) for p in range(2)]
  assert halves[1].info["process"] == "1/2" and halves[1].empty_batch()["inputs"].shape == (2, 32)
  two = [list(h) for h in halves]
  assert len(two[0]) == len(two[1]) == len(single)  # same number of batches on every process
  for step, b in enumerate(single):
    for k in BATCH_KEYS:
      np.testing.assert_array_equal(np.concatenate([two[0][step][k], two[1][step][k]]), b[k])
  assert not single[-1]["segment_ids"][-1].any()  # 10 rows in batches of 4: the last batch is padded
  for h in halves:
    h.close()
  with caplog.at_level(logging.WARNING, logger="maxlm.data"):
    assert make_eval_iterator(_cfg(path), 8192) is None  # no split, no eval_paths: no eval, quietly
  assert not caplog.records


def test_eval_of_one_document_and_of_none(tmp_path, corpus, caplog):
  path, _ = corpus
  one = tmp_path / "one.txt"
  one.write_text("only one held out document\n")
  it = make_eval_iterator(_cfg(path, eval_paths=str(one)), 8192)
  assert it.info["documents"] == 1 and _pieces(list(it), cap=8) == _expected_pieces(["only one held out document"], 32)
  it.close()
  bad, worse = tmp_path / "bad.jsonl", tmp_path / "worse.jsonl"
  bad.write_text("{oops\n{oops\n")
  worse.write_text("{oops\n")
  cfg = _cfg(path, type="mixture", paths=f"{bad},{worse}", weights="1,1", eval_paths=f"{bad},{worse}",
             skip_bad_records=True)  # a mixture: one source per file
  with caplog.at_level(logging.WARNING, logger="maxlm.data"):
    assert make_eval_iterator(cfg, 8192) is None
  assert [r.getMessage() for r in caplog.records][-1] == f"data (eval): no held-out documents in {bad}, {worse}"


def test_synthetic_positions_from_the_start_far_ahead_and_inconsistent():
  cfg = DataConfig(type="synthetic", seq_len=8, global_batch_size=2, seed=5)
  it = make_train_iterator(cfg, 50)
  assert it.info == {"type": "synthetic", "tokenizer": "none (random tokens, Zipf-distributed)"}
  assert it.empty_batch()["inputs"].shape == (2, 8)
  start = it.get_state()  # before the first batch: every row at the beginning
  want = _take(it, 130)  # past 124 = 2 * 62 steps
  fresh = make_train_iterator(cfg, 50)
  fresh.set_state(start)
  assert _hash(_take(fresh, 2)) == _hash(want[:2])
  far = make_train_iterator(cfg, 50)
  far.set_state({"streams": 2, "batches": 128, "rows": {"0": {"next_index": 128}, "1": {"next_index": 128}}})
  assert _hash(_take(far, 2)) == _hash(want[128:])
  with pytest.raises(DataError, match=re.escape("ValueError: synthetic rows at different steps [1, 2]")):
    far.set_state({"streams": 2, "batches": 1, "rows": {"0": {"next_index": 1}, "1": {"next_index": 2}}})


def test_merge_states_joins_every_process_and_refuses_inconsistent_ones():
  cfg = DataConfig(type="synthetic", seq_len=8, global_batch_size=4)
  its = [make_train_iterator(cfg, 50, p, 2) for p in range(2)]
  for it in its:
    _take(it, 3)
  a, b = (it.get_state() for it in its)
  merged = merge_states([a, b])
  assert merged == {"streams": 4, "batches": 3, "rows": {**a["rows"], **b["rows"]}}
  assert merge_states([merged]) == merged  # one state holding every row
  with pytest.raises(ValueError, match=r"^merge_states needs stream states \(get_state of stream iterators\)$"):
    merge_states([])
  with pytest.raises(ValueError, match="needs stream states"):
    merge_states([a, {"grain": {}, "batches": 3}])
  for other, where in (({**b, "batches": 4}, "[(4, 3), (4, 4)]"), ({**b, "streams": 8}, "[(4, 3), (8, 3)]"),
                       (a, "[(4, 3), (4, 3)]")):  # another step, another batch size, the same rows twice
    with pytest.raises(ValueError, match=re.escape(f"data states of different positions (streams, batches): {where}")):
      merge_states([a, other])
  with pytest.raises(ValueError, match="^data states hold 2 of 4 rows$"):
    merge_states([a])
  six = dataclasses.replace(cfg, global_batch_size=6)
  first = make_train_iterator(six, 50, 0, 2).get_state()  # rows 0..2 only
  with pytest.raises(DataError, match=r"^data iterator state lacks rows 3\.\.5 of this process$"):
    make_train_iterator(six, 50, 1, 2).set_state(first)


def test_train_info_thread_options_segment_cap_and_sources_without_training_documents(corpus, tmp_path):
  path, _ = corpus
  it = make_train_iterator(_cfg(path), 8192, 1, 2)
  assert {k: it.info[k] for k in ("type", "sources", "documents", "weights", "process", "rows")} == {
      "type": "train", "sources": [str(path)], "documents": 60, "weights": [1.0], "process": "1/2",
      "rows": "2..3 of 4"}
  it.close()
  for key in ("read_threads", "worker_count", "prefetch"):
    with pytest.raises(DataError, match="^" + re.escape(
        "config keys data.read_threads, data.worker_count and data.prefetch must be >= 0") + "$"):
      make_train_iterator(_cfg(path, **{key: -1}), 8192)
  with pytest.raises(DataError, match=re.escape("config key 'data.max_segments_per_row' must be >= 1, got 0")):
    make_train_iterator(_cfg(path, max_segments_per_row=0), 8192)
  assert max(int(b["segment_ids"].max()) for b in make_train_iterator(_cfg(path, max_segments_per_row=1), 8192)) == 1
  two, one = tmp_path / "two.txt", tmp_path / "one.txt"
  two.write_text("one doc\nanother doc\n")
  one.write_text("one doc\n")
  assert make_train_iterator(_cfg(two, eval_fraction=0.5), 8192).info["documents"] == 1  # document 1 trains
  with pytest.raises(DataError, match="^" + re.escape(
      f"data source '{one}' has no training documents: data.eval_fraction 0.5 holds out one document in 2, "
      f"starting with the first, which leaves none of its 1 document; set data.eval_fraction=0, evaluate on "
      f"separate files (data.eval_paths), or give it more documents (text files: data.text_split=line makes one "
      f"per line)") + "$"):
    make_train_iterator(_cfg(one, eval_fraction=0.5), 8192)
  assert make_train_iterator(_cfg(one, eval_fraction=0), 8192).info["documents"] == 1  # the first lever works



def test_start_line_says_what_the_batches_are_made_of(tmp_path):
  """The run's data line: sources (with weights for a mixture), training documents, tokenizer, and the eval
  data; synthetic tokens say so."""
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text("".join(f"a {i}\n" for i in range(100)))
  b.write_text("".join(f"b {i}\n" for i in range(10)))
  cfg = _cfg(f"{a},{b}", weights="3,1", type="auto", eval_fraction=0.02)
  it = make_train_iterator(cfg, 8192)
  line = start_line(it.info, cfg)
  it.close()
  assert line.startswith(f"data: {a} (weight 0.75), {b} (weight 0.25): 107 training documents; sentencepiece ")
  assert line.endswith("; eval on one document in 50 held out")  # 100 - 2 held out of a, 10 - 1 of b
  one = _cfg(str(a), eval_paths=str(b))
  it = make_train_iterator(one, 8192)
  assert start_line(it.info, one).startswith(f"data: {a}: 100 training documents; ")
  assert start_line(it.info, one).endswith(f"; eval on {b}")
  assert start_line(it.info, _cfg(str(a), eval_fraction=0)).endswith("; no eval data (data.eval_fraction=0)")
  it.close()
  for paths, label in ((f"{tmp_path}/*.txt", f"{tmp_path}/*.txt (2 files)"), (str(tmp_path), f"{tmp_path} (2 files)"),
                       (f"{a},{b}", f"{a},{b} (2 files)")):  # what a glob, a directory or a list matched
    many = _cfg(paths, type="text", eval_fraction=0)
    it = make_train_iterator(many, 8192)
    assert start_line(it.info, many).startswith(f"data: {label}: 110 training documents; ")
    it.close()
  synthetic = DataConfig(type="synthetic", seq_len=8, global_batch_size=2)
  assert start_line(make_train_iterator(synthetic, 64).info, synthetic) == (
      "data: synthetic random tokens (Zipf-distributed), no tokenizer; no eval data")

def test_close_stops_the_pipelines_threads(corpus):
  path, _ = corpus
  before = set(threading.enumerate())
  it = make_train_iterator(_cfg(path, read_threads=2, prefetch=2), 8192)
  next(it)
  started = [t for t in threading.enumerate() if t not in before]
  assert started  # Grain's reading / prefetch threads
  it.close()
  for t in started:
    t.join(timeout=10)
  assert not [t.name for t in started if t.is_alive()]
  with pytest.raises(DataError, match="^this data iterator was closed$"):
    next(it)



def test_every_batch_is_checked_against_the_vocabulary():
  """A token id outside [0, vocab_size) stops before the step runs, naming the id, the batch and the
  tokenizer; the largest valid id (vocab_size - 1) passes."""
  def one_batch(ids):
    ids = np.asarray([ids], np.int32)  # [1, 4]
    batch = {"inputs": ids, "targets": ids[:, ::-1].copy(), "segment_ids": np.ones_like(ids), "positions": ids * 0}
    return DataIterator(lambda states: iter([(batch, {"0": None})]), 10, {"tokenizer": "tok.model"}, rows=range(1),
                        seq_len=4, streams=1)
  assert next(one_batch([0, 9, 3, 4]))["inputs"].max() == 9
  want = ("data batch 0 holds token id {} outside [0, model.vocab_size=10) (tokenizer: tok.model); use a tokenizer "
          "that fits the model's vocabulary or raise model.vocab_size")
  for ids, bad in (([0, 10, 3, 4], 10), ([0, -1, 3, 4], -1), ([11, -1, 3, 4], 11)):
    with pytest.raises(DataError, match=f"^{re.escape(want.format(bad))}$"):
      next(one_batch(ids))
  it = DataIterator(lambda states: iter([({"inputs": np.full((1, 4), 10, np.int32),
                                           "targets": np.zeros((1, 4), np.int32)}, {"0": None})]), 10, rows=range(1),
                    seq_len=4, streams=1)
  with pytest.raises(DataError, match=re.escape("(tokenizer: ?)")):  # no tokenizer in the info
    next(it)


def test_the_data_summary_is_logged(corpus, tmp_path, caplog):
  path, _ = corpus
  with caplog.at_level(logging.INFO, logger="maxlm.data"):
    it = make_train_iterator(_cfg(path), 8192)
  assert [r.getMessage() for r in caplog.records] == [
      f"data (train): 60 documents from {path}; {it.info['tokenizer']}; no records skipped"]
  it.close()
  caplog.clear()
  bad, other = tmp_path / "d.jsonl", tmp_path / "e.txt"
  bad.write_text('{"text": "fine document"}\n{oops\n' * 4)
  other.write_text("another document\n")
  with caplog.at_level(logging.INFO, logger="maxlm.data"):
    it = make_train_iterator(DataConfig(type="mixture", paths=f"{bad},{other}", weights="1,1", eval_fraction=0,
                                        skip_bad_records=True), 8192)
  summary = it.info["skipped_summary"]
  assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
      ("INFO", f"data (train): 5 documents from {bad}, {other}; {it.info['tokenizer']}; {summary}"),
      ("WARNING", f"data (train): {summary}")]
  it.close()
