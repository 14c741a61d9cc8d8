"""`python -m maxlm.train` end to end: run directory contents, metrics, exit codes on bad input."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# subprocess runs compile like the suite's own (conftest): XLA's CPU backend at optimization level 0
FAST_CPU = "--xla_backend_optimization_level=0"

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=4",
        "model.vocab_size=128"]


def cli(args, tmp_path, env=None):
  e = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + FAST_CPU, "JAX_PLATFORMS": "cpu",
       **(env or {})}
  e = {k: v for k, v in e.items() if v is not None}  # env={"X": None} unsets X
  return subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp_path}", *args], cwd=ROOT,
                        env=e, capture_output=True, text=True, timeout=600)


def test_cli_trains_and_writes_the_run_directory(tmp_path):
  r = cli([*TINY, "run_name=r1", "train.steps=6", "train.log_every=3", "model.backend=flax", "mesh.fsdp=-1"],
          tmp_path)
  assert r.returncode == 0, r.stderr
  run = tmp_path / "r1"
  assert "model:" in (run / "config.yml").read_text()
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [3, 6]
  for key in ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu"):
    assert key in rows[-1]
  assert rows[-1]["tokens_per_sec"] > 0 and rows[-1]["mfu"] is None  # no known peak for a CPU
  assert list((run / "tensorboard").glob("events.out.tfevents.*"))
  assert "step 6/6" in r.stdout and "mesh {'pipeline': 1, 'data': 1, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 1}" in r.stdout


@pytest.mark.te
def test_cpu_train_on_the_te_backend_prints_nothing_on_stderr(tmp_path):
  """backend=auto picks TE wherever it is installed; on a CPU its softmax runs as JAX on purpose (te_env), and
  TE's "Using unfused JAX softmax" warning at every trace was noise in each CPU train, generate and eval."""
  r = cli([*TINY, "run_name=q", "train.steps=1", "model.backend=te"], tmp_path)
  assert r.returncode == 0, r.stderr
  assert "backend=te, precision=bf16) on" in r.stdout and r.stderr == ""  # TINY computes in bfloat16


@pytest.mark.parametrize("args,message", [
    (["train.stpes=3"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
    (["model.d_model=big"], "config key 'model.d_model' expects int"),
    (["model.precision=fp8_delayed", "model.backend=flax"], "needs model.backend=te"),
    (["model.remat=recompute_norm_act", "model.backend=flax"], "model.remat=recompute_norm_act needs model.backend=te"),
    (["mesh.data=3"], "mesh:"),
    (["run_name=.."], "run_name"),
    (["config="], "config="),
    (["model.n_kv_heads=0"], "model.n_kv_heads"),
    (["model.rope_theta=0"], "model.rope_theta"),
    (["train.seed=1e30"], "train.seed"),
    (["data.seed=-1"], "data.seed"),
    (["optim.learning_rate=nan"], "optim.learning_rate"),
    # checked by the trainer before the run directory exists
    (["data.global_batch_size=3"], "not divisible by the 2 data-parallel devices"),
    (["mesh.pipeline=2", "mesh.fsdp=1", "model.n_layers=3", "train.grad_accum=2"],
     "model.n_layers=3 does not split into the 2 pipeline stages of mesh.pipeline=2 x mesh.dcn_pipeline=1"),
    (["mesh.pipeline=2", "mesh.fsdp=1", "model.n_layers=2"], "train.grad_accum=1 gives fewer micro-batches than "
     "the 2 pipeline stages of mesh.pipeline=2 x mesh.dcn_pipeline=1; use train.grad_accum >= 2"),
    (["model.n_layers=100000000"], "per device"),
    (["model.vocab_size=2147483647"], "per device"),
    (["data.type=text", "data.paths=/nonexistent/train.txt", "model.vocab_size=8192"], "/nonexistent/train.txt"),
    (["data.type=embedded", "data.eval_paths=/nonexistent/eval.txt", "model.vocab_size=8192"],
     "/nonexistent/eval.txt"),
    (["checkpoint.load_params=/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
  r = cli([*TINY, "run_name=bad", *args], tmp_path)
  code = 3 if any(a.startswith("checkpoint.") for a in args) else 2
  assert r.returncode == code, r.stderr[-2000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("maxlm: error: ") and message in lines[0], r.stderr
  assert list(tmp_path.iterdir()) == []  # nothing created, not even the run directory


def test_bad_input_found_after_the_lock_removes_the_directories_it_made(tmp_path):
  """The lock is taken (the run directory made) before the planner and the trainer check the rest: a config they
  refuse leaves nothing, not even an output_dir that did not exist."""
  r = cli([*TINY, "run_name=bad", "data.global_batch_size=3"], tmp_path / "new" / "out")
  assert r.returncode == 2 and "not divisible by the 2 data-parallel devices" in r.stderr, r.stderr[-2000:]
  assert list(tmp_path.iterdir()) == []


HOLD = """
import sys, time
from pathlib import Path
from maxlm.checkpoint import run_lock
lock = run_lock.acquire(Path(sys.argv[1]))
print("HELD", flush=True)
time.sleep(600)
"""
# the train command, then whether JAX started a backend (on a GPU: a context and its memory) in this process
TRAIN_THEN_BACKEND = """
import sys
from jax._src import xla_bridge
from maxlm.cli.train import main
rc = main(sys.argv[1:])
print("backend started:", xla_bridge.backends_are_initialized(), flush=True)
sys.exit(rc)
"""


def test_a_duplicate_run_is_refused_before_the_planner_and_the_backend(tmp_path):
  """A run holds the directory's lock; the same command again stops in its one line (exit 2) before it plans, reads
  data or starts JAX's backend (a duplicate on a GPU node would take the GPU of the first), and leaves the holder's
  files as they were."""
  run = tmp_path / "r"
  run.mkdir()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + FAST_CPU}
  env.pop("SLURM_JOB_ID", None)
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
  try:
    assert holder.stdout.readline().strip() == "HELD"
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    r = subprocess.run([sys.executable, "-c", TRAIN_THEN_BACKEND, f"output_dir={tmp_path}", *TINY, "run_name=r",
                        "model.backend=flax", "train.steps=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    since = json.loads((run / "run.lock").read_text())["since"]
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        f"maxlm: error: run directory {run} is in use by another run: process {holder.pid} on host "
        f"{socket.gethostname()} since {since}; wait for it to end, or give this run its own run_name=..."]
    assert r.stdout.splitlines()[-1] == "backend started: False", r.stdout
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
  finally:
    holder.kill()
    holder.wait()


def test_first_step_line_elapsed_eta_and_na_flops_on_cpu(tmp_path):
  r = cli([*TINY, "run_name=r", "train.steps=4", "train.log_every=2", "model.backend=flax"], tmp_path)
  assert r.returncode == 0, r.stderr
  out = r.stdout.splitlines()
  first = next(i for i, line in enumerate(out) if line.startswith("maxlm: first step 1 done"))
  assert first < next(i for i, line in enumerate(out) if line.startswith("step 2/4"))
  step2 = next(line for line in out if line.startswith("step 2/4"))
  assert "TFLOP/s n/a | MFU n/a" in step2 and " elapsed, ETA " in step2
  assert "ETA" not in next(line for line in out if line.startswith("step 4/4"))
  rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
  assert rows[0]["first_step_s"] > 0 and rows[1]["elapsed_s"] > rows[0]["elapsed_s"]
  assert rows[0]["eta_s"] > 0 and "eta_s" not in rows[1] or rows[1]["eta_s"] == 0


def _readonly_reason(tmp_path):
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && ! touch "$0/x"',
                        str(probe)], capture_output=True, text=True, timeout=30)
  except FileNotFoundError:
    return "unshare is not installed"
  probe.rmdir()
  return None if r.returncode == 0 else f"unshare -m / mount --bind -o ro not permitted: {r.stderr.strip()}"


def test_readonly_output_dir_at_start_and_on_resume(tmp_path):
  reason = _readonly_reason(tmp_path)
  if reason:
    pytest.skip(reason)
  out = tmp_path / "out"
  out.mkdir()
  args = [*TINY, "model.backend=flax", "train.steps=2", "run_name=r"]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + FAST_CPU, "JAX_PLATFORMS": "cpu"}
  mount = 'mount --bind -o ro "$0" "$0" && shift 0 && exec "$@"'
  cmd = [sys.executable, "-m", "maxlm.train", f"output_dir={out}", *args]

  def readonly_run():
    return subprocess.run(["unshare", "-m", "sh", "-c", mount, str(out), *cmd], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)

  r = readonly_run()  # a fresh run under a read-only output_dir
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("maxlm: error: output_dir: cannot write the run directory") and str(out) in r.stderr
  assert list(out.iterdir()) == []
  r = cli(args, out)  # an existing run, then resumed with output_dir read-only
  assert r.returncode == 0, r.stderr
  before = sorted(p.name for p in (out / "r").iterdir())
  r = readonly_run()
  assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Read-only file system" in r.stderr, r.stderr
  assert sorted(p.name for p in (out / "r").iterdir()) == before


def _launch(tmp_path, args, env=None):
  e = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + FAST_CPU, "JAX_PLATFORMS": "cpu",
       "PYTHONUNBUFFERED": "1", **(env or {})}
  return subprocess.Popen([sys.executable, str(ROOT / "tests" / "resume_launcher.py"), f"output_dir={tmp_path}",
                           *args], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc, prefix):
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith(prefix):
      return lines
  raise AssertionError(f"no line starting with {prefix!r}: {''.join(lines)}")


def test_sigterm_without_checkpoints_says_nothing_was_saved(tmp_path):
  proc = _launch(tmp_path, [*TINY, "model.backend=flax", "train.steps=1000", "train.log_every=1000",
                            "checkpoint.enabled=false"],
                 {"MAXLM_TEST_STEP_SLEEP": "0.2"})
  _wait_for(proc, "maxlm: first step")
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 75, err
  assert "nothing was saved (checkpoint.enabled=false)" in out and "rerun the same command to resume" not in out
  assert not (tmp_path / "default" / "checkpoints").exists()


def test_sigterm_while_compiling_exits_at_once(tmp_path):
  # 16 unrolled layers take many seconds to compile on a CPU; TERM arrives during that compile.
  proc = _launch(tmp_path, [*TINY, "model.backend=flax", "model.scan_layers=false", "model.n_layers=16",
                            "model.remat=full", "train.steps=5"])
  _wait_for(proc, "maxlm: tiny")  # the model is built; the first step is being traced and compiled
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 75 and time.monotonic() - t0 < 10, (proc.returncode, err)
  assert "before the first training step: nothing to save" in err and "first step" not in out


def test_nonfinite_steps_are_reported_once_per_interval(tmp_path):
  proc = _launch(tmp_path, [*TINY, "model.backend=flax", "train.steps=8", "train.log_every=4", "run_name=nan"],
                 {"MAXLM_TEST_NAN_STEPS": "2,3,4,6"})  # step 4 is logged with a NaN loss
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  warnings = [line for line in out.splitlines() if line.startswith("maxlm: warning:") and "skipped" in line]
  assert "maxlm: warning: optim.warmup_steps=20 is not below train.steps=8" in out  # the other warning: TINY's warmup
  assert len(warnings) == 2, out
  assert "3 update(s) skipped" in warnings[0] and "up to step 4 (3 in all" in warnings[0]
  assert "1 update(s) skipped" in warnings[1] and "(4 in all" in warnings[1]
  assert "NaN or Inf" not in err and "NaN or Inf" not in out


def test_deterministic_sets_the_flags_before_the_backend_starts(tmp_path):
  r = cli([*TINY, "model.backend=flax", "train.steps=1", "train.deterministic=true"], tmp_path,
          env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": None})
  assert r.returncode == 0, r.stderr
  assert "train.deterministic=true: XLA_FLAGS += --xla_gpu_deterministic_ops=true" in r.stdout
  assert "train.deterministic=true: NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in r.stdout
  r = cli([*TINY, "train.steps=1", "train.deterministic=true", "run_name=x"], tmp_path / "no",
          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_gpu_deterministic_ops=false"})
  assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--xla_gpu_deterministic_ops=false" in r.stderr


def _snapshot(run_dir: Path) -> dict:
  return {name: (run_dir / name).read_bytes() for name in ("config.yml", "metrics.jsonl")}


def test_a_run_keeps_its_weights_and_a_second_run_never_destroys_the_first(tmp_path):
  """A run leaves a final checkpoint by default. Another run in its directory is refused in one line
  (exit 2) unless it can resume it; a checkpoint that does not fit stops it with exit 3; either way the
  first run's config.yml and metrics.jsonl stay byte for byte. The same command again resumes the finished
  run and has nothing to do."""
  first = [*TINY, "model.backend=flax", "run_name=r", "train.steps=4", "train.log_every=2"]
  r = cli(first, tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  run = tmp_path / "r"
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]  # the trained weights, kept
  before = _snapshot(run)
  for extra, code, message in [
      (["checkpoint.enabled=false"], 2, "already holds another run (2 logged step(s), the last step 4; "
                                        "checkpoint steps 4) and this run has checkpoints off"),
      (["model.n_layers=2"], 3, "does not fit this model"),
  ]:
    r = cli([*first, "train.steps=8", *extra], tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and message in lines[0], r.stderr[-2000:]
    assert _snapshot(run) == before
  r = cli(first, tmp_path)
  assert r.returncode == 0 and "is already at step 4 of train.steps=4: nothing to train" in r.stdout, r.stderr
  assert _snapshot(run) == before


def test_a_resume_that_would_ignore_other_starting_weights_is_refused(tmp_path):
  """A run started from checkpoint.load_params=A. The same run_name with load_params=B (say a fine-tune of
  another converted model) would resume A's run and ignore B: refused in one line, exit 2, nothing changed.
  With A again (a requeue of the same command) or without load_params, it resumes."""
  src = [*TINY, "model.backend=flax", "run_name=src", "train.steps=2", "checkpoint.every=1", "checkpoint.keep=0"]
  assert cli(src, tmp_path).returncode == 0
  a, b = tmp_path / "src" / "checkpoints" / "1", tmp_path / "src" / "checkpoints" / "2"
  ft = [*TINY, "model.backend=flax", "run_name=ft", "train.log_every=1"]
  r = cli([*ft, "train.steps=2", f"checkpoint.load_params={a}"], tmp_path)
  assert r.returncode == 0 and f"loaded parameters from {a}" in r.stdout, r.stderr[-2000:]
  before = _snapshot(tmp_path / "ft")
  r = cli([*ft, "train.steps=3", f"checkpoint.load_params={b}"], tmp_path)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert f"holds a run that started from checkpoint.load_params={a} (" in lines[0]
  assert f"resuming it would ignore checkpoint.load_params={b}; give this run its own run_name=..." in lines[0]
  assert _snapshot(tmp_path / "ft") == before
  r = cli([*ft, "train.steps=3", f"checkpoint.load_params={a}"], tmp_path)
  assert r.returncode == 0 and "resumed from checkpoint step 2" in r.stdout, r.stderr[-2000:]
  r = cli([*ft, "train.steps=4"], tmp_path)
  assert r.returncode == 0 and "resumed from checkpoint step 3" in r.stdout, r.stderr[-2000:]
  # a run that started fresh is not resumed under the name of other starting weights either
  r = cli([*ft, "run_name=src", "train.steps=3", f"checkpoint.load_params={a}"], tmp_path)
  assert r.returncode == 2 and "holds a run that started from a fresh initialization" in r.stderr, r.stderr[-2000:]


def test_a_directory_holding_a_run_without_checkpoints_is_refused(tmp_path):
  args = [*TINY, "model.backend=flax", "run_name=r", "train.steps=2", "train.log_every=1", "checkpoint.enabled=false"]
  assert cli(args, tmp_path).returncode == 0
  before = _snapshot(tmp_path / "r")
  r = cli([*TINY, "model.backend=flax", "run_name=r", "train.steps=2"], tmp_path)  # checkpoints on: none there
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert "already holds another run (2 logged step(s), the last step 2; no checkpoint) and it has no " \
         "checkpoint to resume from (and its config.yml differs from this run's config); give this run its own " \
         "run_name=..." in lines[0]
  assert _snapshot(tmp_path / "r") == before
  # The same command again (an attempt with nothing to resume, e.g. killed before its first save) starts over.
  r = cli(args, tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  assert [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_checkpoint_error_after_the_run_directory_was_made_leaves_nothing(tmp_path):
  bogus = tmp_path / "not-a-checkpoint"
  bogus.mkdir()
  out = tmp_path / "out"
  r = cli([*TINY, "model.backend=flax", "run_name=r", "train.steps=2", f"checkpoint.load_params={bogus}"], out)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 3 and len(lines) == 1 and "not a checkpoint" in lines[0], r.stderr[-2000:]
  assert not (out / "r").exists()
