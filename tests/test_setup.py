"""scripts/setup.sh and the Makefile: where Transformer Engine's JAX extension comes from (a prebuilt wheel for
this Python, a build with a CUDA toolkit, or nowhere: then set-up succeeds without TE and says so in one line),
the stamp that records that choice, and `make test`'s skip reasons. The full set-up (minutes: it installs JAX)
is not run here; the script runs against a stand-in venv whose `python -m pip` only logs what it is asked."""

import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TE = "2.20.2"
CP = f"cp{sys.version_info[0]}{sys.version_info[1]}"
WHEEL = f"transformer_engine_jax-{TE}-{CP}-{CP}-linux_{sysconfig.get_platform().split('-')[-1]}.whl"


def _exe(path: Path, body: str) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("#!/bin/sh\n" + body)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return path


def _repo(tmp_path: Path, docker_wheel: bool = False) -> Path:
  """A clone's shape without ../shared: scripts/setup.sh, pyproject.toml, docker/wheels/."""
  repo = tmp_path / "clone"
  (repo / "scripts").mkdir(parents=True)
  shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts")
  shutil.copy(ROOT / "pyproject.toml", repo)
  (repo / "docker" / "wheels").mkdir(parents=True)
  if docker_wheel:
    (repo / "docker" / "wheels" / WHEEL).write_bytes(b"")
  return repo


def _toolkit(tmp_path: Path) -> Path:
  """What the build needs of a CUDA toolkit: nvcc and the headers whose absence was the gcc error."""
  cuda = tmp_path / "cuda"
  _exe(cuda / "bin" / "nvcc", "exit 0\n")
  (cuda / "include" / "crt").mkdir(parents=True)
  (cuda / "include" / "crt" / "host_defines.h").write_text("")
  return cuda


def _env(**kw) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("MAXLM_NO_TE", "MAXLM_TE_WHEELS", "CUDA_HOME")}
  return {**env, "PYTHON": sys.executable, **kw}


def _plan(repo: Path, tmp_path: Path, **env) -> str:
  r = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), "--te-plan", str(tmp_path / "no-venv")],
                     env=_env(**env), capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and r.stderr == "", r.stderr
  assert not (tmp_path / "no-venv").exists()  # a plan creates nothing
  return r.stdout.strip()


def test_plan_a_wheel_for_this_python_first(tmp_path):
  repo = _repo(tmp_path)
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  (wheels / f"transformer_engine_jax-{TE}-cp39-cp39-linux_x86_64.whl").write_bytes(b"")  # another Python's
  cuda = _toolkit(tmp_path)
  assert _plan(repo, tmp_path, MAXLM_TE_WHEELS=str(wheels), CUDA_HOME=str(cuda)) == f"build {cuda}"
  (wheels / WHEEL).write_bytes(b"")
  assert _plan(repo, tmp_path, MAXLM_TE_WHEELS=f"{tmp_path}/none:{wheels}", CUDA_HOME=str(cuda)) == \
      f"wheel {wheels / WHEEL}"
  assert _plan(repo, tmp_path, MAXLM_TE_WHEELS=str(wheels), MAXLM_NO_TE="1") == "skip MAXLM_NO_TE=1"


def test_plan_a_clone_without_shared_takes_the_wheel_it_carries(tmp_path):
  """The default folders are ../shared/wheels (absent beside a clone) and the repository's docker/wheels."""
  repo = _repo(tmp_path, docker_wheel=True)
  assert _plan(repo, tmp_path, CUDA_HOME="/nonexistent") == f"wheel {repo / 'docker' / 'wheels' / WHEEL}"
  assert (ROOT / "docker" / "wheels" / f"transformer_engine_jax-{TE}-cp311-cp311-linux_x86_64.whl").is_file()


def test_plan_without_toolkit_or_wheel_is_none_and_says_why(tmp_path):
  repo = _repo(tmp_path)
  plan = _plan(repo, tmp_path, CUDA_HOME="/nonexistent")
  assert plan.startswith("none no CUDA toolkit") and "CUDA_HOME=/nonexistent" in plan and CP in plan
  headers_missing = _toolkit(tmp_path)
  (headers_missing / "include" / "crt" / "host_defines.h").unlink()  # nvcc alone cannot build TE
  assert _plan(repo, tmp_path, CUDA_HOME=str(headers_missing)).startswith("none ")


def _fake_venv(tmp_path: Path, fail_wheel: bool = False) -> tuple[Path, Path]:
  """A venv whose python runs `-c` for real and logs every `-m pip` call (`pip show` finds nothing)."""
  venv, log = tmp_path / "venv", tmp_path / "pip.log"
  _exe(venv / "bin" / "python",
       f'if [ "$1" = -m ] && [ "$2" = pip ]; then\n  shift 2; echo "$*" >> {log}\n'
       f'  case "$1" in show) exit 1 ;; wheel) echo "gcc: crt/host_defines.h: No such file"; '
       f'exit {1 if fail_wheel else 0} ;; esac\n  exit 0\nfi\nexec {sys.executable} "$@"\n')
  return venv, log


def _setup(repo: Path, venv: Path, **env) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), str(venv)], env=_env(**env),
                        capture_output=True, text=True, timeout=60)


def test_setup_without_toolkit_or_wheel_succeeds_without_te_in_one_line(tmp_path):
  repo = _repo(tmp_path)
  venv, log = _fake_venv(tmp_path)
  r = _setup(repo, venv, CUDA_HOME="/nonexistent")
  assert r.returncode == 0 and r.stderr == "", r.stderr
  lines = r.stdout.splitlines()
  assert len(lines) == 2, r.stdout
  assert lines[0].startswith("setup: no CUDA toolkit") and "installed without Transformer Engine" in lines[0]
  assert "to get TE" in lines[0] and "CUDA_HOME" in lines[0] and "MAXLM_TE_WHEELS" in lines[0]
  assert lines[1] == f"setup: ready in {venv} (no Transformer Engine)"
  calls = [c for c in log.read_text().splitlines() if c.split()[0] in ("install", "wheel")]
  assert any("-e " in c for c in calls) and any("jax==" in c for c in calls)  # maxlm and JAX were installed
  assert not [c for c in calls if "transformer" in c or "nvidia" in c or c.startswith("wheel")]  # nothing of TE
  # XLA:GPU's compiler for `maxlm plan --devices N` (maxlm/plan/target.py): the CUDA plugin of this jaxlib, in a
  # folder of the venv, not in it
  jaxlib = importlib.metadata.version("jaxlib")
  assert f"install -q --no-deps --target {venv}/maxlm-gpu-compiler jax-cuda13-plugin=={jaxlib} " \
         f"jax-cuda13-pjrt=={jaxlib}" in calls
  assert (venv / ".maxlm-ready").read_text().strip().endswith("-none")
  # the stamp: a second run does nothing; a wheel that appears later is picked up
  log.unlink()
  assert _setup(repo, venv, CUDA_HOME="/nonexistent").stdout == "" and not log.exists()
  (repo / "docker" / "wheels" / WHEEL).write_bytes(b"")
  r = _setup(repo, venv, CUDA_HOME="/nonexistent")
  assert r.returncode == 0 and f"Transformer Engine {TE} from {repo / 'docker' / 'wheels' / WHEEL}" in r.stdout
  assert f"install -q --no-deps --no-index {repo / 'docker' / 'wheels' / WHEEL}" in log.read_text()
  assert (venv / ".maxlm-ready").read_text().strip().endswith("-wheel")


def test_setup_skips_the_gpu_compiler_when_asked(tmp_path):
  repo = _repo(tmp_path)
  venv, log = _fake_venv(tmp_path)
  r = _setup(repo, venv, CUDA_HOME="/nonexistent", MAXLM_NO_GPU_COMPILER="1")
  assert r.returncode == 0 and "jax-cuda13" not in log.read_text()


def test_a_failed_build_is_one_line_naming_the_log_and_the_ways_out(tmp_path):
  repo = _repo(tmp_path)
  venv, _ = _fake_venv(tmp_path, fail_wheel=True)
  cuda = _toolkit(tmp_path)
  r = _setup(repo, venv, CUDA_HOME=str(cuda))
  assert r.returncode == 1
  assert "host_defines" not in r.stdout + r.stderr  # the compiler's output is in the log only
  err = r.stderr.splitlines()
  assert len(err) == 1 and err[0].startswith("setup: error: building TE's JAX extension") and \
      str(venv / "te-build.log") in err[0] and "MAXLM_NO_TE=1" in err[0], r.stderr
  assert "host_defines" in (venv / "te-build.log").read_text()
  assert not (venv / ".maxlm-ready").exists()  # not stamped: the next run tries again


def test_make_test_lists_skip_reasons():
  r = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  if r.returncode != 0 and "make: not found" in r.stderr:
    pytest.skip("no make")
  pytest_line = next(line for line in r.stdout.splitlines() if " -m pytest " in line)
  assert " -rs " in f"{pytest_line} "
