"""The installed package works outside the source tree (`make test-wheel`, marker `wheel`; CI runs it).

`pip wheel .` builds maxlm's wheel; a fresh venv outside the checkout installs it with its dependencies (no
Transformer Engine: the Flax backend runs on a CPU). There, from a directory with no configs/ or maxlm/ beside
it, the commands a new user runs first must work: a short train of the shipped default config, a dry run of
llama8b, `maxlm doctor` and the library import.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# Building the wheel and a fresh venv with its dependencies can pass the suite's 15-minute limit on a cold pip cache.
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(2400)]
ROOT = Path(__file__).resolve().parent.parent


def _sh(args, cwd, env=None, timeout=1200):
  r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, f"{args}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
  return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("wheel")
  src = tmp / "src"  # what the wheel is built from (a build in the checkout would leave build/ there)
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(ROOT / "maxlm", src / "maxlm", ignore=shutil.ignore_patterns("__pycache__"))
  _sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src)], tmp)
  wheel = next((tmp / "dist").glob("maxlm-*.whl"))
  venv = tmp / "venv"
  _sh([sys.executable, "-m", "venv", str(venv)], tmp)
  # The same JAX and Flax as scripts/setup.sh (pip takes them from its cache when it has them).
  _sh([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel), "jax==0.10.2", "jaxlib==0.10.2",
       "flax==0.12.8"], tmp)
  work = tmp / "work"  # no configs/ or maxlm/ here
  work.mkdir()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTHON"))}
  env.update(JAX_PLATFORMS="cpu", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
  return wheel, venv, work, env


def test_the_wheel_carries_the_configs_and_assets(installed):
  names = zipfile.ZipFile(installed[0]).namelist()
  for want in ("maxlm/configs/llama8b.yml", "maxlm/configs/default.yml", "maxlm/configs/convergence/cpu.yml",
               "maxlm/configs/convergence/golden/cpu/default.json", "maxlm/assets/austen_sp512.model"):
    assert want in names


def test_installed_commands_run_outside_the_tree(installed):
  _, venv, work, env = installed
  maxlm = str(venv / "bin" / "maxlm")
  r = _sh([maxlm, "train", "config=default.yml", "train.steps=3", "train.log_every=1"], work, env)
  assert "step 3/3" in r.stdout and (work / "runs" / "default" / "checkpoints" / "3").is_dir()
  r = _sh([maxlm, "train", "config=llama8b.yml", "--dry-run"], work, env)
  assert "llama" in r.stdout and "memory" in r.stdout
  r = _sh([maxlm, "doctor"], work, env)  # exit 0: no check failed (the GPU ones say skipped)
  assert " 0 fail" in r.stdout
  r = _sh([str(venv / "bin" / "python"), "-c", "from maxlm import Model; import maxlm; print(maxlm.__file__)"],
          work, env)
  assert str(venv) in r.stdout
