"""`python -m maxlm.train` end to end: run directory contents, metrics, exit codes on bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=4",
        "model.vocab_size=128"]


def cli(args, tmp_path, env=None):
  e = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
       **(env or {})}
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
  assert "step 6/6" in r.stdout and "mesh {'data': 1, 'fsdp': 2, 'tensor': 1}" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["train.stpes=3"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
    (["model.d_model=big"], "config key 'model.d_model' expects int"),
    (["model.precision=fp8_delayed", "model.backend=flax"], "needs model.backend=te"),
    (["mesh.data=3"], "mesh:"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
  r = cli([*TINY, "run_name=bad", *args], tmp_path)
  assert r.returncode == 2
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], r.stderr
  assert not (tmp_path / "bad").exists()
