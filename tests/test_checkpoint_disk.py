"""The checkpoint directory's disk (`maxlm.checkpoint.disk`): the steps a run saves at and the bytes its saves
take at their peak, by hand; and on a real small file system (a tmpfs mounted in a private mount namespace, so
nothing outside the test sees it): a run whose next save cannot fit stops at start in one line (exit 2) with
nothing created; one that would fill the disk within checkpoint.keep saves is warned at start, refused before the
save that does not fit (exit 3, one line), its previous checkpoint intact and loadable; a save that fails while
writing (a file-size limit, EFBIG as from a full disk) leaves the previous one loadable too."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from maxlm.checkpoint import Checkpointer, complete_steps
from maxlm.checkpoint.disk import check_start, free_bytes, human, peak_bytes, save_steps
from maxlm.config import load_config, to_dict
from maxlm.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
# a tiny model on the embedded corpus: 6.4 MB of state (the 8192-row embedding and LM head and their moments),
# so that Orbax's few kilobytes of metadata per checkpoint stay small beside it
RUN = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
       "model.n_layers=1", "model.remat=none", "model.backend=flax", "data.seq_len=16", "data.global_batch_size=4",
       "train.log_every=1", "train.eval_every=0", "checkpoint.every=2", "run_name=r"]


def test_the_steps_a_run_saves_at():
  assert save_steps(0, 10, 4) == [4, 8, 10]  # every 4th, and the last
  assert save_steps(0, 8, 4) == [4, 8]  # the last is a multiple: once
  assert save_steps(8, 10, 4) == [10]  # resumed at 8
  assert save_steps(0, 5, 0) == [5]  # checkpoint.every=0: the last only
  assert save_steps(5, 5, 2) == []  # nothing to train, nothing saved


def test_the_peak_of_a_runs_saves_by_hand():
  # 10 bytes a save, saves at 2, 4, 6, 8, keep 2: during a save the kept ones and the new one are on disk
  #   save 2: 10 during, 10 after; save 4: 20 during, 20 after; save 6: 30 during, 2 removed: 20 after; save 8: 30
  assert peak_bytes([], [2, 4, 6, 8], 10, keep=2, keep_period=0, free=25) == (30, 6)
  assert peak_bytes([], [2, 4, 6, 8], 10, keep=2, keep_period=0, free=30) == (30, None)
  assert peak_bytes([], [2, 4, 6, 8], 10, keep=0, keep_period=0, free=35) == (40, 8)  # keep=0 keeps all
  # keep 1, and every multiple of 4: save 2: 10 | 4: 20 during, 2 removed: 10 | 6: 20, 4 stays: 20 | 8: 30 during,
  # 6 removed: 20
  assert peak_bytes([], [2, 4, 6, 8], 10, keep=1, keep_period=4, free=100) == (30, None)
  # resumed with two checkpoints on disk (counted in today's usage), keep 2: the save at 4 adds 10 during, then
  # removes 1: 0 more after; the save at 6 adds 10 during, removes 2
  assert peak_bytes([1, 2], [4, 6], 10, keep=2, keep_period=0, free=9) == (10, 4)
  assert peak_bytes([1, 2], [4, 6], 10, keep=2, keep_period=0, free=10) == (10, None)


def test_the_start_check_counts_every_planned_save_past_checkpoint_keep(tmp_path):
  """check_start with more planned saves than checkpoint.keep: 6 saves of 0.4 x the free space each, the last 2 kept
  (keep=2): the first two fit (0.4, 0.8 of the free space), the third is written beside the two kept (1.2): the
  warning names step 3 and 3 x the size, by hand. A check that passed only the first `keep` saves, or keep_period
  for keep, would say nothing; one that ignored keep altogether would name the same step but a larger peak."""
  cfg = load_config([*RUN, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=2"])
  size = int(0.4 * free_bytes(tmp_path))  # the free space moves a little while the test runs: 0.4 leaves room
  line = check_start(cfg.checkpoint, cfg.train, str(tmp_path), tmp_path / "checkpoints", size, [])
  assert line == (f"output_dir={tmp_path}: this run's checkpoints take up to {human(3 * size)} more ({human(size)} "
                  f"each, checkpoint.keep=2 kept and one being written) and {tmp_path} has "
                  f"{line.split(' has ')[1].split(' free')[0]} free: the save of step 3 will fail; a smaller "
                  "checkpoint.keep, a larger checkpoint.every or another output_dir avoids that")
  # keep=1 leaves at most two at once (0.8): no warning
  one = load_config([*RUN, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=1"])
  assert check_start(one.checkpoint, one.train, str(tmp_path), tmp_path / "checkpoints", size, []) == ""


def _tmpfs_reason(tmp_path) -> str | None:
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', str(probe)],
                       capture_output=True, text=True, timeout=60)
  except FileNotFoundError:
    return "unshare is not installed"
  return None if r.returncode == 0 else f"unshare -m / mount -t tmpfs not permitted: {r.stderr.strip()}"


def _on_tmpfs(tmp_path, size: int, args: list[str], env: dict | None = None):
  """Run the trainer (tests/resume_launcher.py) with output_dir on a tmpfs of `size` bytes of its own; the tmpfs's
  content is copied to tmp_path/after once the run has ended. Returns the CompletedProcess."""
  mount, after = tmp_path / "mnt", tmp_path / "after"
  mount.mkdir()
  after.mkdir()
  script = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; m="$2"; a="$3"; shift 3; "$@"; rc=$?; ' \
           'cp -a "$m"/. "$a"/; exit $rc'
  e = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {}),
       "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  cmd = [sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={mount}", *RUN, *args]
  return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(size), str(mount), str(after), *cmd],
                        cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


def _target(args: list[str]):
  """The run's config and its state's abstract target, on this process's 8 devices (a batch that splits over
  them: the state does not depend on it)."""
  cfg = load_config([*RUN, *args, "data.global_batch_size=8"])
  t = Trainer(cfg)
  t.build(abstract=True)  # the trainer's own state target: ShapeDtypeStructs with shardings
  target = t.state
  return cfg, target


def _bytes(target) -> int:
  """The state's bytes, from its shapes and dtypes (the reference the disk check's sizes are compared with)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(target))


def _restored_step(run_dir: Path, args: list[str]) -> int:
  """Restore the run's latest checkpoint (every checksum checked) and return its step."""
  cfg, target = _target(args)
  ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
  try:
    return ckpt.restore_latest(target, to_dict(cfg)).step
  finally:
    ckpt.close()


def test_a_run_whose_next_save_cannot_fit_stops_at_start_with_nothing_created(tmp_path):
  why = _tmpfs_reason(tmp_path)
  if why:
    pytest.skip(why)
  r = _on_tmpfs(tmp_path, 2 * 2**20, ["train.steps=4"])  # 2 MiB: less than the state (6.4 MB)
  assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  [line] = r.stderr.splitlines()
  nbytes = _bytes(_target(["train.steps=4"])[1])
  m = re.fullmatch(r"maxlm: error: output_dir=(\S+): not enough disk space for a checkpoint: the next one \(step 2\) "
                   r"needs ([\d.]+) MiB \(the train state's arrays\) and (\S+) has ([\d.]+) MiB free; free space "
                   r"there, train in another output_dir=\.\.\., or set checkpoint\.enabled=false \(the run then keeps "
                   r"no weights\)", line)
  assert m and m[1] == str(tmp_path / "mnt") and m[3] == str(tmp_path / "mnt" / "r"), line
  assert float(m[2]) == round(nbytes / 2**20, 1) and float(m[4]) <= 2.0, line
  assert list((tmp_path / "after").iterdir()) == []  # nothing created on the tmpfs
  assert "step 1/4" not in r.stdout


def test_a_disk_that_fills_within_keep_saves_is_warned_then_the_save_refused_the_previous_intact(tmp_path):
  why = _tmpfs_reason(tmp_path)
  if why:
    pytest.skip(why)
  args = ["train.steps=4", "checkpoint.keep=3"]
  nbytes = _bytes(_target(args)[1])
  # The start check sizes the first save as the state's arrays (6.4 MB); Orbax compresses what it writes (the
  # moments of embedding rows no batch has touched are zeros), so the checkpoint of step 2 takes about 4.0 MB, and
  # the check before step 4 sizes that save as its footprint. A disk of 1/16 more than the state: the first save
  # fits; the second would need 4.0 MB beside the 4.0 MB of the first and the run's few files, in 6.8 MB.
  size = (nbytes * 17 // 16) // 4096 * 4096
  r = _on_tmpfs(tmp_path, size, args)
  assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  ckpt_dir = tmp_path / "mnt" / "r" / "checkpoints"
  warning = [line for line in r.stdout.splitlines() if line.startswith("maxlm: warning: output_dir=")]
  assert len(warning) == 1 and re.search(
      r"this run's checkpoints take up to ([\d.]+) MiB more \(([\d.]+) MiB each, checkpoint\.keep=3 kept and one "
      r"being written\) and \S+ has [\d.]+ MiB free: the save of step 4 will fail", warning[0]), warning
  assert "checkpoint step 2 written" in r.stdout and "step 3/4" in r.stdout and "step 4/4" not in r.stdout
  [line] = r.stderr.splitlines()  # one line, no traceback
  assert re.fullmatch(r"maxlm: error: not enough disk space to save checkpoint step 4 in " + re.escape(str(ckpt_dir))
                      + r": it needs about [\d.]+ MiB and \S+ has [\d.]+ MiB free; earlier checkpoints are intact "
                      r"\(latest: step 2 in " + re.escape(str(ckpt_dir)) + r"\); free space there .*", line), line
  copy = tmp_path / "after" / "r"
  assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["2"]  # nothing half-written beside it
  footprint = sum(f.stat().st_blocks * 512 for f in (copy / "checkpoints" / "2").rglob("*") if f.is_file())
  assert nbytes / 2 < footprint < nbytes, (footprint, nbytes)  # the assumption of the sizes above
  assert _restored_step(copy, args) == 2


def test_a_save_that_fails_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path):
  # the saves after step 2 hit a 64 KiB file-size limit (EFBIG, as a full disk would fail them), with the free
  # space check passed: the write itself fails
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXLM_TEST_FSIZE_AFTER": "2",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  args = ["train.steps=4"]
  r = subprocess.run([sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={tmp_path}", *RUN,
                      *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  ckpt_dir = tmp_path / "r" / "checkpoints"
  [line] = r.stderr.splitlines()
  assert line.startswith(f"maxlm: error: saving checkpoint step 4 to {ckpt_dir} failed: ") and line.endswith(
      f"earlier checkpoints are intact (latest: step 2 in {ckpt_dir})"), line
  assert complete_steps(ckpt_dir) == [2]
  assert _restored_step(tmp_path / "r", args) == 2
