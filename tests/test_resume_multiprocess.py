"""Two training processes (jax.distributed on CPU): SIGTERM to one of them stops both at the same
step boundary with a checkpoint holding both processes' data-iterator states, and exit code 75; kill -9 of one
(a lost node) mid-step or mid-save ends the other with one line and exit 76 within the stated limit, and the rerun
resumes from the checkpoint before the kill with the losses of an uninterrupted run, bit for bit."""

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

from maxlm.checkpoint import EXIT_PREEMPTED, manager
from maxlm.runtime import peers
import processes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["model.backend=flax", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
        "model.head_dim=16", "model.ffn_dim=64", "model.n_layers=1", "model.remat=none",
        "data.type=synthetic", "data.seq_len=32", "data.global_batch_size=4", "mesh.dcn_data=2",
        "train.steps=200", "train.log_every=1", "checkpoint.enabled=true", "checkpoint.every=100",
        "run_name=r"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_sigterm_on_one_process_stops_all_at_the_same_step(tmp_path):
  addr = f"localhost:{_free_port()}"
  procs, logs = [], [tmp_path / f"p{i}.txt" for i in range(2)]
  for i, log in enumerate(logs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXLM_TEST_DISTRIBUTED": f"{addr},2,{i}",
           "MAXLM_TEST_STEP_SLEEP": "0.1"}
    # one device each; the other flags stay (conftest's fast CPU compile: half the compile time)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    with open(log, "w") as out:
      procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "resume_launcher.py"),
                                     f"output_dir={tmp_path}", *ARGS], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT))
  try:
    end = time.monotonic() + 180
    while "step 3/" not in logs[0].read_text():
      assert time.monotonic() < end and all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
      time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  texts = [log.read_text() for log in logs]
  assert codes == [EXIT_PREEMPTED] * 2, texts
  stopped = [int(t.split("SIGTERM at step ")[1].split(":")[0]) for t in texts]
  assert stopped[0] == stopped[1]
  ckpt = tmp_path / "r" / "checkpoints" / str(stopped[0])
  data = json.loads((ckpt / "data" / "metadata").read_text())
  assert data["process_count"] == 2 and data["batches"] == stopped[0] and sorted(data["rows"]) == ["0", "1", "2", "3"]


# --- a lost process (issue 58 item 3): kill -9 of process 1, mid-step and mid-save -------------------------------

# The survivor's line comes at most LOST_S + one poll after it read the lost process's last heartbeat, which was
# written before the kill and is read within one heartbeat: HEARTBEAT_S + LOST_S + POLL_S = 36 s after the kill (the
# module doc of maxlm/runtime/peers.py). The slack covers a loaded 2-core machine (an exchange, the judge's thread, the
# line written, the exit): 10 s.
LOST_LIMIT_S = peers.HEARTBEAT_S + peers.LOST_S + peers.POLL_S
SLACK_S = 10
LOSS_STEPS = 30
LOSS_ARGS = ["run_name=r", f"train.steps={LOSS_STEPS}", "train.log_every=1", "data.global_batch_size=4",
             "mesh.dcn_data=2", "checkpoint.enabled=true", "checkpoint.every=10"]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
  return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple[int, float]]:
  """The losses of the same 2-process run never interrupted."""
  tmp = tmp_path_factory.mktemp("uninterrupted")
  procs = processes.start(2, LOSS_ARGS, tmp, launcher=True)
  assert processes.finish(procs, 240) == [0, 0], processes.output(tmp, 0)
  return _losses(tmp / "runs" / "r")


def _kill_process_1_when(tmp_path: Path, env: list[dict], seen: tuple[int, str]) -> tuple[int, float]:
  """Start the run, SIGKILL process 1 once process `seen[0]`'s stdout holds `seen[1]`; process 0's exit code and how
  long after the kill it ended."""
  procs = processes.start(2, LOSS_ARGS, tmp_path, env, launcher=True)
  try:
    end = time.monotonic() + 180
    while seen[1] not in processes.output(tmp_path, seen[0])[0]:
      assert time.monotonic() < end and all(p.poll() is None for p in procs), processes.output(tmp_path, 0)
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    try:
      code = procs[0].wait(timeout=LOST_LIMIT_S + SLACK_S)
    except subprocess.TimeoutExpired:
      raise AssertionError(f"process 0 still runs {LOST_LIMIT_S + SLACK_S} s after process 1 was killed: "
                           f"{processes.output(tmp_path, 0)[1][-3000:]}") from None
    return code, time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()


def _one_line_naming_process_1(tmp_path: Path) -> str:
  out, err = processes.output(tmp_path, 0)
  both = out + err
  lines = [ln for ln in both.splitlines() if "maxlm: error" in ln]
  assert len(lines) == 1 and err.rstrip().endswith(lines[0]), (out[-2000:], err[-3000:])
  # no traceback, and nothing of JAX's C++ abort (a glog F line, a Check failure, SIGABRT)
  assert "Traceback" not in both and "Check failure" not in both and "Aborted" not in both, err[-3000:]
  assert not re.search(r"^(\[process 0/2 \S+\] )?F\d{4} ", both, flags=re.M), err[-3000:]
  # the phase of process 1's last heartbeat in parentheses: under load that can still be the start-up barrier
  # ("start-up: every process at the first step"), a phase whose name has a hyphen and a colon
  m = re.fullmatch(r"\[process 0/2 \S+\] maxlm: error: process 1/2 \(host \S+\) was lost: no heartbeat for ([\d.]+) s "
                   rf"\(limit {peers.LOST_S:g} s: 2 x 5 s heartbeat \+ 2 x 10 s key-value exchange\); its last was at "
                   r"step \d+ \([^()]+\); exiting with code 76 for the launcher to requeue the job, which resumes "
                   r"from the last checkpoint", lines[0])
  assert m and peers.LOST_S <= float(m[1]) < peers.LOST_S + peers.POLL_S + SLACK_S, lines[0]
  return lines[0]


def _requeued_resumes_bit_identical(tmp_path: Path, uninterrupted, resumed_from: int) -> None:
  """The same command again (what the template's requeue runs): it resumes from `resumed_from` and logs the losses
  of the uninterrupted run, bit for bit, one row per step."""
  rerun = tmp_path / "rerun"
  rerun.mkdir()
  (tmp_path / "runs").rename(rerun / "runs")  # processes.start puts output_dir under its tmp_path
  procs = processes.start(2, LOSS_ARGS, rerun, launcher=True)
  assert processes.finish(procs, 240) == [0, 0], processes.output(rerun, 0)
  assert f"maxlm: resumed from checkpoint step {resumed_from} " in processes.output(rerun, 0)[0]
  assert _losses(rerun / "runs" / "r") == uninterrupted
  assert [s for s, _ in uninterrupted] == list(range(1, LOSS_STEPS + 1))


def test_a_process_killed_mid_step_ends_the_other_with_one_line_and_76_then_the_rerun_resumes(tmp_path, uninterrupted):
  """kill -9 of process 1 while both train (steps slowed to 0.1 s): process 0's next collective fails at once
  (Gloo: connection reset by peer). Before: a traceback, then a 300 s wait in jax.distributed.shutdown and a C++
  abort (exit -6). Now: process 0 ends within LOST_S + a poll with one line naming process 1 and exit 76."""
  env = [{"MAXLM_TEST_STEP_SLEEP": "0.1"}] * 2
  code, took = _kill_process_1_when(tmp_path, env, (0, "step 15/"))
  assert code == 76 and took < LOST_LIMIT_S + SLACK_S, (code, took, processes.output(tmp_path, 0)[1][-3000:])
  _one_line_naming_process_1(tmp_path)
  assert manager.complete_steps(tmp_path / "runs" / "r" / "checkpoints") == [10]
  _requeued_resumes_bit_identical(tmp_path, uninterrupted, 10)


def test_a_process_killed_mid_save_leaves_the_checkpoint_before_it_and_the_rerun_resumes(tmp_path, uninterrupted):
  """kill -9 of process 1 while the asynchronous save of step 20 is in flight: every file written, the commit not
  yet made (process 0's save thread, which commits, sleeps 60 s there: MAXLM_TEST_SLOW_SAVE; Orbax calls that hook
  on process 0 only). Process 0 ends with the line and exit 76 (os._exit, its save thread still asleep); step 20 is
  not committed (an `orbax-checkpoint-tmp` directory at most, which the next start removes) and step 10 is what the
  rerun resumes. Before: process 0 printed a traceback and hung in its exit (the save thread, JAX's shutdown)."""
  env = [{"MAXLM_TEST_STEP_SLEEP": "0.1", "MAXLM_TEST_SLOW_SAVE": "60,20"}, {"MAXLM_TEST_STEP_SLEEP": "0.1"}]
  code, took = _kill_process_1_when(tmp_path, env, (0, "SAVE-COMMITTING 20"))
  assert code == 76 and took < LOST_LIMIT_S + SLACK_S, (code, took, processes.output(tmp_path, 0)[1][-3000:])
  _one_line_naming_process_1(tmp_path)
  ckpts = tmp_path / "runs" / "r" / "checkpoints"
  assert manager.complete_steps(ckpts) == [10], sorted(p.name for p in ckpts.iterdir())
  assert list(ckpts.glob("20.orbax-checkpoint-tmp*")), sorted(p.name for p in ckpts.iterdir())  # it was in flight
  _requeued_resumes_bit_identical(tmp_path, uninterrupted, 10)
  assert not list((tmp_path / "rerun" / "runs" / "r" / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
