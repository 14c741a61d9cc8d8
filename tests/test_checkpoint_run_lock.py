"""One run per directory at a time (`maxlm.checkpoint.run_lock`), with real processes: a lock held by another
process refuses in one line naming its host and pid; a holder killed with SIGKILL leaves a file but no lock, which
the next run takes over; a requeued SLURM job whose previous allocation still holds it says so; a release removes
the file. End to end: the same training command started twice on one directory, the second stops at start (exit
2, one line) while the first trains on to its end untouched."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxlm.checkpoint import run_lock
from maxlm.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
HOLDER = """
import sys, time
from pathlib import Path
from maxlm.checkpoint import run_lock
lock = run_lock.acquire(Path(sys.argv[1]))
print("HELD", flush=True)
time.sleep(600)
"""


def _holder(run_dir: Path, **env) -> subprocess.Popen:
  p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
  assert p.stdout.readline().strip() == "HELD"
  return p


def test_a_held_lock_refuses_names_its_holder_and_a_killed_holder_leaves_none(tmp_path, monkeypatch):
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  holder = _holder(tmp_path)
  try:
    with pytest.raises(ConfigError) as e:
      run_lock.acquire(tmp_path)
    assert re.fullmatch(rf"run directory {re.escape(str(tmp_path))} is in use by another run: process {holder.pid} "
                        rf"on host {re.escape(socket.gethostname())} since [\d-]+ [\d:]+; wait for it to end, or "
                        rf"give this run its own run_name=\.\.\.", str(e.value)), str(e.value)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  recorded = json.loads((tmp_path / run_lock.LOCK).read_text())
  assert recorded["pid"] == holder.pid  # the dead holder's file is still there ...
  lock = run_lock.acquire(tmp_path)  # ... but not its lock: the kernel let it go
  assert json.loads((tmp_path / run_lock.LOCK).read_text())["pid"] == os.getpid()
  lock.release()
  assert not (tmp_path / run_lock.LOCK).exists()


def test_a_requeued_job_whose_old_allocation_still_holds_the_lock_says_so(tmp_path, monkeypatch):
  holder = _holder(tmp_path, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
  try:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match=rf"is still held by this job's previous allocation: process {holder.pid} "
                                          rf"on host \S+ \(SLURM job 4242, restart 0\) since .*; SLURM requeued the "
                                          rf"job \(restart 1\) before its old processes ended"):
      run_lock.acquire(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job: the plain message
    with pytest.raises(ConfigError, match="is in use by another run: .*SLURM job 4242, restart 0"):
      run_lock.acquire(tmp_path)
  finally:
    holder.kill()
    holder.wait()


TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.remat=none", "model.backend=flax", "model.vocab_size=128", "data.type=synthetic",
        "data.seq_len=16", "data.global_batch_size=4", "train.log_every=1", "checkpoint.every=4", "run_name=r"]


def test_the_same_command_twice_the_second_stops_at_start_and_the_first_trains_on(tmp_path):
  # The first run waits before its second step until the gate file is removed: it is training (past step 1, its
  # lock and config.yml written) for as long as the second takes to start and be refused, however loaded the host
  # (this was a 1.5 s sleep after each of the 16 steps: 24 s of waiting, and a bound on the second's start-up).
  gate = tmp_path / "gate"
  gate.touch()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXLM_TEST_STEP_GATE": str(gate),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  env.pop("SLURM_JOB_ID", None)
  cmd = [sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={tmp_path}", *TINY,
         "train.steps=16"]
  out = tmp_path / "first.out"
  with open(out, "w") as o:
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=subprocess.PIPE, text=True)
  try:
    end = time.monotonic() + 300
    while "GATED" not in out.read_text():
      assert first.poll() is None and time.monotonic() < end, out.read_text()
      time.sleep(0.1)
    kept = ("config.yml", "run.lock")  # (the first's checkpoints, metrics and events go on changing)
    before = {name: (tmp_path / "r" / name).read_bytes() for name in kept}
    second = subprocess.run(cmd, cwd=ROOT, env={k: v for k, v in env.items() if k != "MAXLM_TEST_STEP_GATE"},
                            capture_output=True, text=True, timeout=300)  # ungated: were it let in, it would end
    assert second.returncode == 2, (second.returncode, second.stderr[-3000:])
    assert first.poll() is None, "the first run ended before the second one was refused"
    assert second.stderr.splitlines() == [
        f"maxlm: error: run directory {tmp_path / 'r'} is in use by another run: process {first.pid} on host "
        f"{socket.gethostname()} since {json.loads((tmp_path / 'r' / 'run.lock').read_text())['since']}; wait "
        f"for it to end, or give this run its own run_name=..."]
    assert "step 1/" not in second.stdout
    assert {name: (tmp_path / "r" / name).read_bytes() for name in kept} == before  # the first's, untouched
    gate.unlink()  # the first trains on
    assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
  finally:
    if first.poll() is None:
      first.kill()
      first.wait()
  rows = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
  assert rows == list(range(1, 17))
  assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["12", "16", "8"]
  assert not (tmp_path / "r" / "run.lock").exists()  # released at the end
