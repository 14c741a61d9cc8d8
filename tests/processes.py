"""Test helper: a run of N training processes on this machine (jax.distributed over localhost, Gloo collectives),
one CPU device each, started as `python -m maxlm.train` (or tests/resume_launcher.py for its hooks) with explicit
distributed keys, as tests/test_runtime_distributed.py starts its pairs."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST_CPU = "--xla_backend_optimization_level=0"  # as the suite compiles (conftest)
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "data.type=synthetic", "data.seq_len=16", "model.vocab_size=128", "model.backend=flax",
        "train.eval_every=0", "checkpoint.enabled=false", "optim.warmup_steps=1"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(n: int, args: list[str], tmp_path: Path, env: list[dict] | None = None, launcher: bool = False,
          timeout_s: int = 60) -> list[subprocess.Popen]:
  """N processes of one run (process i gets env[i] on top of this one's); stdout and stderr to
  tmp_path/p<i>.out and .err."""
  port = free_port()
  procs = []
  for i in range(n):
    e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # JAX warns about proxies at start
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", e.get("XLA_FLAGS", ""))
    e.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} {FAST_CPU}".strip(), **((env or [{}] * n)[i])})
    keys = [f"distributed.coordinator_address=127.0.0.1:{port}", f"distributed.num_processes={n}",
            f"distributed.process_id={i}", f"distributed.initialization_timeout_s={timeout_s}"]
    entry = [str(ROOT / "tests" / "resume_launcher.py")] if launcher else ["-m", "maxlm.train"]
    with open(tmp_path / f"p{i}.out", "w") as out, open(tmp_path / f"p{i}.err", "w") as err:
      procs.append(subprocess.Popen([sys.executable, *entry, f"output_dir={tmp_path / 'runs'}", *TINY, *keys, *args],
                                    cwd=ROOT, env=e, stdout=out, stderr=err))
  return procs


def finish(procs: list[subprocess.Popen], limit_s: float) -> list[int]:
  """Every process's exit code; all must end within limit_s (else all are killed and the test fails)."""
  end = time.monotonic() + limit_s
  try:
    return [p.wait(timeout=max(0.1, end - time.monotonic())) for p in procs]
  except subprocess.TimeoutExpired:
    raise AssertionError(f"a process did not end within {limit_s} s") from None
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def output(tmp_path: Path, i: int) -> tuple[str, str]:
  return (tmp_path / f"p{i}.out").read_text(), (tmp_path / f"p{i}.err").read_text()


def errors(text: str) -> list[str]:
  """The `maxlm: error:` and traceback lines of a process's output."""
  return [ln for ln in text.splitlines() if "maxlm: error:" in ln or "Traceback" in ln]
