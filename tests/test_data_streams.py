"""Training streams: the global batches of a P-process run are those of a 1-process run (P dividing the
batch), every training document is read once per epoch, and a data position saved under one process count
(merged over processes) restores under another; worker processes change nothing; positions saved before
streams (one Grain state per process) still restore."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import BATCH_KEYS, DataError, load_tokenizer, make_train_iterator, merge_states
from maxlm.data.sources import EpochShuffle
from maxlm.data.streams import DONE, StreamDocs

WORDS = "the a cat sat on mat of Emma was very happy and Mr Knightley said no".split()


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
  """80 documents 'doc<i> w w w ...' of 1..90 words (many longer than the 32-token rows), one per line."""
  rng = np.random.default_rng(1)
  docs = [f"doc{i} " + " ".join(rng.choice(WORDS, rng.integers(1, 90))) for i in range(80)]
  path = tmp_path_factory.mktemp("numbered") / "docs.txt"
  path.write_text("\n".join(docs) + "\n")
  return path, docs


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
  """Short apple documents (a stream's first 3 blocks of 64 of them fill < 64 rows of 32 tokens, so the
  first banana block is reached in 64 steps), 40-word bananas."""
  d = tmp_path_factory.mktemp("mix")
  rng = np.random.default_rng(2)
  (d / "a.txt").write_text("".join(f"apple {i} " + " ".join(rng.choice(WORDS, rng.integers(1, 6))) + "\n"
                                   for i in range(200)))
  bananas = [{"text": f"banana {i} " + " ".join(rng.choice(WORDS, 40))} for i in range(200)]
  (d / "b.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bananas))
  return f"{d}/a.txt,{d}/b.jsonl"


def _same(a: dict, b: dict) -> bool:
  return all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in BATCH_KEYS)


def _global_run(its, steps=None, stopped=None):
  """Global batches of the processes `its` (in process order): their local batches concatenated; a process
  whose streams have ended gives empty rows (empty_batch) until every process's have, which ends the run.
  `stopped` (a list) collects the steps at which some but not all processes had ended."""
  out = []
  while steps is None or len(out) < steps:
    got = [next(it, None) for it in its]
    if all(g is None for g in got):
      break
    if stopped is not None and any(g is None for g in got):
      stopped.append(len(out))
    parts = [it.empty_batch() if g is None else g for g, it in zip(got, its)]
    out.append({k: np.concatenate([p[k] for p in parts]) for k in BATCH_KEYS})
  return out


def _processes(cfg, n, vocab=8192):
  return [make_train_iterator(cfg, vocab, p, n) for p in range(n)]


def _check_same_runs(runs):
  ref = runs[0]
  for run in runs[1:]:
    assert len(run) == len(ref)
    for a, b in zip(run, ref):
      assert _same(a, b)


def test_embedded_corpus_same_global_batches_for_1_2_4_8_processes():
  cfg = DataConfig(seq_len=64, global_batch_size=8, packing_bins=8)
  assert cfg.type == "auto" and not cfg.paths and cfg.shuffle  # auto without paths: the embedded corpus
  runs = [_global_run(_processes(cfg, n), steps=6) for n in (1, 2, 4, 8)]
  assert all(b["inputs"].shape == (8, 64) for b in runs[0])
  assert all((b["segment_ids"][:, 0] == 1).all() for b in runs[0])  # no empty row: the streams never end
  _check_same_runs(runs)


def test_mixture_same_global_batches_for_1_2_4_processes(mixture):
  cfg = DataConfig(type="mixture", paths=mixture, weights="3,1", seq_len=32, global_batch_size=4,
                   eval_fraction=0.1, packing_bins=4, max_segments_per_row=8)
  runs = [_global_run(_processes(cfg, n), steps=64) for n in (1, 2, 4)]
  tok = load_tokenizer()
  heads = np.concatenate([b["inputs"][b["positions"] == 1] for b in runs[0]])  # first token after BOS
  assert {tok.encode("apple")[0], tok.encode("banana")[0]} <= set(heads.tolist())  # both sources in use
  _check_same_runs(runs)


def test_finite_epoch_same_global_batches_to_the_end(numbered):
  """num_epochs=1: a P-process run pads a process whose streams ended with empty rows until all have, and
  gives exactly the 1-process batches, ending at the same step (the last batch is padded, not dropped)."""
  path, _ = numbered
  cfg = DataConfig(type="text", paths=str(path), seq_len=32, global_batch_size=4, eval_fraction=0.0,
                   num_epochs=1, packing_bins=4, max_segments_per_row=8)
  stopped: list[int] = []
  runs = [_global_run(_processes(cfg, 1))]
  runs += [_global_run(_processes(cfg, n), stopped=stopped) for n in (2, 4)]
  assert stopped  # some process ended before the others: its empty rows were needed
  assert (runs[0][-1]["segment_ids"] == 0).any(axis=1).any()  # the run ends with padded rows
  _check_same_runs(runs)


def _doc_numbers(batches) -> list[int]:
  """The number i of every 'doc<i> ...' document in the batches (its first chunk starts with BOS, doc<i>)."""
  tok, out = load_tokenizer(), []
  for b in batches:
    for inp, seg, pos in zip(b["inputs"], b["segment_ids"], b["positions"]):
      for s in range(1, seg.max() + 1):
        m = seg == s
        if pos[m][0] == 0 and inp[m][0] == tok.bos_id:
          text = tok.decode(inp[m][1:])
          if text.startswith("doc"):
            out.append(int(text[3:].split()[0]))
  return out


@pytest.mark.parametrize("epochs,processes", [(1, 2), (3, 4)])
def test_every_training_document_once_per_epoch(numbered, epochs, processes):
  """Across all streams (and processes) each training document is read `epochs` times, held-out ones never."""
  path, docs = numbered
  cfg = DataConfig(type="text", paths=str(path), seq_len=32, global_batch_size=8, eval_fraction=0.1,
                   num_epochs=epochs, packing_bins=4, max_segments_per_row=8)
  seen = _doc_numbers(_global_run(_processes(cfg, processes)))
  counts = np.bincount(seen, minlength=len(docs))
  assert (counts[::10] == 0).all()  # every 10th document is held out for eval
  train = np.ones(len(docs), bool)
  train[::10] = False
  assert (counts[train] == epochs).all(), counts


@pytest.mark.parametrize("n,streams,epochs", [(70, 8, 3), (5, 8, 4), (64, 64, 2)])
def test_stream_positions_partition_every_epoch(n, streams, epochs):
  """StreamDocs' index math: epoch e's positions over all streams are a permutation of the n documents (also
  with fewer documents than streams), each epoch in a new order, and a finite run has n * epochs in all."""
  order = EpochShuffle(n, 7, None)
  per_epoch = [[] for _ in range(epochs)]
  total = 0
  for r in range(streams):
    view = StreamDocs(order, n, streams, r, epochs)
    total += len(view)
    for j in range(len(view)):
      per_epoch[(r + streams * j) // n].append(view[j])  # global position r + streams * j
  assert total == n * epochs
  for e in range(epochs):
    assert sorted(per_epoch[e]) == list(range(n))
  by_position = [[int(order[e * n + i]) for i in range(n)] for e in range(epochs)]
  assert n < 6 or by_position[0] != by_position[1]
  assert len(StreamDocs(order, n, streams, 3, None)) > 2**40  # forever


def _json(state):
  return json.loads(json.dumps(state))


@pytest.mark.parametrize("finite", [False, True])
def test_position_saved_by_2_processes_restores_on_1_and_4(numbered, finite):
  """Save after k steps of a 2-process run (each process's get_state, merged), restore into a 1-process and
  a 4-process run: the following global batches are those of an uninterrupted 1-process run. The finite
  case saves once one of the two processes has ended (its rows are DONE, its batches padded)."""
  path, _ = numbered
  cfg = DataConfig(type="text", paths=str(path), seq_len=32, global_batch_size=4, eval_fraction=0.0,
                   num_epochs=1 if finite else 0, packing_bins=8, max_segments_per_row=8)
  whole = _global_run(_processes(cfg, 1), steps=None if finite else 24)
  k = 11
  if finite:
    stopped: list[int] = []
    _global_run(_processes(cfg, 2), stopped=stopped)
    assert stopped and stopped[0] + 1 < len(whole)
    k = stopped[0] + 1  # one process has ended, the other not
  two = _processes(cfg, 2)
  assert len(_global_run(two, steps=k)) == k
  assert [it.ended for it in two].count(True) == (1 if finite else 0)
  merged = merge_states([_json(it.get_state()) for it in two])
  assert merged["streams"] == 4 and sorted(merged["rows"]) == ["0", "1", "2", "3"] and merged["batches"] == k
  assert (DONE in merged["rows"].values()) == finite
  for n in (1, 4):  # 4 processes also read without threads or prefetch: positions do not depend on them
    its = _processes(cfg if n == 1 else dataclasses.replace(cfg, read_threads=0, prefetch=0), n)
    for it in its:
      it.set_state(_json(merged))
    rest = _global_run(its, steps=None if finite else len(whole) - k)
    assert len(rest) == len(whole) - k
    assert all(_same(a, b) for a, b in zip(rest, whole[k:]))


def test_states_that_do_not_fit_are_data_errors(numbered):
  path, _ = numbered
  cfg = DataConfig(type="text", paths=str(path), seq_len=32, global_batch_size=4, eval_fraction=0.0,
                   packing_bins=4)
  two = _processes(cfg, 2)
  for it in two:
    next(it)
  with pytest.raises(ValueError, match="2 of 4 rows"):
    merge_states([two[0].get_state()])
  with pytest.raises(DataError, match=r"holds 4 streams .* this run has 8: data.global_batch_size cannot"):
    make_train_iterator(DataConfig(type="text", paths=str(path), seq_len=32, global_batch_size=8,
                                   eval_fraction=0.0), 8192).set_state(two[0].get_state())
  with pytest.raises(DataError, match="lacks rows 0..1 of this process"):
    make_train_iterator(cfg, 8192, 0, 2).set_state(two[1].get_state())
  broken = merge_states([it.get_state() for it in two])
  broken["rows"]["2"] = {"parent": "nonsense"}
  with pytest.raises(DataError, match="state does not fit this data config"):
    make_train_iterator(cfg, 8192, 1, 2).set_state(broken)


def test_synthetic_rows_depend_on_seed_step_and_row_only():
  """Synthetic row r of global batch s depends on (data.seed, s, r) only: the same rows for any process count and
  any batch size (row r of an 8-row batch is row r of a 4-row one), other rows for another seed, step or row; each
  row is next-token pairs (targets = inputs shifted by one) over [0, V); the tokens follow Zipf's law (checked by
  counting, below); the position restores across process counts."""
  cfg = DataConfig(type="synthetic", seq_len=16, global_batch_size=4, seed=5)
  runs = [_global_run(_processes(cfg, n, vocab=100), steps=3) for n in (1, 2, 4)]
  _check_same_runs(runs)
  wide = _global_run(_processes(dataclasses.replace(cfg, global_batch_size=8), 2, vocab=100), steps=3)
  for narrow, eight in zip(runs[0], wide):
    assert _same(narrow, {k: v[:4] for k, v in eight.items()})
  reseeded = _global_run(_processes(dataclasses.replace(cfg, seed=6), 1, vocab=100), steps=3)
  rows = [tuple(b["inputs"][r]) for b in runs[0] for r in range(4)]
  assert len(set(rows)) == 12 and not set(rows) & {tuple(b["inputs"][r]) for b in reseeded for r in range(4)}
  for b in runs[0]:
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    assert b["inputs"].min() >= 0 and b["targets"].max() < 100
  two = _processes(cfg, 2, vocab=100)
  _global_run(two, steps=2)
  one = make_train_iterator(cfg, 100)
  one.set_state(merge_states([it.get_state() for it in two]))
  assert _same(next(one), runs[0][2])


def test_synthetic_tokens_follow_zipfs_law():
  """Token k of V = 100 is drawn with probability (1 / (k + 1)) / H_100 (H_100 = 5.187: token 0 at 19.3%, token 99
  at 0.19%). Counted over 64 x 256 x 4 = 65536 targets (independent draws), each of the ten most frequent tokens and
  the upper half together are within 5 binomial standard deviations of the law's count (a false alarm about once in
  a million per count; the data is seeded, so the outcome is fixed). Uniform tokens (token 0 at 1%: 118 deviations
  off) or a law shifted by one (1 / (k + 2): token 0 at 11.9%, 48 deviations off) fail."""
  cfg = DataConfig(type="synthetic", seq_len=256, global_batch_size=64, seed=1)
  toks = np.concatenate([b["targets"].ravel() for b in _global_run(_processes(cfg, 1, vocab=100), steps=4)])
  n, counts = toks.size, np.bincount(toks, minlength=100)
  assert n == 65536 and counts.size == 100
  harmonic = sum(1 / k for k in range(1, 101))
  law = np.array([1 / (k + 1) / harmonic for k in range(100)])
  for k in range(10):
    assert abs(counts[k] - n * law[k]) <= 5 * np.sqrt(n * law[k] * (1 - law[k])), (k, counts[k], n * law[k])
  tail = law[50:].sum()  # (H_100 - H_50) / H_100 = 0.133
  assert abs(counts[50:].sum() - n * tail) <= 5 * np.sqrt(n * tail * (1 - tail))


def _hash(batches) -> str:
  h = hashlib.sha256()
  for b in batches:
    for k in BATCH_KEYS:
      h.update(k.encode() + np.ascontiguousarray(b[k]).tobytes())
  return h.hexdigest()

