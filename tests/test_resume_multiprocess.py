"""Two training processes (jax.distributed on CPU): SIGTERM to one of them stops both at the same
step boundary with a checkpoint holding both processes' data-iterator states, and exit code 75."""

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

from maxlm.checkpoint import EXIT_PREEMPTED

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
