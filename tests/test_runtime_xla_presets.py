"""XLA flag presets: every preset's flags start a backend of the installed jaxlib, `auto` picks from the
driver's GPU list, the user's XLA_FLAGS win, and the flags are in place before the backend starts."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maxlm.config import ConfigError, load_config
from maxlm.runtime import xla_presets
from maxlm.runtime.xla_presets import PRESETS, apply, detect_gpu, merge, preset_for, resolve

ROOT = Path(__file__).resolve().parent.parent
START_BACKEND = "import jax; print(jax.device_count())"


def start_backend(xla_flags: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", START_BACKEND], env=env, capture_output=True, text=True,
                        timeout=300)


@pytest.mark.parametrize("preset", [p for p in PRESETS if PRESETS[p]])
def test_every_preset_flag_is_accepted_by_the_installed_jaxlib(preset):
  r = start_backend(" ".join(PRESETS[preset]))
  assert r.returncode == 0 and r.stdout.strip() == "1", f"{preset}: {r.stderr[-2000:]}"


def test_a_flag_jaxlib_does_not_know_fails_that_start():
  """The control for the test above: XLA refuses an unknown flag at backend start and names it."""
  r = start_backend(" ".join(PRESETS["hopper"]) + " --xla_gpu_flag_jaxlib_dropped=true")
  assert r.returncode != 0
  assert re.search(r"Unknown flags? in XLA_FLAGS: --xla_gpu_flag_jaxlib_dropped=true", r.stderr), r.stderr[-2000:]


def test_presets_are_short_unique_xla_flags():
  assert PRESETS["none"] == ()
  for name, flags in PRESETS.items():
    names = [f.split("=", 1)[0] for f in flags]
    assert len(names) == len(set(names)), name
    assert all(re.fullmatch(r"--xla_[a-z0-9_]+=\S*", f) for f in flags), name
    assert len(flags) <= 12, f"{name}: a preset is a short list"


def test_each_flag_has_a_comment_with_its_measured_effect():
  """Next to each flag (the comment lines right above it, or on its line) the module says what it does
  and its measured effect ("not measured yet" until measured)."""
  lines = (ROOT / "maxlm" / "runtime" / "xla_presets.py").read_text().splitlines()
  for flag in {f for flags in PRESETS.values() for f in flags}:
    for i, line in enumerate(lines):
      if f'"{flag}"' not in line:
        continue
      comment = line.partition("#")[2]
      j = i - 1
      while not comment and lines[j].strip().startswith("#"):
        comment = lines[j] + comment
        j -= 1
      while lines[j].strip().startswith("#"):
        comment = lines[j] + comment
        j -= 1
      assert "measured" in comment and len(comment.split()) >= 5, (flag, comment)


@pytest.mark.parametrize("gpu, want", [
    (("NVIDIA H100 80GB HBM3", "9.0"), "hopper"),
    (("NVIDIA H200", "9.0"), "hopper"),
    (("NVIDIA GH200 480GB", "9.0"), "hopper"),
    (("NVIDIA B200", "10.0"), "blackwell"),
    (("NVIDIA B300 SXM6 AC", "10.3"), "blackwell"),
    (("NVIDIA A100-SXM4-80GB", "8.0"), "none"),
    (("NVIDIA GeForce RTX 5090", "12.0"), "none"),
    (("NVIDIA H200", ""), "hopper"),  # from /proc: a name without a compute capability
    (("NVIDIA B200", ""), "blackwell"),
    (("NVIDIA A100-PCIE-40GB", ""), "none"),
    (("NVIDIA H20", ""), "hopper"),
    (("NVIDIA H2000X", ""), "none"),  # whole words only
    (None, "none"),
])
def test_auto_picks_from_the_gpu(gpu, want):
  assert preset_for(gpu) == want


def test_resolve_explains_the_choice():
  assert resolve("auto", ("NVIDIA H200", "9.0")) == ("hopper", "auto: NVIDIA H200, compute capability 9.0")
  assert resolve("auto", ()) == ("none", "auto: no NVIDIA GPU")
  assert resolve("blackwell", ("NVIDIA H200", "9.0")) == ("blackwell", "set")
  with pytest.raises(ValueError, match="xla.preset"):
    resolve("ampere")


def _fake_nvidia_smi(tmp_path, monkeypatch, output: str, rc: int = 0):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  script = bin_dir / "nvidia-smi"
  script.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\nexit {rc}\n")
  script.chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_detect_reads_nvidia_smi_first_gpu(tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  _fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA H200, 9.0\nNVIDIA H200, 9.0\n")
  assert detect_gpu() == ("NVIDIA H200", "9.0")
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert detect_gpu() == ("NVIDIA H200", "9.0")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the user asked for the CPU: no GPU preset
  assert detect_gpu() is None


def test_detect_falls_back_to_proc_when_nvidia_smi_fails(tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  _fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA-SMI has failed", rc=9)
  gpu_dir = tmp_path / "gpus" / "0000:19:00.0"
  gpu_dir.mkdir(parents=True)
  (gpu_dir / "information").write_text("Model: \t\t NVIDIA B200\nIRQ:   123\nBus Type: PCIe\n")
  monkeypatch.setattr(xla_presets, "GPU_INFO_GLOB", str(tmp_path / "gpus" / "*" / "information"))
  assert detect_gpu() == ("NVIDIA B200", "")
  monkeypatch.setattr(xla_presets, "GPU_INFO_GLOB", str(tmp_path / "none" / "*" / "information"))
  assert detect_gpu() is None


def test_merge_user_flags_win_by_name():
  preset = ("--xla_a=1", "--xla_b=true", "--xla_c=5")
  merged, added, kept = merge("--xla_b=false --xla_force_host_platform_device_count=2 --xla_c=5", preset)
  assert added == ["--xla_a=1"]
  assert kept == ["--xla_b=false"]  # --xla_c=5 is the same value: nothing overridden
  assert merged == "--xla_a=1 --xla_b=false --xla_force_host_platform_device_count=2 --xla_c=5"
  assert merge("", preset) == ("--xla_a=1 --xla_b=true --xla_c=5", list(preset), [])
  assert merge("--xla_x=1", ()) == ("--xla_x=1", [], [])


def test_apply_sets_xla_flags_once_and_keeps_the_users(monkeypatch):
  monkeypatch.setattr(xla_presets, "backend_started", lambda: False)
  mine = "--xla_gpu_enable_latency_hiding_scheduler=false"  # the preset sets it true: the user's value wins
  monkeypatch.setenv("XLA_FLAGS", mine)
  line = apply("auto", ("NVIDIA H200", "9.0"))
  flags = os.environ["XLA_FLAGS"].split()
  assert flags[-1] == mine and flags.count(mine) == 1
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
  assert set(flags[:-1]) == set(PRESETS["hopper"]) - {"--xla_gpu_enable_latency_hiding_scheduler=true"}
  assert line.startswith("xla.preset=hopper (auto: NVIDIA H200, compute capability 9.0): XLA_FLAGS += ")
  assert line.endswith(f"(yours kept: {mine})")
  before = os.environ["XLA_FLAGS"]
  assert apply("hopper").startswith("xla.preset=hopper (set): all its flags")  # idempotent
  assert os.environ["XLA_FLAGS"] == before
  monkeypatch.setenv("XLA_FLAGS", "--xla_x=1")
  assert apply("none") is None and apply("auto", ()) is None
  assert os.environ["XLA_FLAGS"] == "--xla_x=1"


def test_apply_after_the_backend_started_changes_nothing_and_says_so(monkeypatch):
  monkeypatch.setattr(xla_presets, "backend_started", lambda: True)
  monkeypatch.setitem(sys.modules, "jax", sys.modules.get("jax") or object())
  monkeypatch.setenv("XLA_FLAGS", "--xla_x=1")
  line = apply("hopper")
  assert "not applied: the JAX backend had started already" in line
  assert os.environ["XLA_FLAGS"] == "--xla_x=1"


def test_apply_runs_before_the_backend_reads_xla_flags(tmp_path):
  """In a fresh process: a preset's flag set by apply() is what the backend starts with (here the CPU
  device count, the one flag whose effect a CPU backend shows)."""
  script = ("import os; from maxlm.runtime import xla_presets as x\n"
            "x.PRESETS['hopper'] = ('--xla_force_host_platform_device_count=3',)\n"
            "print(x.apply('hopper'))\n"
            "import jax; print(jax.device_count())\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run([sys.executable, "-c", script], env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split("\n")[:2] == [
      "xla.preset=hopper (set): XLA_FLAGS += --xla_force_host_platform_device_count=3", "3"]


def test_config_key():
  assert load_config([]).xla.preset == "auto"
  assert load_config(["xla.preset=hopper"]).xla.preset == "hopper"
  with pytest.raises(ConfigError, match="'xla.preset' must be one of auto, none, hopper, blackwell"):
    load_config(["xla.preset=ampere"])


@pytest.mark.slow
def test_train_applies_the_preset_and_logs_it(tmp_path):
  tiny = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
          "model.n_layers=1", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=2",
          "model.vocab_size=128", "model.backend=flax", "train.steps=0", "train.eval_every=0"]  # the backend starts, no step
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_gpu_enable_latency_hiding_scheduler=false"}
  r = subprocess.run([sys.executable, "-m", "maxlm.train", f"output_dir={tmp_path}", "xla.preset=hopper", *tiny],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = [ln for ln in r.stdout.splitlines() if ln.startswith("maxlm: xla.preset=")]
  assert len(lines) == 1 and lines[0].startswith("maxlm: xla.preset=hopper (set): XLA_FLAGS += --xla_gpu_"), r.stdout
  assert lines[0].endswith("(yours kept: --xla_gpu_enable_latency_hiding_scheduler=false)")
