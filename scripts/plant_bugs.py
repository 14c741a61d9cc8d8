"""Plant each bug class of issue 15, one at a time, run the test whose purpose is that behaviour, restore.

It edits the tree it lives in, so it refuses to run in the main worktree: make a scratch one first.

  git worktree add --detach /tmp/plant HEAD
  /path/to/.venv/bin/python /tmp/plant/scripts/plant_bugs.py [INDEX ...]   (docs/mutation.md has the table)

Prints one line per (bug, test): FAILS (caught) or PASSES (missed); the tests' output goes to /tmp/plantlog/.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

P = str(Path(__file__).resolve().parents[1])
PY = sys.executable

def sub(path, old, new):
  def f():
    s = open(f"{P}/{path}").read()
    assert s.count(old) == 1, (path, old)
    open(f"{P}/{path}", "w").write(s.replace(old, new))
  return f

ACCUM_OLD = """      return (jax.tree_util.tree_map(jnp.add, grad_sum, g), new_state, loss_sum + loss, count + n), None"""
ACCUM_NEW = """      w = 1.0 / (jnp.maximum(n, 1.0) * grad_accum)  # PLANTED: mean of per-micro-batch means
      return (jax.tree_util.tree_map(lambda a, b: a + b * w, grad_sum, g), new_state, loss_sum + loss * w,
              count + n), None"""
ACCUM_OLD2 = """    count = jnp.maximum(count, 1.0)
    denom"""
ACCUM_NEW2 = """    count = jnp.maximum(count, 1.0)
    if grad_accum > 1:  # PLANTED: undo the division below
      grad_sum = jax.tree_util.tree_map(lambda x: x * count, grad_sum)
      loss_sum = loss_sum * count
    denom"""

BUGS = [
  ("last token dropped from the loss", "maxlm/step.py",
   [sub("maxlm/step.py", 'mask = batch["segment_ids"] > 0  # [B, T]',
        'mask = (batch["segment_ids"] > 0).at[:, -1].set(False)  # [B, T]')],
   ["tests/test_step.py::test_loss_counts_every_valid_token_including_the_last"]),
  ("RoPE not applied to keys", "maxlm/model.py",
   [sub("maxlm/model.py", "k = apply_rope(k, positions, inv_freq)  # [B, T, KV, Dh]", "k = k  # [B, T, KV, Dh]")],
   ["tests/test_model.py::test_transformer_matches_reference[gqa-flax]"]),
  ("rope_theta of a shipped config changed", "configs/llama8b.yml",
   [sub("configs/llama8b.yml", "rope_theta: 500000.0", "rope_theta: 10000.0")],
   ["tests/test_config.py::test_shipped_config_matches_published_config_json"]),
  ("element-wise instead of global-norm clipping", "maxlm/optim.py",
   [sub("maxlm/optim.py", "optax.clip_by_global_norm(cfg.clip_grad_norm)", "optax.clip(cfg.clip_grad_norm)")],
   ["tests/test_optim.py::test_clipping_is_by_global_norm"]),
  ("TFLOP/s counted as one step per logging interval", "maxlm/trainer.py",
   [sub("maxlm/trainer.py", "flops * steps_since, dt", "flops, dt")],
   ["tests/test_trainer.py::test_logged_throughput_counts_every_step_and_tensorboard_matches"]),
  ("trainer dropping the packed flag", "maxlm/trainer.py",
   [sub("maxlm/trainer.py", "self.packed = cfg.data.type != \"synthetic\"", "self.packed = False")],
   ["tests/test_trainer.py::test_packed_rows_train_like_documents_alone[flax]"]),
  ("accumulation averaging per-micro-batch means", "maxlm/step.py",
   [sub("maxlm/step.py", ACCUM_OLD, ACCUM_NEW), sub("maxlm/step.py", ACCUM_OLD2, ACCUM_NEW2)],
   ["tests/test_step.py::test_gradient_accumulation_equals_full_batch"]),
  ("TensorBoard scalars never written", "maxlm/metrics.py",
   [sub("maxlm/metrics.py", "          self._tb.add_scalar(k, v, step)", "          pass  # PLANTED")],
   ["tests/test_metrics.py::test_every_logged_step_reaches_tensorboard_within_seconds",
    "tests/test_trainer.py::test_logged_throughput_counts_every_step_and_tensorboard_matches"]),
  ("prepared data dtype too narrow for ids > 65,535", "maxlm/data/shards.py",
   [sub("maxlm/data/shards.py", 'return "uint16" if vocab_size <= 1 << 16 else "uint32"', 'return "uint16"')],
   ["tests/test_data_prepare.py::test_vocab_over_65535_round_trips_as_uint32"]),
]

def run(tests):
  env = dict(os.environ, PYTHONPATH=P)
  t = time.time()
  r = subprocess.run(["nice", "-n", "15", PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                     cwd=P, env=env, capture_output=True, text=True)
  return r.returncode, time.time() - t, r.stdout[-1500:]

def git(*a):
  return subprocess.run(["git", *a], cwd=P, capture_output=True, text=True).stdout.strip()


if git("rev-parse", "--git-dir") == git("rev-parse", "--git-common-dir"):
  sys.exit("plant_bugs: run me from a scratch worktree (git worktree add --detach /tmp/plant HEAD), not the main one")
os.makedirs("/tmp/plantlog", exist_ok=True)
only = sys.argv[1:]
for i, (name, path, edits, tests) in enumerate(BUGS):
  if only and str(i) not in only:
    continue
  for e in edits:
    e()
  diff = subprocess.run(["git", "diff", "--stat"], cwd=P, capture_output=True, text=True).stdout.strip()
  try:
    results = [(t, *run([t])) for t in tests]
  finally:
    subprocess.run(["git", "checkout", "--", path], cwd=P, check=True)
  for t, rc, dt, out in results:
    print(f"PLANTED [{name}] ({diff.splitlines()[0] if diff else '?'}) {t}: rc={rc} "
          f"{'FAILS (caught)' if rc == 1 else 'PASSES (missed)' if rc == 0 else 'ERROR'} {dt:.0f}s", flush=True)
    open(f"/tmp/plantlog/{i}.log", "a").write(f"{t}\n{out}\n")
