"""Checkpointing inside training: `maxlm.train.main` in-process (8 simulated CPU devices) with
train.nonfinite=skip|stop around checkpoints, FP8 delayed-scaling state carried exactly; and the CLI
in a subprocess whose checkpoints directory is read-only (private mount namespace): exit 3, one line,
within seconds."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from resume_launcher import compile_cache, poisoned_losses

from maxlm import step as step_lib
from maxlm.build import build_step
from maxlm.checkpoint import Checkpointer, abstract_like, complete_steps
from maxlm.cli.train import main
from maxlm.config import load_config, to_dict
from maxlm.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
         "model.n_layers=1", "model.vocab_size=128", "model.remat=none", "data.type=synthetic",
         "data.seq_len=16", "data.global_batch_size=8", "optim.warmup_steps=0", "train.log_every=1",
         "checkpoint.enabled=true", "model.backend=flax"]


@pytest.fixture(scope="module", autouse=True)
def _shared_compilations(tmp_path_factory):
  """The runs below compile the same programs: compile each once."""
  with compile_cache(tmp_path_factory.mktemp("xla-cache")):
    yield


def _args(tmp_path, *extra):
  return SMALL + [f"output_dir={tmp_path}", "run_name=r", *extra]


def _leaves(state) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _rows(run_dir):
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _restore(run_dir, args):
  cfg = load_config(args)
  t = Trainer(cfg)
  target = build_step(cfg, t.mesh, abstract=True).state  # in the model's scope: TE layers need its mesh resource
  ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
  try:
    return ckpt.restore_latest(target, to_dict(cfg))
  finally:
    ckpt.close()


def test_nonfinite_skip_counts_and_checkpoints_stay_finite(tmp_path, monkeypatch):
  args = _args(tmp_path, "train.steps=8", "checkpoint.every=2")
  monkeypatch.setattr(step_lib, "token_losses", poisoned_losses(load_config(args), [3]))
  assert main(args) == 0
  rows = _rows(tmp_path / "r")
  assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
  assert rows[2]["loss"] == "nan" and all(np.isfinite(r["loss"]) for i, r in enumerate(rows) if i != 2)
  assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["4", "6", "8"]  # keep=3
  r = _restore(tmp_path / "r", args)  # verifies every checksum
  assert r.step == 8 and int(r.state.nonfinite_steps) == 1


@pytest.mark.parametrize("log_every,where", [(1, "at step 3 (loss=nan"), (5, "between steps 3 and 4")])
def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys, log_every, where):
  args = _args(tmp_path, "train.steps=8", "checkpoint.every=2", "train.nonfinite=stop",
               f"train.log_every={log_every}")
  monkeypatch.setattr(step_lib, "token_losses", poisoned_losses(load_config(args), [3]))
  assert main(args) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and where in err[0], err
  assert f"the last good checkpoint is step 2 in {tmp_path / 'r' / 'checkpoints'}" in err[0]
  assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["2"]


def test_a_resume_with_another_batch_size_stops_and_says_how_to_go_on(tmp_path, capsys):
  """The data position is kept per row of the global batch, so a resume with another batch size cannot carry
  it: one line, exit 3, naming the checkpoint as the new run's starting weights; that run then starts."""
  assert main(_args(tmp_path, "train.steps=2")) == 0
  capsys.readouterr()
  step2 = tmp_path / "r" / "checkpoints" / "2"
  assert main(_args(tmp_path, "train.steps=3", "data.global_batch_size=16")) == 3
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "checkpoint step 2: the data-iterator state does not fit this data config" in err[0], err
  assert err[0].endswith(f"start a new run from its weights: run_name=... checkpoint.load_params={step2}")
  assert main(_args(tmp_path, "train.steps=1", "data.global_batch_size=16", "run_name=r2",
                    f"checkpoint.load_params={step2}")) == 0
  assert f"loaded parameters from {step2}" in capsys.readouterr().out


@pytest.mark.te
def test_fp8_delayed_scaling_state_survives_a_checkpoint(tmp_path, fake_fp8_gpu):
  """Save after 3 steps, train 3 more; restore the checkpoint and train the same 3 batches again:
  losses and every array (params, Adam moments, amax histories, scales, RNG) are bit-identical."""
  cfg = load_config(_args(tmp_path, "model.backend=te", "model.precision=fp8_delayed",
                          "model.fp8_amax_history_len=4"))
  t = Trainer(cfg)
  t.build()
  batches = [t.to_device(next(t.train_data)) for _ in range(6)]
  for b in batches[:3]:
    t.state, _ = t.train_step(t.state, b)
  ckpt = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint)
  ckpt.save(3, t.state, t.train_data.get_state(), to_dict(cfg))
  target = abstract_like(t.state, t.state_shardings)
  losses = []
  for b in batches[3:]:
    t.state, m = t.train_step(t.state, b)
    losses.append(float(m["loss"]))
  want = _leaves(t.state)
  r = ckpt.restore_latest(target, to_dict(cfg))
  ckpt.close()
  metas = r.state.model_state["fp8_metas"]["layers"]["qkv"]
  hist = np.asarray(metas["x_amax_history"])  # [L, 4]: the amaxes of steps 1-3, newest last
  assert r.step == 3 and (hist != 0).sum() == 3 and np.all(np.asarray(metas["x_scale"]) != 1.0)
  state, again = r.state, []
  for b in batches[3:]:
    state, m = t.train_step(state, b)
    again.append(float(m["loss"]))
  assert again == losses
  got = _leaves(state)
  assert got.keys() == want.keys() and any("amax_history" in k for k in got)
  for k in want:
    assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


# After its first progress line a run below has at most 3 steps of a 1-layer model left (milliseconds
# each), one failing save (0.1-0.7 s measured) and its shutdown (~1 s measured): 20 s leaves room for a
# loaded 2-core host and stays far below Orbax's 60 s thread joins and 300 s waits that made it hang.
FAIL_WITHIN_S = 20.0


def _readonly_mounts_reason(tmp_path) -> str | None:
  """Why a read-only bind mount in a private mount namespace cannot be used here (None: it can)."""
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    script = 'mount --bind -o ro "$0" "$0" && ! touch "$0/x" 2>/dev/null'
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, str(probe)], capture_output=True, text=True,
                       timeout=60)
  except FileNotFoundError:
    return "unshare is not installed"
  return None if r.returncode == 0 else f"unshare -m / mount --bind -o ro not permitted: {r.stderr.strip()}"


def _cli_in_namespace(tmp_path, name: str, ckpt_dir: Path, readonly: bool, cmd: list[str], env: dict):
  """Run `cmd` under `unshare -m` with `ckpt_dir` bind-mounted onto itself (read-only or not): returns
  (exit code, stderr lines, seconds from its first progress line to its exit; None if it hung)."""
  out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
  mount = f'mount --bind {"-o ro " if readonly else ""}"$0" "$0" && exec "$@"'
  with open(out, "w") as o, open(err, "w") as e:
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", mount, str(ckpt_dir), *cmd], cwd=ROOT, env=env,
                            stdout=o, stderr=e)
  try:
    end = time.monotonic() + 300
    while not re.search(r"^step \d+/", out.read_text(), re.M):
      assert proc.poll() is None, f"exited ({proc.returncode}):\n{out.read_text()}{err.read_text()}"
      assert time.monotonic() < end, out.read_text()
      time.sleep(0.05)
    t0 = time.monotonic()
    try:
      rc = proc.wait(timeout=FAIL_WITHIN_S)
      took = time.monotonic() - t0
    except subprocess.TimeoutExpired:
      rc, took = None, None
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return rc, err.read_text().splitlines(), took


def test_readonly_checkpoints_fail_fast_in_one_line(tmp_path, tmp_path_factory):
  """A save into a read-only checkpoints directory ends the run with exit 3 and one line naming the
  directory within seconds: (1) the directory turns read-only mid-run (the save after step 2);
  (2) a resumed run whose checkpoints directory is read-only from the start."""
  why = _readonly_mounts_reason(tmp_path)
  if why:
    pytest.skip(why)
  run_dir, ckpt_dir = tmp_path / "r", tmp_path / "r" / "checkpoints"
  ckpt_dir.mkdir(parents=True)
  cache = tmp_path_factory.mktemp("xla-cache-cli")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  # one device; the other flags stay (conftest's fast CPU compile: half the compile time)
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  args = _args(tmp_path, "train.steps=6", "checkpoint.every=2")
  cases = [("mid-run", False, [sys.executable, str(ROOT / "tests" / "resume_launcher.py"), *args,
                               "checkpoint.async_save=false"], {"MAXLM_TEST_READONLY_AFTER": "2"}),
           ("from-start", True, [sys.executable, "-m", "maxlm.train", *args], {})]
  for name, readonly, cmd, extra in cases:
    rc, err, took = _cli_in_namespace(tmp_path, name, ckpt_dir, readonly, cmd, {**env, **extra})
    assert took is not None, f"{name}: still running {FAIL_WITHIN_S} s after its first step: {err}"
    assert rc == 3, (name, rc, err)
    assert len(err) == 1 and err[0].startswith("maxlm: error: saving checkpoint step 4 "), (name, err)
    assert f"to {ckpt_dir} failed: " in err[0] and "Read-only file system" in err[0], (name, err)
    assert f"earlier checkpoints are intact (latest: step 2 in {ckpt_dir})" in err[0], (name, err)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["2"], name
  assert "resumed from checkpoint step 2" in (tmp_path / "from-start.out").read_text()
  assert complete_steps(ckpt_dir) == [2] and (run_dir / "metrics.jsonl").exists()
