"""The container image: docker/Dockerfile built with rootful podman on a Debian + Python base made here.

scripts/build_image.sh builds it (the same Dockerfile as for the NVIDIA JAX base, with BASE_IMAGE set to
a local debootstrap image: CPU JAX and the prebuilt TE extension). Then, inside the image:
1   the image's metadata: ENTRYPOINT maxlm, CMD doctor, WORKDIR /workspace;
2   `podman run IMAGE` (the default command, `maxlm doctor`) exits 0 with the GPU checks skipped;
3   `maxlm train train.steps=5` as the built-in non-root user (uid 1000), with no network and the run
    directory a mounted host directory: on the host, metrics rows for steps 1..5 with finite losses, the
    resolved config, a checkpoint of step 5, all owned by uid 1000;
4   the stack inside: JAX is the CPU build pinned in docker/install.py, maxlm runs from its installed package
    (not editable), Transformer Engine imports, and `config=NAME` finds the configs shipped in it.
5   docker/install.py's decisions without an image (these run in `make test`): which changes of the base's
    stack fail the build, which versions are out of range, where a TE JAX extension is found (pip wheel
    and source-build layouts), and the link that lets TE find the base's pip cuDNN.

Marker `container` (tests 1-4): not part of `make test`; `make test-container` runs them (CI: after the main suite),
building the image first (cold 9 to 14 min here, warm 15 s plus the runs: times in docker/README.md).
MAXLM_TEST_IMAGE=<tag> uses an image built before instead. Skips, saying why, where podman cannot run.
"""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maxlm import cli

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "build_image.sh"
TAG = "localhost/maxlm:test"
UID = 1000  # the image's built-in user (docker/Dockerfile MAXLM_UID)
STEPS = 5

container = pytest.mark.container
# Cold, the image build alone takes 9 to 14 minutes here (docker/README.md), past the suite's 15-minute limit.
pytestmark = pytest.mark.timeout(2400)


def _podman() -> list[str]:
  """podman with the flags these machines need (see scripts/build_image.sh): runc, explicit ulimits."""
  out = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
  nofile = "65536" if out in ("", "unlimited") else out
  return ["podman", "--runtime", "runc", "run", "--rm", "--network", "none",
          "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def _cannot_run() -> str | None:
  if not sys.platform.startswith("linux") or os.geteuid() != 0:
    return "needs root on Linux: the image is built and run with rootful podman"
  if not shutil.which("podman"):
    if shutil.which("apt-get"):
      return None  # scripts/build_image.sh installs podman, runc and debootstrap
    return "podman is not installed and there is no apt-get to install it"
  info = subprocess.run(["podman", "--runtime", "runc", "info"], capture_output=True, text=True, timeout=120)
  if info.returncode != 0:
    return f"podman cannot run here: {(info.stderr.strip().splitlines() or ['?'])[-1]}"
  return None


@pytest.fixture(scope="module")
def image() -> str:
  reason = _cannot_run()
  if reason:
    pytest.skip(reason)
  tag = os.environ.get("MAXLM_TEST_IMAGE")
  if tag:
    return tag
  build = subprocess.run(["bash", str(BUILD), "--tag", TAG], capture_output=True, text=True, timeout=1800)
  log = (build.stdout + build.stderr).splitlines()
  assert build.returncode == 0, "image build failed:\n" + "\n".join(log[-60:])
  print("\n".join(line for line in log if line.startswith(("built ", "base image", "installed "))))
  return TAG


def _run(image: str, *args: str, opts: tuple[str, ...] = (), timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run([*_podman(), *opts, image, *args], capture_output=True, text=True, timeout=timeout)


@container
def test_image_metadata(image):
  out = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True, check=True)
  config = json.loads(out.stdout)[0]["Config"]
  assert config["Entrypoint"] == ["maxlm"]
  assert config["Cmd"] == ["doctor"]
  assert config["WorkingDir"] == "/workspace"


@container
def test_default_command_is_doctor_and_passes_without_gpu(image):
  if "doctor" not in cli.available():
    pytest.skip("maxlm doctor is not in this checkout yet (maxlm/doctor: issue 10)")
  run = _run(image)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-4000:]
  assert "no GPU" in out, out[-4000:]  # the GPU checks say "skipped: no GPU" and do not fail


@container
def test_train_as_non_root_into_a_mounted_host_dir(image, tmp_path):
  host = tmp_path / "runs"
  host.mkdir()
  os.chown(host, UID, UID)  # the host side of a bind mount keeps its owner: make it the image user's
  run = _run(image, "train", f"train.steps={STEPS}", "train.log_every=1", "checkpoint.enabled=true",
             "run_name=ci", opts=("--user", f"{UID}:{UID}", "-v", f"{host}:/workspace/runs"))
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  run_dir = host / "ci"
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert all(math.isfinite(r["loss"]) for r in rows)
  assert (run_dir / "config.yml").is_file()
  steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps and int(steps[-1]) == STEPS, sorted(p.name for p in (run_dir / "checkpoints").iterdir())
  written = [p for p in run_dir.rglob("*")]
  assert written and {p.stat().st_uid for p in written} == {UID}  # really ran as uid 1000, not root


PROBE = """
import importlib.metadata as md, jax, maxlm, maxlm.config.files as c
from maxlm.layers.te_env import import_te
te = import_te()
print(jax.__version__, jax.default_backend(), maxlm.__file__, c.CONFIG_DIR.joinpath("llama8b.yml").is_file(),
      md.version("transformer_engine"), md.version("transformer_engine_jax"), te.__name__)
"""


@container
def test_stack_inside(image):
  install = (ROOT / "docker" / "install.py").read_text()
  want_jax = next(line.split('"')[1] for line in install.splitlines() if line.startswith("JAX = "))
  want_te = next(line.split('"')[1] for line in install.splitlines() if line.startswith("TE = "))
  run = _run(image, "-c", PROBE, opts=("--entrypoint", "python"))
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  jax_version, backend, path, configs, te, te_jax, module = run.stdout.split()[-7:]
  assert (jax_version, backend) == (want_jax, "cpu")
  assert path.startswith("/opt/maxlm/venv/lib/") and path.endswith("/site-packages/maxlm/__init__.py")  # installed
  assert configs == "True"
  assert (te, te_jax, module) == (want_te, want_te, "transformer_engine.jax")


def _install_module():
  spec = importlib.util.spec_from_file_location("maxlm_docker_install", ROOT / "docker" / "install.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_install_protects_the_accelerator_stack_only():
  install = _install_module()
  stack = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "transformer-engine",
           "transformer-engine-cu13", "transformer-engine-jax", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"]
  others = ["jaxtyping", "optax", "orbax-checkpoint", "numpy", "flaxformer", "grain"]
  assert [n for n in stack if not install.PROTECTED.match(n)] == []
  assert [n for n in others if install.PROTECTED.match(n)] == []


def test_install_check_fails_on_a_changed_base_stack_or_unsupported_versions():
  install = _install_module()
  base = {"jax": ["0.11.3.dev20261101", "/usr/lib/py/dist"], "transformer-engine": ["2.21.0.dev0+abc", "/usr/lib/py/dist"],
          "nvidia-cudnn-cu13": ["9.24.0.43", "/usr/lib/py/dist"]}
  reqs = ["jax>=0.10.2", "flax>=0.12.8", "transformer-engine[jax]>=2.20"]
  assert install.stack_errors(base, dict(base), reqs) == []  # nightly .dev versions inside the ranges pass
  upgraded = dict(base, jax=["0.12.0", "/opt/maxlm/venv/site"])
  errors = install.stack_errors(base, upgraded, reqs)
  assert len(errors) == 1 and "replaced jax 0.11.3.dev20261101 (/usr/lib/py/dist)" in errors[0]
  assert "0.12.0 /opt/maxlm/venv/site" in errors[0]
  gone = {k: v for k, v in base.items() if k != "nvidia-cudnn-cu13"}
  assert install.stack_errors(base, gone, reqs) == [
    "the build replaced nvidia-cudnn-cu13 9.24.0.43 (/usr/lib/py/dist) of the base stack with nothing"]
  old = {"jax": ["0.10.1", "/d"], "transformer-engine": ["2.19.1", "/d"]}
  errors = install.stack_errors(old, dict(old), reqs)
  assert len(errors) == 2
  assert "jax 0.10.1, maxlm supports jax>=0.10.2" in errors[0]
  assert "transformer-engine 2.19.1, maxlm supports transformer-engine[jax]>=2.20" in errors[1]


def test_install_finds_the_te_jax_extension_in_both_layouts(tmp_path):
  install = _install_module()
  wheels = tmp_path / "pip"  # pip wheels: TE's loader finds it under transformer_engine/wheel_lib/
  (wheels / "transformer_engine" / "wheel_lib").mkdir(parents=True)
  (wheels / "transformer_engine" / "wheel_lib" / "transformer_engine_jax.cpython-311-x86_64-linux-gnu.so").touch()
  source = tmp_path / "ngc"  # one wheel built from the TE repository (JAX-Toolbox): the module at top level
  (source / "transformer_engine").mkdir(parents=True)
  (source / "transformer_engine_jax.cpython-312-x86_64-linux-gnu.so").touch()
  without = tmp_path / "none"  # TE's core only (transformer_engine_torch would not count either)
  (without / "transformer_engine").mkdir(parents=True)
  (without / "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so").touch()
  assert install.te_extension_in([str(wheels)])
  assert install.te_extension_in([str(source)])
  assert not install.te_extension_in([str(without), str(tmp_path / "missing"), ""])


def test_install_links_the_base_cuda_wheels_into_the_venv_only_when_it_has_none(tmp_path):
  install = _install_module()
  venv, base = tmp_path / "venv", tmp_path / "base"
  venv.mkdir()
  (base / "nvidia" / "cudnn" / "lib").mkdir(parents=True)
  install.link_base_nvidia(venv, [str(venv), "", str(base)])
  assert (venv / "nvidia").is_symlink() and (venv / "nvidia").resolve() == (base / "nvidia").resolve()
  assert (venv / "nvidia" / "cudnn" / "lib").is_dir()
  own = tmp_path / "venv2"  # a plain base: the venv has its own CUDA wheels, nothing is linked
  (own / "nvidia").mkdir(parents=True)
  install.link_base_nvidia(own, [str(base)])
  assert not (own / "nvidia").is_symlink()
  bare = tmp_path / "venv3"  # the NVIDIA container: no pip CUDA wheels anywhere (system cuDNN), no link
  bare.mkdir()
  install.link_base_nvidia(bare, [str(bare), str(tmp_path / "nothing")])
  assert not (bare / "nvidia").exists()
