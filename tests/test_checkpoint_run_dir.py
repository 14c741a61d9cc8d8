"""The run directory's config history (`maxlm.checkpoint.run_dir.record_config`): a resume with changed keys keeps
the previous config.yml as config.to-step-N.yml and logs the changes with the step; an unchanged resume writes
nothing more; and on a real run resumed with a new learning rate, `maxlm eval`/`generate`'s loader uses the latest
config. (Who may use a run directory, `claim`, is tested end to end in tests/test_cli_train.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from maxlm.api import Model
from maxlm.checkpoint.run_dir import record_config

ROOT = Path(__file__).resolve().parent.parent


def _yaml(lr: float, steps: int) -> str:
  return yaml.safe_dump({"optim": {"learning_rate": lr}, "train": {"steps": steps}, "run_name": "r"})


def test_each_changed_resume_keeps_the_previous_config_and_logs_the_change(tmp_path):
  assert record_config(tmp_path, _yaml(1e-3, 10), 0) is None  # the first start
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yml"]
  assert record_config(tmp_path, _yaml(1e-3, 10), 4) is None  # resumed unchanged: nothing more
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yml"]
  kept = record_config(tmp_path, _yaml(5e-4, 20), 10)  # resumed at 10 with two keys changed
  assert kept == tmp_path / "config.to-step-10.yml"
  assert yaml.safe_load(kept.read_text())["optim"]["learning_rate"] == 1e-3  # the steps up to 10 had it
  assert yaml.safe_load((tmp_path / "config.yml").read_text())["optim"]["learning_rate"] == 5e-4
  # an attempt from step 10 that saved nothing, then another resume at 10 with another change: the config that
  # produced steps 1-10 stays kept; the log has both changes
  assert record_config(tmp_path, _yaml(2e-4, 20), 10) == kept
  assert yaml.safe_load(kept.read_text())["optim"]["learning_rate"] == 1e-3
  record_config(tmp_path, _yaml(2e-4, 30), 20)
  history = [json.loads(line) for line in (tmp_path / "config_history.jsonl").read_text().splitlines()]
  assert [(h["step"], h["changes"], h["kept"]) for h in history] == [
      (10, ["optim.learning_rate: 0.001 -> 0.0005", "train.steps: 10 -> 20"], "config.to-step-10.yml"),
      (10, ["optim.learning_rate: 0.0005 -> 0.0002"], "config.to-step-10.yml"),
      (20, ["train.steps: 20 -> 30"], "config.to-step-20.yml")]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.to-step-10.yml", "config.to-step-20.yml",
                                                        "config.yml", "config_history.jsonl"]


# the embedded corpus (a model loads with its tokenizer), a tiny model
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "model.remat=none", "model.backend=flax", "data.seq_len=16", "data.global_batch_size=4",
        "train.log_every=2", "train.eval_every=0", "run_name=r"]


def test_a_resume_with_a_new_learning_rate_keeps_the_old_config_and_eval_uses_the_new(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}

  def train(*args):
    r = subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp_path}", *TINY, *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout

  train("train.steps=2", "optim.learning_rate=0.001")
  out = train("train.steps=4", "optim.learning_rate=0.0005")
  run = tmp_path / "r"
  assert "resumed from checkpoint step 2" in out and "kept as config.to-step-2.yml" in out
  assert yaml.safe_load((run / "config.to-step-2.yml").read_text())["optim"]["learning_rate"] == 0.001
  assert yaml.safe_load((run / "config.yml").read_text())["optim"]["learning_rate"] == 0.0005
  [entry] = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
  assert entry["step"] == 2 and entry["changes"] == ["optim.learning_rate: 0.001 -> 0.0005",
                                                     "train.steps: 2 -> 4"]
  assert Model.load(run).config.optim.learning_rate == 0.0005  # the loader of `maxlm eval` and `generate`
