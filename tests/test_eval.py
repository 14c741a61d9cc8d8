"""`maxlm eval` (maxlm/cli/eval.py over Model.eval and maxlm/evaluate.py): token-weighted loss, perplexity, bits
per byte against hand computations and a per-document reference, and one-line errors with exit codes for bad input."""

import json
import math
import os

import jax
import numpy as np
import pytest

from maxlm import Model
from maxlm.cli import eval as eval_cli
from maxlm.data import load_tokenizer
from maxlm.evaluate import segment_bytes, summarize
from maxlm.model import Transformer
from tiny_checkpoint import make_checkpoint

DOCS = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich.", "short"]
U32 = 2.0 ** -24  # fp32 unit roundoff


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return make_checkpoint(tmp_path_factory.mktemp("eval"))


def _cli(capsys, *args):
  code = eval_cli.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


def _logits(cfg, params, inputs, width=16):
  """The model's fp32 logits [T, V] of one document alone (padded to one width: one compilation; causal
  attention keeps the padding after a token out of its logits)."""
  padded = np.zeros((1, width), np.int32)  # [1, W]
  padded[0, :len(inputs)] = inputs
  return np.asarray(_forward(cfg)(params, padded))[0, :len(inputs)]  # [T, V]


_FORWARDS = {}


def _forward(cfg):
  if cfg not in _FORWARDS:
    model = Transformer(cfg.model)
    _FORWARDS[cfg] = jax.jit(lambda p, t: model.apply({"params": p}, t))
  return _FORWARDS[cfg]


def _nll(logits, targets):
  """Summed next-token NLL (float64 log-softmax of fp32 logits [T, V])."""
  logits = logits.astype(np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)  # [T]
  return float(np.sum(logz - logits[np.arange(len(targets)), targets]))


def _tolerance(cfg, max_logit):
  """Bound on one token's NLL difference between a packed row and the document alone, in fp32: a logit
  differs by at most 2 * (8 per layer + 2) reductions of length K, each within gamma_K = K*u/(1-K*u)
  relative (see test_generation._tolerance), times the largest logit; the NLL (logsumexp minus the
  target's logit) by twice that."""
  k = max(cfg.model.d_model, cfg.model.ffn_dim, cfg.data.seq_len)
  return 2 * 2 * (8 * cfg.model.n_layers + 2) * k * U32 / (1 - k * U32) * max_logit


def test_summary_by_hand():
  got = summarize(loss_sum=10.0, tokens=4, n_bytes=20)
  assert got["loss"] == 2.5 and got["tokens"] == 4 and got["bytes"] == 20
  assert got["perplexity"] == pytest.approx(12.182493960703473, rel=1e-15)  # e^2.5
  # 10 nats over 20 bytes: 10 / ln 2 = 14.426950408889634 bits, / 20 bytes = 0.7213475204444817
  assert got["bits_per_byte"] == pytest.approx(0.7213475204444817, rel=1e-15)


def test_segment_bytes_by_hand():
  """UTF-8 bytes of each segment's decoded targets, BOS/EOS left out: 13 ('café au lait', é is two
  bytes) + 39 (the ASCII sentence) + 6 ('naïve', ï is two bytes) = 58, whatever rows they share."""
  tok = load_tokenizer("")
  a, b, c = (tok.encode(t).tolist() for t in ("café au lait", "It is a truth universally acknowledged.", "naïve"))
  eos, bos = tok.eos_id, tok.bos_id
  width = len(b) + 1 + len(c)
  targets = np.zeros((2, width), np.int32)
  seg = np.zeros((2, width), np.int32)
  targets[0, :len(a) + 2] = [bos] + a + [eos]
  seg[0, :len(a) + 2] = 1
  targets[1] = b + [eos] + c
  seg[1] = [1] * (len(b) + 1) + [2] * len(c)
  assert segment_bytes(tok, targets, seg, skip_ids=[bos, eos]) == 13 + 39 + 6


def test_loss_is_weighted_by_tokens_over_unequal_batches(run):
  """Batch 1 holds 3 target tokens, batch 2 holds 32: the loss is (sum of all NLL) / 35, not the mean
  of the two batch means (which the test shows would differ)."""
  run_dir, cfg, params = run
  loaded = Model.load(str(run_dir))
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 8192, size=n + 1).tolist() for n in (3, 16, 16)]  # inputs+1 tokens each
  batches = []
  for rows in ([docs[0]], [docs[1], docs[2]]):
    b = {k: np.zeros((2, 16), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    for r, d in enumerate(rows):
      n = len(d) - 1
      b["inputs"][r, :n], b["targets"][r, :n] = d[:-1], d[1:]
      b["segment_ids"][r, :n], b["positions"][r, :n] = 1, np.arange(n)
    batches.append(b)
  out = loaded.eval(iter(batches))
  logits = [_logits(cfg, params, d[:-1]) for d in docs]
  nll = [_nll(lg, d[1:]) for lg, d in zip(logits, docs)]
  want = sum(nll) / 35
  tol = _tolerance(cfg, max(np.abs(lg).max() for lg in logits))
  assert out["tokens"] == 35 and out["batches"] == 2
  assert abs(out["loss"] - want) <= tol
  batch_means = (nll[0] / 3 + (nll[1] + nll[2]) / 32) / 2
  assert abs(batch_means - want) > 10 * tol


def test_cli_on_files(run, capsys, tmp_path):
  run_dir, cfg, params = run
  f = tmp_path / "held_out.txt"
  f.write_text("\n".join(DOCS) + "\n")
  code, out, err = _cli(capsys, f"checkpoint={run_dir}", "data.type=text", f"data.eval_paths={f}",
                        "data.global_batch_size=2", "data.seq_len=16")
  assert code == 0, err
  assert len(out.strip().splitlines()) == 1
  got = json.loads(out)
  tok = load_tokenizer("")
  ids = [tok.encode(d).tolist() for d in DOCS]
  assert max(len(i) + 1 for i in ids) <= 16  # each document fits a row: no chunking in the reference
  # Targets are each document's tokens and its EOS (BOS is only an input); bytes are the documents' text.
  assert got["tokens"] == sum(len(i) + 1 for i in ids)
  assert got["bytes"] == sum(len(d.encode("utf-8")) for d in DOCS)
  logits = [_logits(cfg, params, [tok.bos_id] + i) for i in ids]
  nll = sum(_nll(lg, i + [tok.eos_id]) for lg, i in zip(logits, ids))
  tol = _tolerance(cfg, max(np.abs(lg).max() for lg in logits))
  assert abs(got["loss"] - nll / got["tokens"]) <= tol
  assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
  assert got["bits_per_byte"] == pytest.approx(got["loss"] * got["tokens"] / (math.log(2) * got["bytes"]),
                                               rel=1e-12)
  assert got["step"] == 0


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_data_paths_alone_evaluates_the_held_out_split_of_those_files(run, capsys, tmp_path, suffix):
  """`data.paths=FILE` without data.type over a run trained on synthetic tokens: the format comes from the
  file's name (the run's own data.type is not kept), and the eval is the held-out split of FILE, here with
  eval_fraction 0.5 every second document starting with the first: DOCS[0] and DOCS[2] of four."""
  run_dir = run[0]
  docs = DOCS + ["Pride and prejudice."]
  f = tmp_path / f"corpus{suffix}"
  lines = docs if suffix == ".txt" else [json.dumps({"text": d}) for d in docs]
  f.write_text("\n".join(lines) + "\n")
  code, out, err = _cli(capsys, f"checkpoint={run_dir}", f"data.paths={f}", "data.eval_fraction=0.5",
                        "data.global_batch_size=2", "data.seq_len=16")
  assert code == 0, err
  got = json.loads(out)
  tok = load_tokenizer("")
  held = [docs[0], docs[2]]
  assert got["tokens"] == sum(len(tok.encode(d)) + 1 for d in held)  # each document's tokens and its EOS
  assert got["bytes"] == sum(len(d.encode("utf-8")) for d in held)


def test_bad_input_one_line_and_exit_code(run, capsys, tmp_path):
  run_dir = run[0]
  cases = [
      ([f"checkpoint={tmp_path}/missing"], 3, "no such file or directory"),
      ([f"checkpoint={run_dir}", "data.eval_pahts=x"], 2, "unknown config key 'data.eval_pahts'"),
      ([f"checkpoint={run_dir}"], 2, "no eval data for data.type=synthetic"),
      ([f"checkpoint={run_dir}", "data.type=text", f"data.eval_paths={tmp_path}/none.txt"], 2, "none.txt"),
      ([f"checkpoint={run_dir}", "model.n_layers=3"], 2, "model.n_layers is fixed by the checkpoint"),
      (["data.type=text"], 2, "checkpoint=<run, checkpoint or Hugging Face directory> is required"),
  ]
  before = sorted(os.listdir(tmp_path))
  for args, code, msg in cases:
    got, out, err = _cli(capsys, *args)
    assert got == code, (args, err)
    assert err.count("\n") == 1 and err.startswith("maxlm: error: ") and msg in err, (args, err)
    assert out == ""
  assert sorted(os.listdir(tmp_path)) == before


def test_eval_of_a_converted_tree(run, capsys, tmp_path):
  """A `convert hf-to-maxlm` output directory (any name) evaluates like the run it came from; it has no step."""
  from maxlm.cli.convert import main as convert
  run_dir = run[0]
  assert convert(["maxlm-to-hf", f"src={run_dir}", f"out={tmp_path / 'hf'}"]) == 0
  assert convert(["hf-to-maxlm", f"src={tmp_path / 'hf'}", f"out={tmp_path / 'default-back'}"]) == 0
  f = tmp_path / "held_out.txt"
  f.write_text("\n".join(DOCS) + "\n")
  common = ["data.type=text", f"data.eval_paths={f}", "data.global_batch_size=2", "data.seq_len=16"]
  capsys.readouterr()
  code, out, err = _cli(capsys, f"checkpoint={tmp_path / 'default-back'}", *common)
  assert code == 0, err
  got = json.loads(out)
  code, out, err = _cli(capsys, f"checkpoint={run_dir}", *common)
  want = json.loads(out)
  assert got["step"] is None and want["step"] == 0
  assert got["tokens"] == want["tokens"] and np.isfinite(got["loss"])
