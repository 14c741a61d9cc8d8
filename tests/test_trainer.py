"""The trainer on real data (the embedded corpus: packing, eval): packed batches train like their
documents run alone, eval is token-weighted, the logged throughput is the count of the work done, and
TensorBoard holds exactly what metrics.jsonl holds. References are computed here, not by the trainer."""

import dataclasses
import gc
import json
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as R
from maxlm.cli.train import run
from maxlm.config import load_config
from maxlm.trainer import Trainer

BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]
# Tiny model on the embedded Austen corpus; fp32 compute so that packed/alone differ by rounding only.
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "model.ffn_dim=128", "model.dtype=float32", "model.remat=none", "data.seq_len=64",
         "data.global_batch_size=8", "optim.warmup_steps=2", "train.log_every=1"]


def make_trainer(tmp_path, backend, *extra):
  cfg = load_config([*SMALL, f"model.backend={backend}", f"output_dir={tmp_path}", *extra])
  tr = Trainer(cfg)
  tr.build()
  return tr


def alone_batches(batch, rows):
  """Every segment of a packed batch as its own row (positions from 0, segment id 1, padded)."""
  singles = []
  for r in range(batch["inputs"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in range(1, int(seg.max()) + 1):
      idx = np.flatnonzero(seg == s)
      one = {k: np.zeros_like(v[r]) for k, v in batch.items()}
      n = len(idx)
      one["inputs"][:n], one["targets"][:n] = batch["inputs"][r, idx], batch["targets"][r, idx]
      one["segment_ids"][:n], one["positions"][:n] = 1, np.arange(n)
      singles.append(one)
  while len(singles) % rows:
    singles.append({k: np.zeros_like(v) for k, v in singles[0].items()})
  for i in range(0, len(singles), rows):
    yield {k: np.stack([s[k] for s in singles[i:i + rows]]) for k in singles[0]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_train_like_documents_alone(tmp_path, backend):
  tr = make_trainer(tmp_path, backend, "train.steps=20")
  # O(1) activations (tests/reference.py): attention far from uniform, so that attending across a
  # document boundary moves the loss by ~2e-3 relative (at the 0.02-std init, even after 10 steps,
  # it moved it by ~1e-5 only, within the tolerance below: a trainer dropping `packed` passed).
  params = R.random_params(tr.state.params, seed=1, embed_std=0.5)
  tr.state = tr.state.replace(params=jax.device_put(params, tr.state_shardings.params))
  batch = next(tr.train_data)
  n_segments = [int(r.max()) for r in batch["segment_ids"]]
  assert max(n_segments) >= 2, f"the test needs a row with several documents, got {n_segments}"
  loss_sum = tokens = 0.0
  for b in alone_batches(batch, batch["inputs"].shape[0]):
    out = jax.device_get(tr.eval_step(tr.state, tr.to_device(b)))
    loss_sum, tokens = loss_sum + float(out["loss_sum"]), tokens + float(out["tokens"])
  assert tokens == float((batch["segment_ids"] > 0).sum())
  state_copy = jax.tree_util.tree_map(jnp.copy, tr.state)
  _, metrics = tr.train_step(state_copy, tr.to_device(batch))  # the loss is taken before the update
  # fp32: the two sums differ by reordering only (~1e-7 relative per add over ~500 tokens, so < 1e-5);
  # attention across document boundaries changes it by ~2e-3 relative here (seen: 3e-9 vs 2.2e-3).
  np.testing.assert_allclose(float(metrics["loss"]), loss_sum / tokens, rtol=1e-5)


def reference_eval_loss(tr):
  """Token-weighted NLL over the whole eval split, from logits and a log-softmax computed here."""
  nll_sum, count, per_batch = 0.0, 0, []
  apply = jax.jit(tr.model.apply)
  it = tr.eval_data_factory()
  for b in it:
    with tr.built.scope():
      logits = apply({"params": tr.state.params, **tr.state.model_state}, b["inputs"], b["positions"],
                     b["segment_ids"])
    logits = np.asarray(logits, np.float64)  # [B, T, V]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]  # [B, T]
    valid = b["segment_ids"] > 0
    nll_sum += float(nll[valid].sum())
    count += int(valid.sum())
    per_batch.append(int(valid.sum()))
  it.close()
  return nll_sum / count, per_batch


def test_eval_loss_is_token_weighted(tmp_path):
  tr = make_trainer(tmp_path, "flax", "data.global_batch_size=16")
  ref, per_batch = reference_eval_loss(tr)
  assert len(set(per_batch)) > 1, f"the eval batches must hold different token counts: {per_batch}"
  got = tr.evaluate()
  np.testing.assert_allclose(got["eval_loss"], ref, rtol=1e-5)  # fp32 logits vs float64 reference
  assert got["eval_perplexity"] == pytest.approx(math.exp(ref), rel=1e-5)


def independent_flops(m, batch, seq):
  """Training FLOPs of the tiny model, counted by hand: 3 passes x 2 FLOPs per multiply-add."""
  d, h, kv, dh, f, v, n = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim, m.vocab_size, m.n_layers
  tokens = batch * seq
  per_token_macs = n * (d * (h + 2 * kv) * dh + h * dh * d + 2 * d * f + f * d) + d * v
  attention_macs = n * batch * h * dh * 2 * (seq * seq / 2)  # QK^T and PV over the causal half (S^2/2)
  return 3 * 2 * (per_token_macs * tokens + attention_macs)


def test_logged_throughput_counts_every_step_and_tensorboard_matches(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  cfg = load_config([*SMALL, "model.backend=flax", f"output_dir={tmp_path}", "run_name=r", "train.steps=9",
                     "train.log_every=3", "train.eval_every=3", "train.eval_steps=2", "checkpoint.enabled=true", "checkpoint.every=6"])
  assert run(cfg) == 0
  rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [3, 6, 9]
  flops = independent_flops(cfg.model, 8, 64)
  for r in rows:  # float64 arithmetic on both sides: only rounding differs
    assert r["tflops_per_device"] * 1e12 * r["step_time"] * jax.device_count() == pytest.approx(flops, rel=1e-9)
    assert r["tokens_per_sec"] * r["step_time"] == pytest.approx(8 * 64, rel=1e-9)
  for a, b in zip(rows, rows[1:]):  # 3 steps (+ a save, + an eval) fit in the wall time between two rows
    assert 3 * b["step_time"] + b.get("save_s", 0.0) <= b["elapsed_s"] - a["elapsed_s"] + 1e-6
  assert [("save_s" in r) for r in rows] == [False, True, True]  # saves at step 6 and at the end
  assert rows[0]["first_step_s"] > 0 and "first_step_s" not in rows[1]
  acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
  acc.Reload()
  tags = set(acc.Tags()["scalars"])
  numeric = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
  assert numeric <= tags and "eval_loss" in tags and "loss" in tags
  for tag in numeric:
    want = {r["step"]: r[tag] for r in rows if isinstance(r.get(tag), (int, float))}
    got = {e.step: e.value for e in acc.Scalars(tag)}
    assert got.keys() == want.keys(), tag
    for s in want:  # TensorBoard stores float32
      assert got[s] == np.float32(want[s]), (tag, s)


def test_batch_that_does_not_split_over_the_devices_is_refused_up_front(tmp_path):
  from maxlm.config import ConfigError
  cfg = load_config([*SMALL, f"output_dir={tmp_path}", "data.global_batch_size=12"])
  with pytest.raises(ConfigError, match="not divisible by the 8 data-parallel devices"):
    Trainer(cfg)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch_size=16),
                            train=dataclasses.replace(cfg.train, grad_accum=4))
  with pytest.raises(ConfigError, match="micro-batches of 4 rows"):
    Trainer(cfg)


def test_finite_data_ends_the_run_with_a_last_save_and_log(tmp_path, capsys):
  docs = tmp_path / "docs.txt"
  words = "the of and to a in that it was her she not be his as for had you with".split()
  docs.write_text("\n".join(" ".join(words[(i + j) % len(words)] for j in range(20)) for i in range(40)) + "\n")
  args = [*SMALL, "model.backend=flax", f"output_dir={tmp_path}", "run_name=r", "data.type=text",
          f"data.paths={docs}", "data.eval_fraction=0", "data.num_epochs=1", "train.steps=1000",
          "train.log_every=1000", "checkpoint.enabled=true", "data.seq_len=32"]
  assert run(load_config(args)) == 0
  out = capsys.readouterr().out
  rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
  last = rows[-1]["step"]
  assert len(rows) == 1 and 1 < last < 1000  # logged once: at the step that took the last batch
  assert f"the training data ended after step {last} (data.num_epochs=1)" in out
  assert "precision=fp32) on" in out  # the start line: SMALL computes in float32 (precision bf16 quantizes nothing)
  # the data line names the file, its 40 documents, the tokenizer, and that nothing is held out for eval
  assert (f"maxlm: data: {docs}: 40 training documents; sentencepiece tokenizer " in out
          and "; no eval data (data.eval_fraction=0)\n" in out)
  assert "maxlm: warning: optim.warmup_steps" not in out  # SMALL's 2 warmup steps end within the run
  assert sorted(int(p.name) for p in (tmp_path / "r" / "checkpoints").iterdir()) == [last]
  # About one epoch of tokens went through: ~40 docs x 22 tokens (+BOS/EOS) in rows of 8 x 32.
  assert last == pytest.approx(40 * 22 / (8 * 32), abs=3)
  assert run(load_config(args)) == 0  # resumed after the end: nothing left to train
  assert "the training data ended (data.num_epochs=1) before step" in capsys.readouterr().out


def test_a_finished_run_leaves_no_data_threads_behind(tmp_path):
  """A run that returned has stopped its data pipeline's prefetch threads, in a process that goes on (a notebook,
  the README test). They stayed alive, reading ahead, until the garbage collector reached the trainer: 16 Grain
  threads through the next four README commands (measured); gc is held off here so that it cannot reach them."""
  def data_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("grain")}
  before = data_threads()
  gc.collect()
  gc.disable()
  try:
    cfg = load_config([*SMALL, "model.backend=flax", f"output_dir={tmp_path}", "run_name=r", "train.steps=2"])
    assert run(cfg) == 0
    deadline = time.monotonic() + 10  # a stopped prefetch thread ends once its pending read returns
    while (left := data_threads() - before) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not left, sorted(t.name for t in left)
  finally:
    gc.enable()


def test_a_run_that_ends_inside_its_warmup_says_so_at_start(tmp_path, capsys):
  """SMALL warms up over 2 steps; a 1-step run applies only the rate of count 0, which is 0."""
  cfg = load_config([*SMALL, "model.backend=flax", f"output_dir={tmp_path}", "run_name=r", "train.steps=1",
                     "checkpoint.enabled=false"])
  assert run(cfg) == 0
  out = capsys.readouterr().out
  assert ("\nmaxlm: warning: optim.warmup_steps=2 is not below train.steps=1: the learning rate ends at 0, 0.0% of "
          "optim.learning_rate=") in out
