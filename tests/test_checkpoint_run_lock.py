"""One run per directory at a time (`maxlm.checkpoint.run_lock`), with real processes: a lock held by another
process refuses in one line naming its host and pid; a holder killed with SIGKILL leaves a file but no lock, which
the next run takes over; a requeued SLURM job whose previous allocation still holds it says so; a release removes
the file. The lease: with the flock made per process (as a node-local flock behaves) a live holder's lease refuses
the second process; a lease of another host is live while renewed and taken over once stale, one of this host
whose process has exited at once; a requeued job waits for its previous allocation's lease to die; the holder
renews it and says when it was taken over. A record taken over from a dead holder is read back whole. End to end:
the same training command started twice on one directory, the second stops at start (exit 2, one line) while the
first trains on to its end untouched."""

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

import processes
from maxlm.checkpoint import run_lock
from maxlm.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
HOLDER = """
import sys, time
from pathlib import Path
from maxlm.checkpoint import run_lock
lock = run_lock.acquire(Path(sys.argv[1]), flock=sys.argv[2] == "flock")
print("HELD", flush=True)
time.sleep(600)
"""


def _holder(run_dir: Path, flock: bool = True, **env) -> subprocess.Popen:
  p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), "flock" if flock else "none"], cwd=ROOT,
                       stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
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


HOST = socket.gethostname()
TAIL = "; wait for it to end, or give this run its own run_name=..."


def _lease(run_dir: Path, host: str, pid: int, age_s: float, **extra) -> dict:
  """A lease as its holder writes it, renewed `age_s` ago."""
  record = {"host": host, "pid": pid, "job": "", "restart": 0, "since": "2026-01-02 03:04:05", "token": "t" * 32,
            "beat": time.time() - age_s, **extra}
  (run_dir / run_lock.LEASE).write_text(json.dumps(record) + "\n")
  return record


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_with_a_per_process_flock_the_lease_refuses_a_second_process(tmp_path, monkeypatch):
  """Both processes take the flock as if it were per node (Lustre's localflock, two nodes): the holder's lease
  refuses the second, in the one line naming it, and leaves the holder's files as they were."""
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  holder = _holder(tmp_path, flock=False)
  try:
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == [run_lock.LEASE, run_lock.LOCK]
    with pytest.raises(ConfigError) as e:
      run_lock.acquire(tmp_path, flock=False)
    assert re.fullmatch(rf"run directory {re.escape(str(tmp_path))} is in use by another run: process {holder.pid} "
                        rf"on host {re.escape(HOST)} since [\d-]+ [\d:]+, its lease renewed \d+ s ago \(it is taken "
                        rf"over once not renewed for 60 s\){re.escape(TAIL)}", str(e.value)), str(e.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
  finally:
    holder.kill()
    holder.wait()


def test_a_renewed_lease_of_another_host_refuses_and_a_stale_one_is_taken_over(tmp_path, capsys, monkeypatch):
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  lease = _lease(tmp_path, "node-b", 4321, age_s=run_lock.STALE_S - 20)  # 40 s: four beats missed, still live
  with pytest.raises(ConfigError, match=r"in use by another run: process 4321 on host node-b since 2026-01-02 "
                                        r"03:04:05, its lease renewed 40 s ago \(it is taken over once not renewed "
                                        r"for 60 s\);"):
    run_lock.acquire(tmp_path)
  assert json.loads((tmp_path / run_lock.LEASE).read_text()) == lease  # untouched
  assert not (tmp_path / run_lock.LOCK).read_text()  # the refused run wrote no record
  _lease(tmp_path, "node-b", 4321, age_s=run_lock.STALE_S + 1.5)
  capsys.readouterr()
  lock = run_lock.acquire(tmp_path)
  try:
    assert capsys.readouterr().out.splitlines() == [
        f"maxlm: warning: run directory {tmp_path}: taking over the lease of process 4321 on host node-b, not "
        f"renewed for 62 s (over 60 s)"]
    got = json.loads((tmp_path / run_lock.LEASE).read_text())
    assert (got["host"], got["pid"]) == (HOST, os.getpid()) and abs(got["beat"] - time.time()) < 5
  finally:
    lock.release()
  assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_lease_of_this_host_whose_process_exited_is_taken_over_at_once(tmp_path, capsys):
  pid = _dead_pid()
  _lease(tmp_path, HOST, pid, age_s=0)  # renewed just now, by a process that is gone (kill -9, then a requeue)
  lock = run_lock.acquire(tmp_path)
  try:
    assert capsys.readouterr().out.splitlines() == [
        f"maxlm: warning: run directory {tmp_path}: taking over the lease of process {pid} on host {HOST}, which "
        f"has exited"]
    assert json.loads((tmp_path / run_lock.LEASE).read_text())["pid"] == os.getpid()
  finally:
    lock.release()


def test_a_requeued_job_waits_for_its_previous_allocations_lease_to_die(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("SLURM_JOB_ID", "77")
  monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
  _lease(tmp_path, "node-b", 55, age_s=run_lock.STALE_S - 2, job="77", restart=0)  # dies in 2 s
  lock = run_lock.acquire(tmp_path)
  lock.release()
  out = capsys.readouterr().out.splitlines()
  assert out[0] == (f"maxlm: run directory {tmp_path}: waiting up to 70 s for the lease of this job's previous "
                    f"allocation (restart 0, process 55 on host node-b) to end")
  # it waited: the lease was 58 s old when the wait began and is taken over only once past the 60 s limit
  m = re.fullmatch(rf"maxlm: warning: run directory {re.escape(str(tmp_path))}: taking over the lease of "
                   rf"process 55 on host node-b, not renewed for (\d+) s \(over 60 s\)", out[1])
  assert m and len(out) == 2 and run_lock.STALE_S <= int(m[1]) < run_lock.STALE_S + 10, out
  _lease(tmp_path, "node-b", 55, age_s=0, job="78")  # another job's live lease: refused at once, no wait
  t0 = time.monotonic()
  with pytest.raises(ConfigError, match="in use by another run: process 55 on host node-b .SLURM job 78"):
    run_lock.acquire(tmp_path)
  assert time.monotonic() - t0 < 1.5


def test_the_holder_renews_its_lease_and_says_when_it_was_taken_over(tmp_path, capsys):
  lock = run_lock.acquire(tmp_path, beat_s=0.05)
  try:
    first = json.loads((tmp_path / run_lock.LEASE).read_text())["beat"]
    end = time.monotonic() + 30
    while json.loads((tmp_path / run_lock.LEASE).read_text())["beat"] == first:
      assert time.monotonic() < end
      time.sleep(0.02)
    _lease(tmp_path, "node-c", 99, age_s=0)  # taken over (as by a node that saw it stale)
    end = time.monotonic() + 30
    while not capsys.readouterr().out:
      assert time.monotonic() < end
      time.sleep(0.02)
  finally:
    lock.release()
  assert json.loads((tmp_path / run_lock.LEASE).read_text())["host"] == "node-c"  # not ours: not removed
  assert not (tmp_path / run_lock.LOCK).exists()


def test_the_holder_says_it_lost_its_lease_in_one_line(tmp_path, capsys):
  lock = run_lock.acquire(tmp_path, beat_s=0.05)
  _lease(tmp_path, "node-c", 99, age_s=0)
  time.sleep(0.5)  # ten beats: one line, then no more renewing
  lock.release()
  assert capsys.readouterr().out.splitlines() == [
      f"maxlm: warning: the lease of run directory {tmp_path} was taken over by process 99 on host node-c: two runs "
      f"now write into it"]
  assert json.loads((tmp_path / run_lock.LEASE).read_text())["host"] == "node-c"


def test_a_long_record_of_a_dead_holder_is_replaced_whole_and_read_back(tmp_path, monkeypatch):
  """Item 58.4a: a lock taken over from a dead holder whose record was longer than the new one; a refused second
  run reads back exactly the new holder, not a half-old JSON ("process ? on host ?")."""
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  old = {"host": "a-much-longer-host-name-" + "x" * 300, "pid": _dead_pid(), "job": "9" * 40, "restart": 7,
         "since": "2026-01-02 03:04:05"}
  (tmp_path / run_lock.LOCK).write_text(json.dumps(old) + "\n")  # no flock held: the kernel let it go
  lock = run_lock.acquire(tmp_path)
  try:
    record = json.loads((tmp_path / run_lock.LOCK).read_text())  # one JSON document, nothing after it
    assert (record["host"], record["pid"], record["job"]) == (HOST, os.getpid(), "")
    with pytest.raises(ConfigError) as e:
      run_lock.acquire(tmp_path)  # another open file: refused by the flock, which this process holds
    assert str(e.value) == (f"run directory {tmp_path} is in use by another run: process {os.getpid()} on host "
                            f"{HOST} since {record['since']}{TAIL}")
  finally:
    lock.release()


def test_both_processes_of_a_duplicate_run_end_with_the_one_line(tmp_path, monkeypatch):
  """Process 0 of a two-process run finds the directory held and refuses; the other process gets its answer (the
  coordination service's key-value store, no device collective) and ends with the same line and exit 2."""
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  run = tmp_path / "runs" / "r"
  run.mkdir(parents=True)
  holder = _holder(run)
  try:
    codes = processes.finish(processes.start(2, ["run_name=r", "train.steps=2", "data.global_batch_size=2"],
                                             tmp_path), 300)
    since = json.loads((run / run_lock.LOCK).read_text())["since"]
  finally:
    holder.kill()
    holder.wait()
  lines = [processes.output(tmp_path, i)[1].splitlines() for i in range(2)]
  assert codes == [2, 2], lines
  for i, err in enumerate(lines):
    assert err == [f"[process {i}/2 {HOST.split('.')[0]}] maxlm: error: run directory {run} is in use by another run: process "
                   f"{holder.pid} on host {HOST} since {since}{TAIL}"], err


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
