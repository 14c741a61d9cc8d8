"""The hang watchdog (`maxlm.runtime.watchdog`): its limits (median step time x factor x steps in flight, the floor,
the slow limit), the one line, the stack file and the exit code (in subprocesses, for the real os._exit), and
the trainer's phases on a real one-process run whose data read blocks. The multi-process cases (a SIGSTOPped
peer, a stuck read in one process) with the SLURM template's requeue are in tests/test_launch.py."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import processes
import pytest

from maxlm.config import ConfigError, TrainConfig, load_config
from maxlm.runtime import watchdog

ROOT = Path(__file__).resolve().parent.parent
T = TrainConfig(watchdog_factor=10.0, watchdog_floor_s=1.0, watchdog_first_step_s=100.0)


def _quiet_watchdog(t=T, **kw):
  """A watchdog whose exit only records the code (its limits here are never reached)."""
  codes = []
  return watchdog.Watchdog(t, Path("/nonexistent"), exit=codes.append, **kw), codes


def test_limits_follow_the_median_the_steps_in_flight_and_the_floor():
  wd, codes = _quiet_watchdog()
  try:
    wd.arm("restore", 0)
    assert (wd.phase.name, wd.phase.limit, wd.phase.median) == ("restore", 100.0, None)  # no step time yet
    for s in (0.1, 0.3, 0.2, None, 0.0):  # None / 0: intervals without a measured step, ignored
      wd.step_time(s)
    assert wd.median == 0.2
    wd.arm("data wait", 1)
    assert wd.phase.limit == pytest.approx(10 * 0.2 * 1)  # nothing in flight counts as one step
    limits = []
    for step in (1, 2, 3):  # three steps dispatched, none fetched: the host may wait for all three
      wd.arm("step dispatch", step, dispatch=True)
      limits.append(wd.phase.limit)
    assert limits == pytest.approx([2.0, 4.0, 6.0])
    wd.arm("metrics fetch", 3, sync=True)  # waits for the three; nothing is in flight after it
    assert wd.phase.limit == pytest.approx(6.0) and wd.phase.in_flight == 3
    wd.arm("data wait", 4)
    assert wd.phase.limit == pytest.approx(2.0) and wd.phase.step == 4
    wd.arm("checkpoint save", 4, limit=watchdog.Limit(42.0, "a save's"))  # a limit of its own, median or not
    assert (wd.phase.limit, wd.phase.median, wd.phase.how) == (42.0, None, "a save's")
    wd.arm("checkpoint close", limit=watchdog.Limit(42.0, "a save's"))  # no step given: the step before
    assert wd.phase.step == 4
    wd.step_time(0.01)  # median of 0.1, 0.3, 0.2, 0.01 = 0.15: 1.5 s, above the floor
    wd.arm("data wait", 5)
    assert wd.phase.limit == pytest.approx(1.5)
  finally:
    wd.stop()
  wd, _ = _quiet_watchdog()
  try:
    wd.step_time(0.01)
    wd.arm("data wait", 1)
    assert wd.phase.limit == 1.0  # 10 x 0.01 s = 0.1 s is below the floor
  finally:
    wd.stop()
  assert codes == []


def test_the_median_is_over_the_last_101_step_times():
  wd, _ = _quiet_watchdog()
  try:
    for s in [1.0] * 101 + [3.0] * 50:  # kept: 51 x 1.0, 50 x 3.0
      wd.step_time(s)
    assert wd.median == 1.0
    wd.step_time(3.0)  # kept: 50 x 1.0, 51 x 3.0
    assert wd.median == 3.0
  finally:
    wd.stop()


def test_slow_phase_limits_from_the_runs_measurements_by_hand():
  # factor 10, step floor 1 s, slow floor 100 s; a 4 GB state; a probe that wrote 200 MB/s and read 800 MB/s; a
  # compile of 30 s known at start
  lim = watchdog.Limits(T, 4 * 10**9, (2e8, 8e8), 30.0)
  assert lim.compile().seconds == 300.0  # 10 x 30 s
  assert lim.restore().seconds == 100.0  # 10 x 4e9 / 8e8 = 10 x 5 s = 50 s: the floor
  assert lim.save().seconds == 200.0  # 10 x 4e9 / 2e8 = 10 x 20 s
  assert lim.save(saves=2).seconds == 400.0  # one in flight, then its own: 10 x 2 x 20 s
  assert lim.save(1, last_write_s=7.0).seconds == 100.0  # 10 x 7 s = 70 s: the floor
  assert lim.save(2, last_write_s=7.0).seconds == 140.0  # a save measured replaces the probe: 10 x 2 x 7 s
  assert "10 x 4 GB written at 200 MB/s (probe) x 2 saves: 40 s, floor 100 s" == lim.save(2).how
  assert "10 x the last save's time x 2 saves: 14 s, floor 100 s" == lim.save(2, 7.0).how
  assert "10 x 4 GB read at 800 MB/s (probe): 5 s, floor 100 s" == lim.restore().how
  lim.compiled(45.0)  # this start's own compile, longer than the one known: it counts
  assert lim.compile().seconds == 450.0
  lim.compiled(5.0)  # a shorter one does not lower it
  assert lim.compile().seconds == 450.0
  # eval batches: the first compiles the eval step; before one is timed the slow floor; then the median's
  assert lim.eval_batch(first=True).seconds == 450.0
  assert (lim.eval_batch(first=False).seconds, lim.eval_batch(first=False).how) == (
      100.0, "train.watchdog_first_step_s=100 s, no eval batch timed yet")
  for seconds in (0.2, 0.9, 0.4):  # median 0.4 s: 10 x 0.4 = 4 s, above the step floor (1 s)
    lim.eval_time(seconds)
  assert lim.eval_batch(first=False).seconds == pytest.approx(4.0)
  assert lim.eval_batch(first=False).how == "10 x median eval batch 0.4 s, floor 1 s"
  for seconds in (0.01, 0.01, 0.01):  # six times: the median is the mean of the middle two, (0.01 + 0.2) / 2
    lim.eval_time(seconds)
  assert lim.eval_batch(first=False).seconds == pytest.approx(1.05)  # 10 x 0.105 s
  lim.eval_time(0.01)  # seven: 0.01 s in the middle, 10 x 0.01 = 0.1 s is below the floor
  assert lim.eval_batch(first=False).seconds == 1.0
  # nothing measured: no probe, no compile known
  bare = watchdog.Limits(T, 4 * 10**9, None, None)
  assert [bare.compile().seconds, bare.restore().seconds, bare.save().seconds] == [100.0, 100.0, 100.0]
  assert bare.compile().how == "train.watchdog_first_step_s=100 s, no compile time known at start"
  assert bare.save(1, last_write_s=30.0).seconds == 300.0  # the first save measured: 10 x 30 s
  line = watchdog.Limits(T, 4 * 10**9, (2e8, 8e8), 30.0).describe()
  assert "compile 300 s, restore 100 s, save 200 s" in line and "after 10x its expected time, at least 100 s" in line


def test_rearming_restarts_the_clock_and_stop_ends_the_thread():
  t = TrainConfig(watchdog_floor_s=0.3, watchdog_first_step_s=0.3)
  wd, codes = _quiet_watchdog(t)
  for i in range(8):  # 8 phases of 0.1 s: 0.8 s in all, each far inside its 0.3 s limit
    wd.arm("step dispatch", i + 1, dispatch=True)
    time.sleep(0.1)
  wd.stop()
  time.sleep(0.5)  # past the last phase's deadline: a stopped watchdog does not fire
  assert codes == [] and "maxlm-watchdog" not in [th.name for th in threading.enumerate()]


def test_slow_limit_fires_in_process_with_the_exit_code(tmp_path):
  t = TrainConfig(watchdog_floor_s=10.0, watchdog_first_step_s=0.2)
  codes = []
  wd = watchdog.Watchdog(t, tmp_path / "watchdog", exit=codes.append)
  wd.arm("restore", 0)  # no step time yet: the slow limit, 0.2 s
  end = time.monotonic() + 5
  while not codes and time.monotonic() < end:
    time.sleep(0.05)
  assert codes == [watchdog.EXIT_HUNG] == [76]
  [stacks] = (tmp_path / "watchdog").iterdir()
  first = stacks.read_text().splitlines()[0]
  # taken: the limit plus the thread's wake-up (it sleeps until the deadline, and at most 1 s at a time)
  assert re.fullmatch(r"maxlm: error: watchdog: restore at step 0 has taken 0\.[2-9] s \(limit 0\.2 s: "
                      r"train\.watchdog_first_step_s=0\.2 s, no step time is known yet\); stacks of every thread in "
                      + re.escape(str(stacks)) + "; exiting with code 76", first), first


def test_a_stuck_run_directory_sends_the_stacks_to_stderr(tmp_path, monkeypatch, capfd):
  # the hang may be the file system itself: writing the stack file must not hold the exit up
  monkeypatch.setattr(watchdog, "STACKS_WRITE_S", 0.3)
  monkeypatch.setattr(watchdog, "open", lambda *a, **kw: threading.Event().wait(), raising=False)
  codes = []
  wd = watchdog.Watchdog(TrainConfig(watchdog_first_step_s=0.1), tmp_path / "watchdog", exit=codes.append)
  wd.arm("checkpoint save", 7, limit=watchdog.Limits(TrainConfig(watchdog_first_step_s=0.1), 10**9, None,
                                                      None).save())
  end = time.monotonic() + 5
  while not codes and time.monotonic() < end:
    time.sleep(0.05)
  assert codes == [76]
  err = capfd.readouterr().err
  assert "Current thread" in err and re.search(
      r"\(limit 0\.1 s: train\.watchdog_first_step_s=0\.1 s, no bandwidth measured\); stacks of every thread in "
      r"stderr \(cannot write " + re.escape(str(tmp_path / "watchdog")) + r"/stacks-process0-step7-\d{8}-\d{6}"
      r"\.txt: no answer within 0\.3 s\); exiting with code 76$", err.splitlines()[-1]), err[-500:]


CHILD = r"""
import sys, threading, time
from pathlib import Path
from maxlm.config import TrainConfig
from maxlm.runtime import watchdog
from maxlm.runtime.process_output import prefix_output
prefix_output("[process 1/2 hostx] ")
wd = watchdog.Watchdog(TrainConfig(watchdog_factor=10.0, watchdog_floor_s=0.5), Path(sys.argv[1]), process_index=1)
wd.step_time(0.02)  # limit max(0.5, 10 x 0.02 x 1) = 0.5 s
for step in range(1, 6):  # 1 s of phases of 0.1 s each: no exit
  wd.arm("step dispatch", step, dispatch=True)
  time.sleep(0.1)
  wd.arm("metrics fetch", step, sync=True)
  time.sleep(0.1)
print("ALIVE", flush=True)

def stuck_in_a_collective():
  threading.Event().wait()

wd.arm("metrics fetch", 6, sync=True)
stuck_in_a_collective()
"""


@pytest.mark.parametrize("writable", [True, False])
def test_a_stuck_phase_ends_the_process_with_one_line_the_stacks_and_code_76(tmp_path, writable):
  if writable:
    stack_dir = tmp_path / "run" / "watchdog"
  else:
    (tmp_path / "run").write_text("a file, not a directory")
    stack_dir = tmp_path / "run" / "watchdog"
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, "-c", CHILD, str(stack_dir)], cwd=ROOT, capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 76 and r.stdout == "[process 1/2 hostx] ALIVE\n", (r.returncode, r.stdout, r.stderr)
  lines = r.stderr.splitlines()
  pattern = (r"\[process 1/2 hostx\] maxlm: error: watchdog: metrics fetch at step 6 has taken ([\d.]+) s \(limit "
             r"0\.5 s: 10 x median step 0\.02 s, floor 0\.5 s\); stacks of every thread in (.+); exiting with code 76")
  if writable:
    assert len(lines) == 1, r.stderr
    m = re.fullmatch(pattern, lines[0])
    assert m and Path(m[2]).parent == stack_dir, lines
    text = Path(m[2]).read_text()
    assert text.startswith(lines[0].removeprefix("[process 1/2 hostx] ")), text
    assert Path(m[2]).name.startswith("stacks-process1-step6-")
  else:  # the stacks go to stderr, before the line, which says where they went
    m = re.fullmatch(pattern, lines[-1])
    assert m and m[2].startswith(f"stderr (cannot write {stack_dir}/stacks-process1-step6-"), lines[-1]
    text = r.stderr
    assert not stack_dir.exists()
  # the stuck main thread is named with its frame; the phase overran its limit by at most the poll interval
  assert "in stuck_in_a_collective" in text and "Current thread" in text
  if writable:
    assert "MainThread" in text and "maxlm-watchdog" in text
  assert 0.5 <= float(m[1]) < 0.5 + watchdog.POLL_S + 0.5, m[1]  # 0.5 s of slack for a loaded host
  assert time.monotonic() - t0 < 30


def test_on_for_several_processes_and_jax_heartbeat_raised_with_it():
  auto, always, never = (TrainConfig(watchdog=w) for w in ("auto", "always", "never"))
  assert [watchdog.enabled(auto, n) for n in (1, 2)] == [False, True]
  assert [watchdog.enabled(always, n) for n in (1, 2)] == [True, True]
  assert [watchdog.enabled(never, n) for n in (1, 2)] == [False, False]
  assert watchdog.jax_heartbeat_s(auto, 1) is None and watchdog.jax_heartbeat_s(never, 8) is None
  # a stopped peer must be the watchdog's to report: JAX's heartbeat outlasts every limit in use
  assert watchdog.jax_heartbeat_s(auto, 2) == watchdog.HEARTBEAT_S >= 10 * T.watchdog_first_step_s
  assert isinstance(watchdog.start(auto, Path("/nonexistent"), 0, 1), watchdog._Off)


@pytest.mark.parametrize("arg,key", [("train.watchdog=on", "train.watchdog"),
                                     ("train.watchdog_factor=0.5", "train.watchdog_factor"),
                                     ("train.watchdog_floor_s=0", "train.watchdog_floor_s"),
                                     ("train.watchdog_first_step_s=-1", "train.watchdog_first_step_s")])
def test_bad_watchdog_keys_are_refused(arg, key):
  with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
    load_config([arg])


TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.remat=none", "model.backend=flax", "model.vocab_size=128", "data.type=synthetic",
        "data.seq_len=16", "data.global_batch_size=4", "train.log_every=1", "train.eval_every=0", "run_name=r"]


def test_a_run_whose_data_read_blocks_ends_with_the_watchdog(tmp_path):
  # One process, watched on purpose (train.watchdog=always); its 3rd batch read blocks forever
  # (tests/resume_launcher.py). Steps 1 and 2 run and log; the read of step 3 ends the run 1 s (the floor:
  # the CPU steps take milliseconds) after it started.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXLM_TEST_DATA_HANG": "3,0",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  r = subprocess.run([sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={tmp_path}", *TINY,
                      "train.steps=6", "train.watchdog=always", "train.watchdog_floor_s=1"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 76, (r.returncode, r.stderr[-3000:])
  last = r.stderr.splitlines()[-1]
  m = re.fullmatch(r"maxlm: error: watchdog: data wait at step 3 has taken 1\.\d s \(limit 1\.0 s: 10 x median "
                   r"step [\d.e-]+ s, floor 1 s\); stacks of every thread in (\S+); exiting with code 76", last)
  assert m, last
  assert "DATA-HANG 3" in r.stdout and "step 2/6 |" in r.stdout and "step 3/6" not in r.stdout
  rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [1, 2]
  stacks = Path(m[1])
  assert stacks.parent == tmp_path / "r" / "watchdog" and "in __next__" in stacks.read_text()


# The embedded corpus (it has an eval split), a tiny model; every save waits for its files (async_save=false), so
# the save is one phase of the loop; factor 3, step floor 1 s.
EVAL_RUN = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
            "model.n_layers=1", "model.remat=none", "model.backend=flax", "data.seq_len=16",
            "data.global_batch_size=4", "train.log_every=1", "train.eval_every=2", "train.eval_steps=4",
            "checkpoint.every=2", "checkpoint.async_save=false", "train.watchdog=always", "train.watchdog_factor=3",
            "train.watchdog_floor_s=1", "run_name=r"]


def _launch(tmp_path, cache, *args, **env):
  e = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env,
       "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  return subprocess.run([sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={tmp_path}",
                         *EVAL_RUN, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


def _state_bytes(step_dir: Path) -> int:
  """The bytes of every array a checkpoint step holds, from the shapes and dtypes its meta item records."""
  arrays = json.loads((step_dir / "meta" / "metadata").read_text())["arrays"]
  itemsize = {"float32": 4, "bfloat16": 2, "int32": 4, "uint32": 4, "float16": 2}
  total = 0
  for shape, dtype, _ in arrays.values():
    n = 1
    for d in shape:
      n *= d
    total += n * itemsize[dtype]
  return total


def test_long_phases_that_progress_run_on_and_stuck_ones_end_within_their_limits(tmp_path):
  """Three starts of one run, on the tests' launcher (tests/resume_launcher.py: a slow or stuck eval data source
  and checkpoint storage):
  1. a fresh run whose 3rd eval batch read blocks: it ends 1 s after that read began (the step floor: 3 x its
     eval batches' median of milliseconds is less), with its checkpoint of step 2 saved;
  2. its resume with an eval batch read of 2.5 s (4 batches: 10 s) and a storage writing a checkpoint in 10 s,
     under a slow floor of 8 s: before, every save and evaluation had that flat 8 s and this run was ended at its
     evaluation; now both run to the end (the eval batches are timed one by one; the save's limit is 3 x the
     checkpoint's bytes over the bandwidth of the probe, which writes to the same slow storage);
  3. a resume whose storage never completes the save of step 6: ended once 3 x its probe's estimate (far under
     the 8 s floor) and the floor have passed, the checkpoint of step 4 intact."""
  cache = tmp_path / "xla-cache"
  run_dir = tmp_path / "r"
  r = _launch(tmp_path, cache, "train.steps=2", "train.watchdog_first_step_s=120", MAXLM_TEST_EVAL_HANG="3")
  assert r.returncode == 76, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  last = r.stderr.splitlines()[-1]
  m = re.fullmatch(r"maxlm: error: watchdog: evaluation batch 3 at step 2 has taken ([\d.]+) s \(limit 1\.0 s: 3 x "
                   r"median eval batch [\d.e-]+ s, floor 1 s\); stacks of every thread in \S+; exiting with code 76",
                   last)
  assert m and 1.0 <= float(m[1]) < 1.0 + watchdog.POLL_S + 2.0, last  # 2 s of slack for a loaded host
  assert "EVAL-HANG 3" in r.stdout and sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]
  first_row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
  compile_known = first_row["lower_s"] + first_row["compile_s"]

  nbytes = _state_bytes(run_dir / "checkpoints" / "2")
  r = _launch(tmp_path, cache, "train.steps=4", "train.watchdog_first_step_s=8", MAXLM_TEST_EVAL_SLEEP="2.5",
              MAXLM_TEST_STORAGE=str(nbytes / 10))
  assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
  assert "step 4/4 | loss" in r.stdout and " | eval " in r.stdout.split("step 4/4")[1]
  written = re.search(r"checkpoint step 4 written: .* in ([\d.]+) s", r.stdout)
  assert written and float(written[1]) >= 10.0, r.stdout[-2000:]  # longer than the 8 s floor
  limits = re.search(r"maxlm: watchdog: .* after 3x its expected time, at least 8 s .*: compile (\d+) s, restore "
                     r"(\d+) s, save (\d+) s", r.stdout)
  assert limits, r.stdout[-3000:]
  # compile: 3 x the first start's trace, lower and compile (its first row); this start's planner may know more
  assert int(limits[1]) >= max(8, round(3 * compile_known)) - 1
  # save: 3 x the bytes / the probe's bandwidth; the probe took bytes / (nbytes / 10 s) in the slow storage, so
  # the estimate is at least 3 x 10 s, and it is at most that plus 3 x the probe's own write time
  assert 30 <= int(limits[3]) <= 45 and int(limits[2]) == 8, limits[0]

  r = _launch(tmp_path, cache, "train.steps=6", "train.watchdog_first_step_s=8", MAXLM_TEST_STORAGE="1e12,2")
  assert r.returncode == 76, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
  last = r.stderr.splitlines()[-1]
  m = re.fullmatch(r"maxlm: error: watchdog: checkpoint save at step 6 has taken ([\d.]+) s \(limit 8\.0 s: 3 x "
                   r"[\d.]+ MB written at [\d.e+]+ [MG]B/s \(probe\): [\d.e-]+ s, floor 8 s\); stacks of every "
                   r"thread in \S+; exiting with code 76", last)
  assert m and 8.0 <= float(m[1]) < 8.0 + watchdog.POLL_S + 2.0, last
  assert "STORAGE-STUCK 2" in r.stdout and "step 6/6" not in r.stdout
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


@pytest.mark.slow
@pytest.mark.parametrize("where, phase", [("plan", "start-up: plan"), ("data", "start-up: run directory")])
def test_a_process_stopped_during_start_up_ends_the_others_in_one_line(tmp_path, where, phase):
  """Process 0 stops (SIGSTOP, a frozen node) as its planner begins, or as it opens its data; process 1 waits for
  process 0's decision (the plan; the run directory, which process 0 alone creates). The start-up watchdog ends
  process 1 with one line and exit 76 (requeue) once that wait has lasted its phase's limit,
  train.watchdog_first_step_s (15 s here), rather than holding it until the job's time limit (JAX's heartbeat
  is a day while the watchdog is on)."""
  limit = 15
  procs = processes.start(2, ["run_name=r", "train.steps=3", "data.global_batch_size=8", "mesh.dcn_fsdp=2",
                              f"train.watchdog_first_step_s={limit}"], tmp_path,
                          [{"MAXLM_TEST_STOP_IN": f"{where},0,{tmp_path}"}] * 2, launcher=True)
  try:
    end = time.monotonic() + 180
    while f"STOPPING {where}" not in processes.output(tmp_path, 0)[0]:
      assert time.monotonic() < end and procs[0].poll() is None, processes.output(tmp_path, 0)
      time.sleep(0.1)
    stopped = time.monotonic()
    # the wait began at most a few seconds after process 0 stopped; then the limit, the watchdog's 1 s poll and
    # the stacks written (at most 10 s, STACKS_WRITE_S): 30 s of slack for a loaded 2-core machine
    try:
      code = procs[1].wait(timeout=limit + 30)
    except subprocess.TimeoutExpired:
      procs[1].send_signal(signal.SIGUSR1)  # its stacks to p1.err (tests/resume_launcher.py), for the message
      time.sleep(3)
      raise AssertionError(f"process 1 still runs {limit + 30} s after process 0 stopped; its stacks and output: "
                           f"{processes.output(tmp_path, 1)[1][-6000:]}") from None
    took = time.monotonic() - stopped
  finally:
    for p in procs:
      p.kill()
      p.wait()
  out, err = processes.output(tmp_path, 1)
  lines = [ln for ln in (out + err).splitlines() if "maxlm: error:" in ln]
  assert code == 76 and len(lines) == 1 and err.rstrip().endswith(lines[0]), (code, out[-2000:], err[-3000:])
  m = re.fullmatch(rf"\[process 1/2 \S+\] maxlm: error: watchdog: {phase} \(waiting for process 0\) at step 0 has "
                   rf"taken (1[5-7]\.\d) s \(limit {limit}\.0 s: train\.watchdog_first_step_s={limit} s: a start-up phase is "
                   r"at "
                   r"most one compile and its set-up\); stacks of every thread in (\S+); exiting with code 76",
                   lines[0])
  assert m, (lines[0], processes.output(tmp_path, 0)[0][-2000:])
  assert took < limit + 30 and "wait" in Path(m[2]).read_text()


# The planner on the GPU path (the test switch, tests/resume_launcher.py's made-up compiles): the config as written
# compiles in 2 s and does not fit; the next compile's limit is 3 x those 2 s (floor 1 s), not the flat
# train.watchdog_first_step_s (30 s here, 1800 s by default).
PLANNED = [*TINY, "train.steps=1", "checkpoint.enabled=false", "train.watchdog=always", "train.watchdog_factor=3",
           "train.watchdog_floor_s=1", "train.watchdog_first_step_s=30", "plan.timed=0", "plan.levers=train.grad_accum",
           "compile.warm_start=false"]  # each test plans: no decision kept from another in the suite's shared cache


def _planned(tmp_path, compiles: str):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXLM_TEST_GPU_PATHS": "1", "MAXLM_TEST_DEVICE_BYTES": str(2**30),
         "MAXLM_TEST_PLAN_COMPILES": compiles,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
  began = time.monotonic()
  r = subprocess.run([sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={tmp_path}", *PLANNED],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  return r, time.monotonic() - began


def test_a_planner_compile_slower_than_the_floor_but_within_its_expected_time_runs_on(tmp_path):
  r, _ = _planned(tmp_path, "2,4")  # 4 s: over the 1 s floor, under 3 x 2 s
  assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
  assert "PLAN-COMPILE 2" in r.stdout and "step 1/1" in r.stdout


def test_a_stuck_planner_compile_ends_within_its_derived_limit(tmp_path):
  r, took = _planned(tmp_path, "2,hang")
  assert r.returncode == 76, (r.returncode, r.stderr[-3000:])
  last = r.stderr.splitlines()[-1]
  m = re.fullmatch(r"maxlm: error: watchdog: start-up: plan \(a compile\) at step 0 has taken (6\.\d) s \(limit "
                   r"(6\.\d+) s: 3 x the compile expected from the planner's compiles before it (2(?:\.\d+)?) s, floor 1 s\); "
                   r"stacks of every thread in \S+; exiting with code 76", last)
  assert m and float(m[2]) == pytest.approx(3 * float(m[3]), abs=0.1), last  # both printed rounded
  assert "PLAN-COMPILE 2" in r.stdout and "step 1" not in r.stdout
  assert took < 30  # the whole run, imports and the first compile included: under the old flat limit alone


def test_the_planners_compile_limit_by_hand():
  t = load_config(["train.watchdog_factor=10", "train.watchdog_floor_s=300", "train.watchdog_first_step_s=1800"]).train
  assert watchdog.planned_compile_limit(t, None).seconds == 1800  # the first compile: the slow floor
  assert watchdog.planned_compile_limit(t, 81.0).seconds == 810  # 10 x 81 s
  assert watchdog.planned_compile_limit(t, 12.0).seconds == 300  # 10 x 12 s = 120 s, under the floor
  assert watchdog.planned_compile_limit(t, 240.0).seconds == 2400  # a slow compile: past the old flat 1800 s
