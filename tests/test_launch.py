"""The launch/ templates against a real SLURM (two nodes, both this machine) and OpenMPI here (CPU, tiny model):

1   `sbatch` of launch/slurm/train.sbatch with 2 tasks gives the losses of a one-process run on 2 devices,
    in exactly one metrics.jsonl;
1b  2 tasks x 2 devices with mesh.dcn_data=2: the dcn axis spans the processes, the ici axes stay inside
    one, and the losses are those of a one-process run on 4 devices;
2   `scancel --signal=TERM` mid-run: both tasks save at the same step and exit 75, the template requeues,
    the job resumes and ends with the loss and parameters of the uninterrupted run of test 1, bit for bit;
3   launch/mpi/train.sh (mpirun -np 2) gives the numbers of test 1;
4   python started in the batch shell of a 2-task job (no srun) stops with one line;
5   hangs: one task SIGSTOPped mid-run, then (after the requeue) one task's data read blocking: each time the
    other process ends with the hang watchdog's line (exit 76), not JAX's abort, the template requeues, and
    the third start ends with the loss and parameters of test 1's run, bit for bit;
5b  a lost node: one task killed (kill -9) mid-run, the other ends with one line naming it and exit 76 within srun's
    wait, the template requeues, the job resumes bit-identically;
6   a job that hangs at every start is requeued MAXLM_MAX_RESTARTS times, then stops with exit code 76;
7   2 nodes x 1 task with plan.mode=fit taking its GPU path (the test switch MAXLM_TEST_GPU_PATHS, exported
    through sbatch and srun): process 0 decides the plan, both processes run it and train every step.
(The other fail-fast cases need no launcher: tests/test_runtime_distributed.py.)

`scripts/ci_services.sh start` installs and starts SLURM and OpenMPI (CI runs it, see .ci/run); without
them these tests skip saying so. All runs of one program share JAX's persistent compilation cache (it
holds compiled executables, so numbers do not change), which keeps the time these tests add down.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from maxlm.runtime import peers

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
MPI = ROOT / "launch" / "mpi" / "train.sh"
STEPS = 20
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.remat=none", "model.backend=flax", "model.vocab_size=128",
        "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=4", f"train.steps={STEPS}",
        "train.log_every=1", "train.eval_every=0", "run_name=r"]
TWO_PROCESSES = ["mesh.dcn_fsdp=2"]  # 2 processes x 1 device: fsdp over both, as the 2-device run has it
SAVED = ["checkpoint.enabled=true"]  # test 2 compares the final parameters with those of test 1's run
ON_2 = ["mesh.fsdp=2"]
TWO_BY_TWO = ["mesh.dcn_data=2", "mesh.fsdp=2"]  # 2 processes x 2 devices: data across, fsdp inside
ON_4 = ["mesh.data=2", "mesh.fsdp=2"]
START = "run scripts/ci_services.sh start"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("launch")]  # one worker: the runs are shared


def _slurm_missing() -> str | None:
  if not shutil.which("sbatch"):
    return f"SLURM is not installed here ({START})"
  sinfo = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
  state = sinfo.stdout.split()
  if not {"idle", "mixed", "allocated"} & set(state):
    return f"no SLURM node is up here (sinfo: {state or 'no answer'}; {START})"
  return None


slurm = pytest.mark.slurm
mpi = pytest.mark.mpi


# XLA's CPU backend at optimization level 0 compiles this model in half the time (measured: 8.5 s instead
# of 15.9 s CPU per process); every run here uses it, so each comparison is between the same programs
# (the 20-step loss of this setup was 4.8785 at both levels).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def _env(devices: int, cache: Path, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # JAX warns about proxies at start
  flags = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
  env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
              "MAXLM_PYTHON": sys.executable, "JAX_COMPILATION_CACHE_DIR": str(cache),
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **extra})
  return env


def _rows(run_dir: Path) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _params(step_dir: Path) -> dict:
  """The saved parameters as numpy arrays, restored with plain Orbax onto one device (as
  docs/checkpoint_format.md describes), keyed by their path."""
  import jax
  import orbax.checkpoint as ocp
  from jax.sharding import SingleDeviceSharding
  meta = json.loads((step_dir / "meta" / "metadata").read_text())
  one = SingleDeviceSharding(jax.devices()[0])
  target = {}
  for path, (shape, dtype, _) in meta["arrays"].items():
    if path.startswith(".params["):
      node = target
      keys = re.findall(r"\['([^']*)'\]", path)
      for k in keys[:-1]:
        node = node.setdefault(k, {})
      node[keys[-1]] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=one)
  restored = ocp.StandardCheckpointer().restore(step_dir / "params", target)
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(restored)}


class Job:
  """A batch job: its id and output file; `wait()` for a state. `Job.of_template` submits the real
  template (run directory `out_dir/r`)."""

  def __init__(self, cmd: list[str], env: dict, log: Path):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    self.id, self.log = r.stdout.strip().split(";")[0], log

  @classmethod
  def of_template(cls, out_dir: Path, args: list[str], env: dict, tasks: int = 2, nodes: int = 1) -> "Job":
    out_dir.mkdir(parents=True, exist_ok=True)
    # The CPU cluster has no GPUs: ask for none; `tasks` per node (both on one node unless `nodes` says otherwise);
    # let jobs share the nodes.
    log = out_dir / "job.out"
    job = cls(["sbatch", "--parsable", "--oversubscribe", "--gpus-per-node=0", f"--nodes={nodes}",
               f"--ntasks-per-node={tasks}", f"--output={log}", "--job-name=maxlm-test", f"--chdir={ROOT}",
               str(SBATCH), f"output_dir={out_dir}", *TINY, *args], env, log)
    job.out_dir, job.run_dir = out_dir, out_dir / "r"
    return job

  def info(self) -> dict:
    r = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

  def wait(self, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
           timeout=240) -> dict:
    end = time.monotonic() + timeout
    while True:
      info = self.info()
      if info.get("JobState") in states:
        return info
      if time.monotonic() > end:
        subprocess.run(["scancel", self.id], timeout=30)
        pytest.fail(f"job {self.id} still {info.get('JobState')} after {timeout} s:\n{self.output()[-3000:]}")
      time.sleep(0.3)

  def output(self) -> str:
    return self.log.read_text() if self.log.exists() else ""


def _one_process(out_dir: Path, args: list[str], devices: int, cache: Path) -> Path:
  r = subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={out_dir}", *TINY, *args], cwd=ROOT,
                     env=_env(devices, cache), capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return out_dir / "r"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Runs shared by the tests, made on first use: `runs.get(name)`."""
  root = tmp_path_factory.mktemp("launch")
  cache = root / "jax-cache"
  made = {}

  def slurm_job(name, args, devices=1):
    job = Job.of_template(root / name, args, _env(devices, cache))
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job.output()[-3000:])
    return job

  def mpi_run():
    out = root / "mpi"
    env = _env(1, cache, MAXLM_NP="2", MAXLM_MPIRUN_ARGS="--allow-run-as-root --oversubscribe")
    r = subprocess.run([str(MPI), f"output_dir={out}", *TINY, *TWO_PROCESSES], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return out / "r", r.stdout

  recipes = {
      "on_2": lambda: _one_process(root / "on_2", ON_2, 2, cache),
      "on_4": lambda: _one_process(root / "on_4", ON_4, 4, cache),
      "sbatch_2": lambda: slurm_job("sbatch_2", [*TWO_PROCESSES, *SAVED]),
      "sbatch_2x2": lambda: slurm_job("sbatch_2x2", TWO_BY_TWO, devices=2),
      "mpi_2": mpi_run,
  }

  class Runs:
    root_dir = root
    cache_dir = cache

    @staticmethod
    def get(name):
      if name not in made:
        made[name] = recipes[name]()
      return made[name]

  return Runs


# Reduction order. Both runs compute the same global batches on the same mesh shape; what can differ is
# only the order in which cross-device sums are added. With 2 devices every such sum has two terms and
# a + b == b + a exactly in IEEE arithmetic: there is no order to differ, so the losses must be equal
# bit for bit (tolerance 0). With 4 devices a sum of 4 partial results can be grouped differently,
# ((a+b)+(c+d)) vs (((a+b)+c)+d): 3 float32 roundings of at most 2**-24 relative each, so the same
# parameters give losses at most 6 * 2**-24 apart; the gradients are regrouped too and the parameters
# drift apart over the steps, for which 4x that is allowed: rtol = 24 * 2**-24 = 1.4e-6. Seen here
# over 20 steps: at most 2.0e-7 (two float32 ulps of the loss), while the losses of different batches
# (successive steps) differ by 1e-2 here.
EXACT = 0.0
FOUR_WAY_RTOL = 24 * 2**-24


def _same_losses(got_dir: Path, want_dir: Path, rtol: float) -> None:
  got, want = _rows(got_dir), _rows(want_dir)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "one row per step, none duplicated or missing"
  assert [r["step"] for r in want] == list(range(1, STEPS + 1))
  g, w = np.array([r["loss"] for r in got]), np.array([r["loss"] for r in want])
  if rtol == EXACT:
    assert g.tolist() == w.tolist(), np.abs(g - w).max()
  else:
    np.testing.assert_allclose(g, w, rtol=rtol, atol=0)


def _same_as_uninterrupted(job, runs) -> None:
  """The job's losses and final parameters equal, bit for bit, those of the same 2-task run never interrupted."""
  straight = runs.get("sbatch_2")
  _same_losses(job.run_dir, straight.run_dir, EXACT)
  got = _params(job.run_dir / "checkpoints" / str(STEPS))
  want = _params(straight.run_dir / "checkpoints" / str(STEPS))
  assert got.keys() == want.keys() and got
  for k in want:
    assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


@slurm
def test_sbatch_two_tasks_give_the_losses_of_one_process(runs):
  if (why := _slurm_missing()):
    pytest.skip(why)
  job = runs.get("sbatch_2")
  out = job.output()
  assert out.count("maxlm-launch: job") == 2 and "start 1 (restart count 0)" in out
  assert "finished with exit code 0" in out
  # process 0 alone writes the metrics and TensorBoard events (into the shared output_dir)
  assert len(list(job.out_dir.rglob("metrics.jsonl"))) == 1
  assert len(list((job.run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
  _same_losses(job.run_dir, runs.get("on_2"), EXACT)
  progress = [line for line in out.splitlines() if re.search(r"\bstep \d+/\d+ \|", line)]
  assert len(progress) == STEPS and all(line.startswith("[process 0/2 ") for line in progress)


@slurm
def test_sbatch_two_by_two_devices_dcn_across_processes_ici_inside(runs):
  if (why := _slurm_missing()):
    pytest.skip(why)
  job = runs.get("sbatch_2x2")
  line = next(x for x in job.output().splitlines() if "mesh over 2 processes" in x)
  # mesh axes (pipeline, data, fsdp, expert, context, tensor) = (1, 2, 2, 1, 1, 1): data is the dcn axis (one
  # process per data index), fsdp, expert, context and tensor stay inside a process
  assert "processes along each axis: pipeline 1, data 2, fsdp 1, expert 1, context 1, tensor 1" in line, line
  placement = json.loads(line.split("process of each device by mesh position: ")[1])
  assert placement == [[[[[[0]]], [[[0]]]], [[[[1]]], [[[1]]]]]], line
  _same_losses(job.run_dir, runs.get("on_4"), FOUR_WAY_RTOL)


@slurm
def test_sbatch_preempted_requeued_resumed_bit_identical(runs, tmp_path):
  if (why := _slurm_missing()):
    pytest.skip(why)
  # A Python for the template that runs the trainer through tests/resume_launcher.py, which sleeps
  # after each step (MAXLM_TEST_STEP_SLEEP) so that the signal lands mid-run; the requeued start has no
  # signal to wait for and runs at full speed (15 steps x 0.25 s less).
  shim = tmp_path / "python-slow-steps"
  shim.write_text(f"#!/bin/sh\n# called as: $0 -m maxlm.train ARGS\nshift 2\n"
                  "[ \"${SLURM_RESTART_COUNT:-0}\" = 0 ] || unset MAXLM_TEST_STEP_SLEEP\n"
                  f"exec {sys.executable} {ROOT / 'tests' / 'resume_launcher.py'} \"$@\"\n")
  shim.chmod(0o755)
  env = _env(1, runs.cache_dir, MAXLM_PYTHON=str(shim), MAXLM_TEST_STEP_SLEEP="0.25")
  job = Job.of_template(tmp_path / "job", [*TWO_PROCESSES, *SAVED], env)
  end = time.monotonic() + 180
  while not re.search(r"step [3-9]/20 \|", job.output()):
    alive = job.info().get("JobState") in ("PENDING", "RUNNING")
    assert time.monotonic() < end and alive, job.output()[-3000:]
    time.sleep(0.2)
  subprocess.run(["scancel", "--signal=TERM", job.id], check=True, timeout=30)  # every task, not the shell
  # The template requeues: the job waits (Reason=BeginTime, about 120 s) unless told to start now.
  info = job.wait(states=("PENDING", "COMPLETED", "FAILED", "CANCELLED"), timeout=120)
  assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, job.output()[-3000:])
  # slurmd refuses to start a job again within the second its previous run was killed in (credential
  # times have 1 s resolution: "Killing non-startable batch JobId=N: Job credential revoked" was seen here)
  time.sleep(2)
  subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], check=True, timeout=30)
  info = job.wait()
  out = job.output()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])

  stops = re.findall(r"\[process (\d)/2 [^\]]+\] maxlm: SIGTERM at step (\d+): checkpoint step \2 saved", out)
  assert sorted(p for p, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], out[-3000:]
  stopped = int(stops[0][1])
  assert 3 <= stopped < STEPS
  assert "preempted (exit 75)" in out and "start 2 (restart count 1)" in out
  assert f"maxlm: resumed from checkpoint step {stopped}" in out
  # the restart loads its train step from the persistent compilation cache the first start wrote (process 0
  # prints the line; the template keeps the job's JAX_COMPILATION_CACHE_DIR)
  restart = out.split("start 2 (restart count 1)", 1)[1]
  assert re.search(r"\[process 0/2 [^\]]+\] maxlm: compilation cache: the train step came from the cache \(hit",
                   restart), restart[-3000:]
  assert out.rstrip().splitlines()[-1].startswith(f"maxlm-launch: job {job.id} finished with exit code 0")

  assert len(list(job.out_dir.rglob("metrics.jsonl"))) == 1
  _same_as_uninterrupted(job, runs)


@mpi
def test_mpirun_two_processes_give_the_losses_of_one_process(runs):
  if not shutil.which("mpirun"):
    pytest.skip(f"OpenMPI is not installed here ({START})")
  run_dir, stdout = runs.get("mpi_2")
  assert len(list(run_dir.parent.rglob("metrics.jsonl"))) == 1
  _same_losses(run_dir, runs.get("on_2"), EXACT)
  assert "mesh over 2 processes" in stdout


@slurm
def test_python_in_the_batch_shell_without_srun_stops_with_one_line(runs, tmp_path):
  if (why := _slurm_missing()):
    pytest.skip(why)
  err = tmp_path / "job.err"
  train = f"{sys.executable} -m maxlm.train output_dir={tmp_path / 'runs'} {' '.join(TINY)}"
  out = tmp_path / "job.out"
  job = Job(["sbatch", "--parsable", "--oversubscribe", "--ntasks=2", f"--output={out}", f"--error={err}",
             f"--chdir={ROOT}", "--wrap", train], _env(1, runs.cache_dir), out)
  info = job.wait(timeout=60)  # fails the test if the job has not ended within 60 s
  lines = err.read_text().splitlines()
  assert info["ExitCode"] == "2:0" and len(lines) == 1, (info, lines)
  assert lines[0].startswith(f"maxlm: error: distributed: started in the batch shell of SLURM job {job.id} "
                             "(2 tasks) without srun"), lines
  assert not (tmp_path / "runs").exists()


def _requeued_then_started(job: Job, restarts: int, timeout: float) -> None:
  """Wait until `job` is pending after its `restarts`-th requeue, then start it at once (the requeue delay
  is about 120 s otherwise)."""
  end = time.monotonic() + timeout
  while True:
    info = job.info()
    if info.get("JobState") == "PENDING" and info.get("Restarts") == str(restarts):
      break
    ended = info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")
    if ended or time.monotonic() > end:
      subprocess.run(["scancel", job.id], timeout=30)
      pytest.fail(f"job {job.id} not requeued a {restarts}. time ({info.get('JobState')}, restarts "
                  f"{info.get('Restarts')}):\n{job.output()[-3000:]}")
    time.sleep(0.3)
  time.sleep(2)  # slurmd refuses a restart within the second of the requeue (see the preemption test)
  subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], check=True, timeout=30)


def _python_shim(shim: Path, pids: Path, per_start: str) -> Path:
  """The template's Python for a test: it records each task's pid (exec keeps it) in `pids`, runs the shell lines
  `per_start` (which pick each start's test hooks by SLURM_RESTART_COUNT), and execs tests/resume_launcher.py."""
  shim.write_text(f"#!/bin/sh\n# called as: $0 -m maxlm.train ARGS\nshift 2\n"
                  f"echo $$ > {pids}/start${{SLURM_RESTART_COUNT:-0}}-task$SLURM_PROCID\n" + per_start
                  + f"exec {sys.executable} {ROOT / 'tests' / 'resume_launcher.py'} \"$@\"\n")
  shim.chmod(0o755)
  return shim


@slurm
def test_sbatch_hangs_end_with_the_watchdog_requeue_and_resume_bit_identical(runs, tmp_path):
  if (why := _slurm_missing()):
    pytest.skip(why)
  # The template's Python is a shim that records each task's pid (exec keeps it) and picks the hang of each
  # start: start 1 sleeps 0.5 s after each step, so that the test stops process 0 mid-run (SIGSTOP: it never
  # runs again); at start 2, process 1's 3rd batch read blocks forever; start 3 runs through.
  pids = tmp_path / "pids"
  pids.mkdir()
  shim = _python_shim(tmp_path / "python-hangs", pids, "case \"${SLURM_RESTART_COUNT:-0}\" in\n"
                      "  0) export MAXLM_TEST_STEP_SLEEP=0.5 ;;\n  1) export MAXLM_TEST_DATA_HANG=3,1 ;;\nesac\n")
  # Limits: 3 s once a step time is known (the steps take ~0.5 s at start 1, ~0.01 s after); 120 s before
  # that and for saves, which covers the first step's compile on a loaded 2-core machine. A task left after
  # another ended is killed 2 s later (MAXLM_TASK_WAIT_S).
  watchdog = ["train.watchdog_floor_s=3", "train.watchdog_first_step_s=120", "checkpoint.every=5"]
  env = _env(1, runs.cache_dir, MAXLM_PYTHON=str(shim), MAXLM_TASK_WAIT_S="2")
  job = Job.of_template(tmp_path / "job", [*TWO_PROCESSES, *SAVED, *watchdog], env)
  end = time.monotonic() + 180
  while not re.search(r"step 6/20 \|", job.output()):
    alive = job.info().get("JobState") in ("PENDING", "RUNNING")
    assert time.monotonic() < end and alive, job.output()[-3000:]
    time.sleep(0.2)
  os.kill(int((pids / "start0-task0").read_text()), signal.SIGSTOP)  # process 0 hosts JAX's coordinator
  for restarts in (1, 2):
    _requeued_then_started(job, restarts, timeout=150)
  info = job.wait()
  out = job.output()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])

  starts = re.split(r"^maxlm-launch: job \d+ start \d+ .*$", out, flags=re.M)[1:]
  assert len(starts) == 3, out[-3000:]
  line = r"\[process (\d)/2 [^\]]+\] maxlm: error: watchdog: ([a-z ]+) at step (\d+) has taken ([\d.]+) s \(limit "
  line += r"([\d.]+) s: .*\); stacks of every thread in (\S+); exiting with code 76$"
  for start in starts:
    assert "Check failure" not in start and "Aborted" not in start, start[-3000:]  # JAX's abort: not seen
  # start 1: the survivor, process 1, ended itself within 3 s (floor) + 1 s (the thread's poll) + slack
  fired = re.findall(line, starts[0], flags=re.M)
  assert [f[0] for f in fired] == ["1"], starts[0][-3000:]
  assert 3 <= float(fired[0][4]) <= float(fired[0][3]) < float(fired[0][4]) + 2, fired
  assert "hung (exit 76, see the watchdog's line above): requeueing (restart 1 of at most 3" in starts[0]
  # start 2: process 1 stuck in its 3rd read after resuming from step 5 (step 8); process 0, waiting for it in
  # a collective, may end itself too or be killed first
  fired = re.findall(line, starts[1], flags=re.M)
  assert ("1", "data wait", "8") in [f[:3] for f in fired] and "DATA-HANG 3" in starts[1], starts[1][-3000:]
  assert "requeueing (restart 2 of at most 3" in starts[1]
  assert all("maxlm: resumed from checkpoint step 5" in start for start in starts[1:]), out[-3000:]
  assert out.rstrip().splitlines()[-1].startswith(f"maxlm-launch: job {job.id} finished with exit code 0")
  stacks = {p.name: p.read_text() for p in (job.run_dir / "watchdog").iterdir()}
  assert len(stacks) == len(re.findall(line, out, flags=re.M)), stacks.keys()
  # process 1 may have ended at step 8 in start 1 too (its metrics fetch waiting for the stopped process 0):
  # the stuck read is the file whose first line names the data wait
  hung_read = next(text for name, text in stacks.items()
                   if name.startswith("stacks-process1-step8-") and "data wait at step 8" in text.splitlines()[0])
  assert "in __next__" in hung_read and "Current thread" in hung_read and "MainThread" in hung_read

  _same_as_uninterrupted(job, runs)


@slurm
def test_sbatch_a_killed_task_ends_the_other_with_76_requeued_and_resumed_bit_identical(runs, tmp_path):
  """kill -9 of task 1 mid-run (a lost node, an OOM-killed rank). Before: process 0 printed a traceback (its
  collective failed: connection reset by peer) and hung in JAX's shutdown until srun killed it (--wait, 60 s):
  srun's code 137, no requeue. Now process 0 ends with one line naming process 1 and exit 76 before srun's wait is
  over (maxlm/runtime/peers.py: LOST_S 30 s < 60 s), the template requeues, and the job ends with the loss and
  parameters of test 1's run, bit for bit."""
  if (why := _slurm_missing()):
    pytest.skip(why)
  pids = tmp_path / "pids"
  pids.mkdir()
  shim = _python_shim(tmp_path / "python-killed", pids,
                      "[ \"${SLURM_RESTART_COUNT:-0}\" = 0 ] && export MAXLM_TEST_STEP_SLEEP=0.5\n")
  env = _env(1, runs.cache_dir, MAXLM_PYTHON=str(shim), MAXLM_TASK_WAIT_S="60")  # the template's default wait
  job = Job.of_template(tmp_path / "job", [*TWO_PROCESSES, *SAVED, "checkpoint.every=5"], env)
  end = time.monotonic() + 180
  while not re.search(r"step 8/20 \|", job.output()):
    alive = job.info().get("JobState") in ("PENDING", "RUNNING")
    assert time.monotonic() < end and alive, job.output()[-3000:]
    time.sleep(0.2)
  os.kill(int((pids / "start0-task1").read_text()), signal.SIGKILL)
  _requeued_then_started(job, 1, timeout=peers.LOST_S + 60)
  info = job.wait()
  out = job.output()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
  starts = re.split(r"^maxlm-launch: job \d+ start \d+ .*$", out, flags=re.M)[1:]
  assert len(starts) == 2, out[-3000:]
  first = starts[0]
  lines = [ln for ln in first.splitlines() if "maxlm: error" in ln]
  assert len(lines) == 1 and lines[0].startswith("[process 0/2 ") and "maxlm: error: process 1/2 (host " in lines[0]
  assert " was lost: no heartbeat for " in lines[0] and "exiting with code 76" in lines[0], lines
  assert "Traceback" not in first and "Check failure" not in first and "Aborted" not in first, first[-3000:]
  assert "task 0: Exited with exit code 76" in first and "task 1: Killed" in first, first[-3000:]
  assert "hung (exit 76, see the watchdog's line above): requeueing (restart 1 of at most 3" in first
  assert "maxlm: resumed from checkpoint step 5" in starts[1], starts[1][-3000:]
  _same_as_uninterrupted(job, runs)


@slurm
def test_sbatch_requeues_after_a_hang_at_most_max_restarts_times(tmp_path):
  if (why := _slurm_missing()):
    pytest.skip(why)
  # No trainer: task 1 exits 76 at once, as the watchdog does; task 0 stays stuck until srun kills it.
  fake = tmp_path / "python-always-hangs"
  fake.write_text("#!/bin/sh\n[ \"$SLURM_PROCID\" = 1 ] && exit 76\nexec sleep 600\n")
  fake.chmod(0o755)
  env = _env(1, tmp_path, MAXLM_PYTHON=str(fake), MAXLM_TASK_WAIT_S="1", MAXLM_MAX_RESTARTS="1")
  job = Job.of_template(tmp_path / "job", [], env)
  _requeued_then_started(job, 1, timeout=60)
  info = job.wait(timeout=60)
  out = job.output()
  # srun's own code was 137 (task 0 killed) at both starts: the template read task 1's 76 from srun's line
  assert info["JobState"] == "FAILED" and info["ExitCode"] == "76:0" and info["Restarts"] == "1", (info, out)
  assert "task 0: Killed" in out and "requeueing (restart 1 of at most 1 after a hang)" in out, out
  assert "not requeued, its restarts after a hang are used up (1 of MAXLM_MAX_RESTARTS=1)" in out, out
  assert out.rstrip().splitlines()[-1].startswith(f"maxlm-launch: job {job.id} finished with exit code 76")


def _nodes_up() -> int:
  sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
  return sum(st in ("idle", "mixed", "allocated") for st in sinfo.stdout.split())


# Process 1's memory under the test switch: its own device's (as process 0's), or 1 KiB (MAXLM_TEST_DEVICE_BYTES),
# in which nothing fits: process 1 alone would stop with "nothing fits", or run another program than process 0.
SAME, SMALLER = None, 1024


@slurm
@pytest.mark.parametrize("process_1_bytes", [SAME, SMALLER], ids=["same-memory", "process-1-smaller"])
def test_sbatch_two_nodes_plan_fit_on_the_gpu_path_runs_process_0s_plan_everywhere(tmp_path, process_1_bytes):
  """2 nodes x 1 task, plan.mode=fit with the test switch (MAXLM_TEST_GPU_PATHS=1, docs/testing.md) exported by the
  harness through sbatch and srun, so that the planner takes the path it takes on a GPU cluster: each process reads
  the memory of its local device, process 0 measures and decides, and its decision goes to every process.
  Before: processes 1..N-1 asked jax.devices()[0] (process 0's device, not addressable there) for its memory
  stats and died with a traceback, process 0 then timed out in Gloo's set-up (same-memory); and each process
  decided alone, so a process that sees less memory ran its own plan or none (process-1-smaller)."""
  if (why := _slurm_missing()):
    pytest.skip(why)
  if _nodes_up() < 2:
    pytest.skip(f"fewer than 2 SLURM nodes are up here ({START}: it runs two on this machine)")
  # Each task traces its train steps into a file named by its node and rank (tests/resume_launcher.py hooks;
  # `exec` keeps the task srun started). Without MAXLM_TEST_DEVICE_BYTES a process asks its own device for its
  # memory stats, as on a GPU (a CPU device reports none, so the host's memory counts).
  traces = tmp_path / "traces"
  traces.mkdir()
  smaller = f"[ \"$SLURM_PROCID\" = 1 ] && export MAXLM_TEST_DEVICE_BYTES={process_1_bytes}\n" if process_1_bytes else ""
  shim = tmp_path / "python-traced"
  shim.write_text("#!/bin/sh\n# called as: $0 -m maxlm.train ARGS\nshift 2\n"
                  f"export MAXLM_TEST_TRACE={traces}/node$SLURM_NODEID-task$SLURM_PROCID\n{smaller}"
                  f"exec {sys.executable} {ROOT / 'tests' / 'resume_launcher.py'} \"$@\"\n")
  shim.chmod(0o755)
  env = _env(1, tmp_path / "jax-cache", MAXLM_PYTHON=str(shim), MAXLM_TEST_GPU_PATHS="1")
  job = Job.of_template(tmp_path / "job", [*TWO_PROCESSES, "plan.mode=fit"], env, tasks=1, nodes=2)
  info = job.wait()
  out = job.output()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
  assert "srun: error" not in out and "Traceback" not in out and "maxlm: error" not in out, out[-3000:]
  assert info["NumNodes"] == "2" and "start 1 (restart count 0)" in out, (info, out[-3000:])
  # the planner took its GPU path (the target's kind names the switch) and printed, as process 0 only, a line as
  # its one compile ended, then its plan's line
  plan = [line for line in out.splitlines() if "maxlm: plan:" in line]
  assert len(plan) == 2 and all(line.startswith("[process 0/2 ") for line in plan), plan
  assert "maxlm: plan: compiled the config as written: peak " in plan[0], plan
  assert "plan: the config fits as written (peak " in plan[1] and "plan.mode=fit keeps it" in plan[1], plan
  warnings = [line for line in out.splitlines() if "warning: plan:" in line]
  if process_1_bytes == SAME:
    assert warnings == [], warnings
  else:  # process 1 says once that it sees less, and runs process 0's plan
    assert len(warnings) == 1 and warnings[0].startswith("[process 1/2 "), warnings
    assert "with 1.0 KiB, process 0 cpu (as a GPU: MAXLM_TEST_GPU_PATHS=1) with " in warnings[0], warnings
    assert warnings[0].endswith("every process runs process 0's plan (model.remat=none, train.grad_accum=1, "
                                "optim.offload=none, optim.mu_dtype=float32, optim.nu_dtype=float32)"), warnings
  # one task on each node, both trained every step of one program
  steps = {f.name: [json.loads(r)["step"] for r in f.read_text().splitlines()] for f in traces.iterdir()}
  assert steps == {"node0-task0": list(range(1, STEPS + 1)), "node1-task1": list(range(1, STEPS + 1))}, steps
  assert [r["step"] for r in _rows(job.run_dir)] == list(range(1, STEPS + 1))
  assert out.rstrip().splitlines()[-1].startswith(f"maxlm-launch: job {job.id} finished with exit code 0")
