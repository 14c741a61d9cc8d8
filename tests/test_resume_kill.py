"""Real training subprocesses (one CPU device, the embedded corpus through Grain) are killed with
SIGKILL (between checkpoints, in the middle of an async save, at a random moment) or stopped with
SIGTERM / SIGINT, then restarted. Each restart resumes from the last complete checkpoint, and every
step's loss, gradient norm and batch, and the final state, are bit-identical to an uninterrupted run."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxlm.checkpoint import EXIT_PREEMPTED, complete_steps
from maxlm.config import ModelConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "tests" / "resume_launcher.py"
STEPS = 20
ARGS = ["model.backend=flax", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
        "model.head_dim=16", "model.ffn_dim=64", "model.n_layers=1", "model.remat=none", "data.seq_len=32",
        "data.global_batch_size=4", f"train.steps={STEPS}", "train.log_every=1", "checkpoint.enabled=true",
        "checkpoint.every=4", "checkpoint.keep=2", "run_name=r"]


class Run:
  """One launcher subprocess training into `root`/r, logging to its own file. All runs share one
  persistent XLA compilation cache: the reference run compiles, the others load the same executables."""

  count = 0
  cache: Path | None = None

  def __init__(self, root: Path, extra: tuple[str, ...] = (), devices: int = 1, **env):
    Run.count += 1
    self.root, self.log = root, root / f"log{Run.count}.txt"
    root.mkdir(parents=True, exist_ok=True)
    e = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXLM_TEST_TRACE": str(root / "trace.jsonl"),
         "JAX_COMPILATION_CACHE_DIR": str(Run.cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         **{f"MAXLM_TEST_{k.upper()}": str(v) for k, v in env.items()}}
    # one device (or `devices` simulated ones); the other flags stay (conftest's fast CPU compile: the reference
    # compiles in half the time)
    e["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    if devices > 1:
      e["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    self.complete_at_start = complete_steps(self.ckpt_dir)
    self._trace_start = len(_trace(root))
    with open(self.log, "w") as out:
      self.proc = subprocess.Popen([sys.executable, str(LAUNCHER), f"output_dir={root}", *ARGS, *extra], cwd=ROOT,
                                   env=e, stdout=out, stderr=subprocess.STDOUT)

  @property
  def ckpt_dir(self) -> Path:
    return self.root / "r" / "checkpoints"

  def text(self) -> str:
    return self.log.read_text()

  def wait_for(self, cond, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      got = cond()
      if got:
        return got
      assert self.proc.poll() is None, f"exited early ({self.proc.returncode}):\n{self.text()[-3000:]}"
      time.sleep(0.02)
    self.proc.kill()
    raise AssertionError(f"timed out:\n{self.text()[-3000:]}")

  def last_step(self) -> int:
    """The latest step this run has started (0 before its first)."""
    return max((s for s, _ in _trace(self.root)[self._trace_start:]), default=0)

  def signal(self, sig) -> int:
    self.proc.send_signal(sig)
    return self.proc.wait(timeout=120)

  def finish(self) -> int:
    return self.proc.wait(timeout=300)

  def check_resumed(self) -> None:
    """It resumed from the newest checkpoint complete when it started (or started fresh)."""
    text = self.text()
    if self.complete_at_start:
      assert f"resumed from checkpoint step {self.complete_at_start[-1]} " in text, text
    else:
      assert "resumed from" not in text, text


def _trace(root: Path) -> list[tuple[int, str]]:
  out = []
  path = root / "trace.jsonl"
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      row = json.loads(line)
    except ValueError:  # a line cut by kill -9
      continue
    out.append((row["step"], row["batch"]))
  return out


def _metrics(root: Path) -> list[dict]:
  rows = []
  for line in (root / "r" / "metrics.jsonl").read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except ValueError:
      continue
  return rows


def _final_arrays(root: Path) -> dict:
  return json.loads((root / "r" / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())["arrays"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  Run.cache = tmp_path_factory.mktemp("xla-cache")
  root = tmp_path_factory.mktemp("reference")
  run = Run(root)
  assert run.finish() == 0, run.text()
  losses = {r["step"]: (r["loss"], r["grad_norm"]) for r in _metrics(root)}
  batches = dict(_trace(root))
  assert sorted(losses) == sorted(batches) == list(range(1, STEPS + 1))
  return {"losses": losses, "batches": batches, "final": _final_arrays(root)}


def _same_as_reference(root: Path, ref: dict) -> None:
  """Every logged row and traced batch, including steps redone after a restart, and the final state."""
  rows, trace = _metrics(root), _trace(root)
  assert {r["step"] for r in rows} == {s for s, _ in trace} == set(range(1, STEPS + 1))
  for r in rows:
    assert (r["loss"], r["grad_norm"]) == ref["losses"][r["step"]], r["step"]
  for step, digest in trace:
    assert digest == ref["batches"][step], step
  assert _final_arrays(root) == ref["final"]


def test_kill9_anywhere_then_resume_is_bit_identical(reference, tmp_path):
  # 1. between checkpoints, while training
  run = Run(tmp_path, step_sleep=0.1)
  run.wait_for(lambda: run.last_step() >= 6)
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  # 2. in the middle of an async save: every file written, the checkpoint not yet committed
  run = Run(tmp_path, step_sleep=0.05, slow_save=60)
  step = int(run.wait_for(lambda: "SAVE-COMMITTING " in run.text() and run.text().split("SAVE-COMMITTING ")[1]
                          .split()[0]))
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  run.check_resumed()
  tmp = list(run.ckpt_dir.glob(f"{step}.orbax-checkpoint-tmp*"))
  assert tmp and (tmp[0] / "maxlm_files.json").exists() and not (run.ckpt_dir / str(step)).exists()
  # 3. at a random moment after training started
  delay = random.Random().uniform(0.0, 1.2)
  print(f"random kill {delay:.2f} s after the first step")
  run = Run(tmp_path, step_sleep=0.1)
  run.wait_for(lambda: run.last_step() > 0)
  time.sleep(delay)
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL, f"finished before the kill at +{delay:.2f}s"
  run.check_resumed()
  # 4. to the end
  run = Run(tmp_path)
  assert run.finish() == 0, run.text()
  run.check_resumed()
  assert not list(run.ckpt_dir.glob("*.orbax-checkpoint-tmp*"))
  _same_as_reference(tmp_path, reference)


def test_sigterm_and_sigint_save_then_exit_75_and_resume_bit_identical(reference, tmp_path):
  for sig, after in ((signal.SIGTERM, 5), (signal.SIGINT, 11)):
    run = Run(tmp_path, step_sleep=0.1)
    run.wait_for(lambda: run.last_step() >= after)
    assert run.signal(sig) == EXIT_PREEMPTED, run.text()
    run.check_resumed()
    text = run.text()
    name = signal.Signals(sig).name
    assert f"received {name}: saving a checkpoint" in text
    stopped = int(text.split(f"{name} at step ")[1].split(":")[0])
    assert f"checkpoint step {stopped} saved in {run.ckpt_dir}" in text
    assert run.last_step() == stopped and complete_steps(run.ckpt_dir)[-1] == stopped
  run = Run(tmp_path)
  assert run.finish() == 0, run.text()
  run.check_resumed()
  _same_as_reference(tmp_path, reference)


def _whole(root: Path, **kw) -> dict:
  """An uninterrupted run's losses, batches and final arrays."""
  whole = Run(root, **kw)
  assert whole.finish() == 0, whole.text()
  return {"losses": {r["step"]: (r["loss"], r["grad_norm"]) for r in _metrics(root)},
          "batches": dict(_trace(root)), "final": _final_arrays(root)}


def test_kill9_then_resume_is_bit_identical_with_context_parallelism(reference, tmp_path):
  """The sequence split over 2 simulated devices (mesh.context=2: the packed rows reordered, attention over the
  ring): a run killed with SIGKILL between checkpoints resumes and ends bit-identical to an uninterrupted run on
  the same mesh, whose losses are the one-device run's within float32 noise."""
  levers, kw = ("mesh.context=2", "mesh.fsdp=1"), {"devices": 2}
  want = _whole(tmp_path / "whole", extra=levers, **kw)
  assert want["batches"] == reference["batches"]  # the same data
  # The first step (the same initial parameters; later steps may drift further through Adam): a mean over 4 x 32
  # tokens of logsumexp over V = 8192, sums of positive terms whose order the split changes, so at most
  # (V + tokens) ulps apart (the derivation of tests/test_parallel_sharding.py's LOSS_DIFF).
  first, ref_first = want["losses"][1][0], reference["losses"][1][0]
  assert abs(first - ref_first) <= (ModelConfig().vocab_size + 4 * 32) * 2.0 ** -24 * ref_first
  run = Run(tmp_path / "killed", extra=levers, step_sleep=0.1, **kw)
  run.wait_for(lambda: run.last_step() >= 6)
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  run = Run(tmp_path / "killed", extra=levers, **kw)
  assert run.finish() == 0, run.text()
  run.check_resumed()
  _same_as_reference(tmp_path / "killed", want)


@pytest.mark.parametrize("offload", ["none", "host"])
def test_kill9_then_resume_is_bit_identical_with_stochastically_rounded_bf16_moments(reference, tmp_path, offload):
  """bfloat16 moments with stochastic rounding (optim.moment_rounding's default), on the device and in host
  memory (optim.offload=host): a run killed with SIGKILL between checkpoints resumes from the last one and ends
  bit-identical to an uninterrupted run with the same options. The rounding's bits come from the step count
  and the parameter's index (maxlm/optim.py), so the resumed run draws the ones the uninterrupted run drew."""
  # compile.warm_start=false: each process traces its own step (a serialized executable would carry the first
  # process's program, hiding bits that do not come from the state: a key from the clock passed with it)
  levers = ("optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16", "optim.moment_rounding=stochastic",
            f"optim.offload={offload}", "compile.warm_start=false")
  whole = Run(tmp_path / "whole", extra=levers)
  assert whole.finish() == 0, whole.text()
  want = {"losses": {r["step"]: (r["loss"], r["grad_norm"]) for r in _metrics(tmp_path / "whole")},
          "batches": dict(_trace(tmp_path / "whole")), "final": _final_arrays(tmp_path / "whole")}
  assert want["batches"] == reference["batches"]  # the same data; only the optimizer differs
  moments = [v for k, v in want["final"].items() if ".mu[" in k or ".nu[" in k]
  assert moments and {dtype for _, dtype, _ in moments} == {"bfloat16"}
  run = Run(tmp_path / "killed", extra=levers, step_sleep=0.1)
  run.wait_for(lambda: run.last_step() >= 6)
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  run = Run(tmp_path / "killed", extra=levers)
  assert run.finish() == 0, run.text()
  run.check_resumed()
  _same_as_reference(tmp_path / "killed", want)


def test_kill9_then_resume_is_bit_identical_with_pipeline_stages(tmp_path, tmp_path_factory):
  """mesh.pipeline=2 on 2 devices (2 stages of one layer each, 2 micro-batches in flight): runs killed with
  SIGKILL between checkpoints and in the middle of an async save resume from the last complete checkpoint and
  end bit-identical to an uninterrupted pipelined run."""
  if Run.cache is None:  # this test alone: its own compilation cache
    Run.cache = tmp_path_factory.mktemp("xla-cache")
  pipelined = ("mesh.pipeline=2", "mesh.fsdp=1", "model.n_layers=2", "train.grad_accum=2")
  whole = Run(tmp_path / "whole", extra=pipelined, devices=2)
  assert whole.finish() == 0, whole.text()
  assert "mesh {'pipeline': 2, 'data': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}" in whole.text()
  want = {"losses": {r["step"]: (r["loss"], r["grad_norm"]) for r in _metrics(tmp_path / "whole")},
          "batches": dict(_trace(tmp_path / "whole")), "final": _final_arrays(tmp_path / "whole")}
  run = Run(tmp_path / "killed", extra=pipelined, devices=2, step_sleep=0.1)
  run.wait_for(lambda: run.last_step() >= 6)
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  run = Run(tmp_path / "killed", extra=pipelined, devices=2, step_sleep=0.05, slow_save=60)
  step = int(run.wait_for(lambda: "SAVE-COMMITTING " in run.text() and run.text().split("SAVE-COMMITTING ")[1]
                          .split()[0]))
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  run.check_resumed()
  assert not (run.ckpt_dir / str(step)).exists()
  run = Run(tmp_path / "killed", extra=pipelined, devices=2)
  assert run.finish() == 0, run.text()
  run.check_resumed()
  _same_as_reference(tmp_path / "killed", want)


def test_kill9_then_resume_is_bit_identical_with_experts_sharded(tmp_path, tmp_path_factory):
  """A mixture of experts (4 experts, top 2) with the experts split over mesh.expert=2 on 2 devices (each holds 2,
  the tokens exchanged by all-to-all): a run killed with SIGKILL between checkpoints resumes from the last one and
  ends bit-identical to an uninterrupted run on the same mesh."""
  if Run.cache is None:  # this test alone: its own compilation cache
    Run.cache = tmp_path_factory.mktemp("xla-cache")
  # compile.warm_start=false: each process traces its own step (as the bf16 moments' test above says why)
  sharded = ("model.moe.experts=4", "model.moe.top_k=2", "mesh.expert=2", "mesh.fsdp=1", "compile.warm_start=false")
  whole = Run(tmp_path / "whole", extra=sharded, devices=2)
  assert whole.finish() == 0, whole.text()
  assert "mesh {'pipeline': 1, 'data': 1, 'fsdp': 1, 'expert': 2, 'context': 1, 'tensor': 1}" in whole.text()
  want = {"losses": {r["step"]: (r["loss"], r["grad_norm"]) for r in _metrics(tmp_path / "whole")},
          "batches": dict(_trace(tmp_path / "whole")), "final": _final_arrays(tmp_path / "whole")}
  experts = [v for k, v in want["final"].items() if "moe" in k and "w1" in k]
  assert experts, sorted(want["final"])[:20]
  run = Run(tmp_path / "killed", extra=sharded, devices=2, step_sleep=0.1)
  run.wait_for(lambda: run.last_step() >= 6)
  run.proc.kill()
  assert run.proc.wait() == -signal.SIGKILL
  run = Run(tmp_path / "killed", extra=sharded, devices=2)
  assert run.finish() == 0, run.text()
  run.check_resumed()
  _same_as_reference(tmp_path / "killed", want)
