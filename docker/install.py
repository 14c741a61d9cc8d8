"""Install maxlm's Python stack into the image's venv, adding only what the base image lacks.

Run by docker/Dockerfile with the venv's python (a venv made with --system-site-packages, so whatever
the base image installed is visible and counts as installed):

  python install.py stack [WHEEL_DIR]   JAX, Flax and Transformer Engine, each only if missing
  python install.py deps PYPROJECT      maxlm's dependencies, never touching the stack from step 1
  python install.py check PYPROJECT     fail if a protected package changed, or if JAX, Flax or TE is
                                        outside the ranges pyproject.toml declares (its `te` extra for TE)

On the NVIDIA JAX container JAX, TE and the CUDA libraries they share (cuDNN, NCCL) come from the
base and are never reinstalled: `deps` installs with pip constraints pinning every protected package
to the version that is there, so a dependency that would need another JAX fails the build instead of
silently replacing the base's. On a plain Debian/Ubuntu + Python base, `stack` installs CPU JAX and
Transformer Engine with the prebuilt TE JAX extension from WHEEL_DIR (PyPI has it only as source,
and compiling it needs the CUDA toolkit and ~9 minutes), pinned as scripts/setup.sh pins them.
Environment: MAXLM_TE=auto|0 (0: no Transformer Engine; maxlm then uses its Flax backend).
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

# What a plain base gets; the same pins as scripts/setup.sh (the TE extension wheel is built against them).
JAX = "0.10.2"
FLAX = "0.12.8"
TE = "2.20.2"
TE_CUDA_WHEELS = ["nvidia-cuda-runtime==13.0.96", "nvidia-cublas==13.1.1.3", "nvidia-cudnn-cu13==9.24.0.43",
                  "nvidia-cuda-nvrtc==13.0.88", "nvidia-curand==10.4.0.35", "nvidia-nccl-cu13==2.30.7"]
# Never replaced once installed: the accelerator stack and the CUDA libraries it links against.
PROTECTED = re.compile(r"^(jax|jaxlib|jax-cuda\d+-(plugin|pjrt)|flax|transformer-engine.*|nvidia-.*)$")
RECORD = Path(sys.prefix) / "maxlm-protected.json"
PIP_CACHE = os.path.expanduser("~/.cache/pip")


def say(msg: str) -> None:
  print(f"install: {msg}", flush=True)


def pip(*args: str) -> None:
  # pip's cache only where the build mounted one (scripts/build_image.sh does); never inside a layer
  cache = [] if os.path.ismount(PIP_CACHE) else ["--no-cache-dir"]
  cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *cache, *args]
  say("+ pip install " + " ".join(args))
  if subprocess.run(cmd).returncode != 0:
    hint = ""
    if "-c" in args:
      hint = (": a '(constraint)' in pip's conflict above is a package of the base image's stack, which the "
              "build does not replace; pick a BASE_IMAGE whose versions maxlm supports (docker/README.md)")
    sys.exit(f"install: error: pip install {' '.join(a for a in args if not a.startswith('/'))} failed{hint}")


def norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, tuple[str, str]]:
  """normalized name -> (version, location) of every distribution this interpreter sees (first wins)."""
  found: dict[str, tuple[str, str]] = {}
  for dist in md.distributions():
    name = dist.metadata["Name"]
    if name and norm(name) not in found:
      found[norm(name)] = (dist.version, str(dist.locate_file("")))
  return found


def have_te_jax() -> bool:
  """TE with its JAX extension, as pip wheels (transformer_engine_jax) or a source build (NGC: one package)."""
  spec = importlib.util.find_spec("transformer_engine")
  if spec is None:
    return False
  if "transformer-engine-jax" in installed():
    return True
  return te_extension_in(list(spec.submodule_search_locations or []) + sys.path)


def te_extension_in(roots: list[str]) -> bool:
  """A compiled transformer_engine_jax module directly in one of `roots` or below it (wheel_lib/)."""
  return any(glob.glob(os.path.join(r, "**", "transformer_engine_jax*.so"), recursive=True)
             for r in roots if r and os.path.isdir(r))


def stack(wheel_dir: str) -> None:
  have = installed()
  py = f"cp{sys.version_info.major}{sys.version_info.minor}"
  if "jax" in have:
    say(f"JAX {have['jax'][0]} is in the base image ({have['jax'][1]}): kept as is")
  else:
    pip(f"jax=={JAX}", f"jaxlib=={JAX}")
  if "flax" not in installed():
    pip(f"flax=={FLAX}", "-c", constraints_file())
  if os.environ.get("MAXLM_TE", "auto") == "0":
    say("MAXLM_TE=0: no Transformer Engine (maxlm uses its Flax backend)")
  elif have_te_jax():
    te = installed().get("transformer-engine", ("?", "?"))
    say(f"Transformer Engine {te[0]} with its JAX extension is in the base image: kept as is")
  else:
    wheels = sorted(glob.glob(os.path.join(wheel_dir, f"transformer_engine_jax-{TE}-{py}-*.whl")))
    if not wheels:
      sys.exit(f"install: error: no prebuilt transformer_engine_jax {TE} wheel for {py} in {wheel_dir} and no "
               "TE in the base image; use a Python 3.11 base, a base with TE, or --build-arg MAXLM_TE=0")
    jax_now = installed()["jax"][0]
    if jax_now != JAX:
      sys.exit(f"install: error: the prebuilt TE JAX extension is built for jax {JAX}, the base has {jax_now}; "
               "use a base with TE, or --build-arg MAXLM_TE=0")
    c = constraints_file()
    pip(*TE_CUDA_WHEELS, "-c", c)
    pip("--no-deps", "nvidia-cudnn-frontend==1.32.0")  # headers only; its dependencies are ~0.5 GB unused
    pip(f"transformer-engine-cu13=={TE}", "-c", c)
    pip("--no-deps", f"transformer-engine=={TE}")
    pip("--no-deps", wheels[0])  # without --no-deps pip pulls ~0.5 GB of nvidia-cutlass-dsl TE does not use
  tools = installed()
  if "setuptools" not in tools or int(tools["setuptools"][0].split(".")[0]) < 68:
    pip("setuptools>=68")  # for the editable install of maxlm (pyproject's build requirement)
  record()


def constraints_file() -> str:
  """A pip constraints file pinning every protected package that is installed now."""
  path = Path(sys.prefix) / "maxlm-constraints.txt"
  pins = [f"{n}=={v}" for n, (v, _) in sorted(installed().items()) if PROTECTED.match(n)]
  path.write_text("\n".join(pins) + "\n")
  return str(path)


def protected_now() -> dict[str, list[str]]:
  return {n: [v, loc] for n, (v, loc) in sorted(installed().items()) if PROTECTED.match(n)}


def record() -> None:
  RECORD.write_text(json.dumps(protected_now(), indent=1) + "\n")
  say(f"protected stack recorded in {RECORD}: " + ", ".join(f"{n} {v}" for n, (v, _) in protected_now().items()
                                                           if not n.startswith("nvidia-")))


def deps(pyproject: str) -> None:
  project = tomllib.loads(Path(pyproject).read_text())["project"]
  reqs = list(project["dependencies"])
  pip(*reqs, "-c", constraints_file())


def stack_errors(before: dict[str, list[str]], now: dict[str, list[str]], requirements: list[str]) -> list[str]:
  """What is wrong with the stack `now` ({name: [version, location]}): a protected package of `before`
  changed or went away, or JAX/Flax/TE is outside maxlm's `requirements` (PEP 508 strings)."""
  from packaging.requirements import Requirement  # noqa: PLC0415 - installed by `deps`, after `stack` ran
  errors = [f"the build replaced {n} {before[n][0]} ({before[n][1]}) of the base stack with "
            f"{' '.join(now[n]) if n in now else 'nothing'}" for n in before if now.get(n) != before[n]]
  for req in map(Requirement, requirements):
    name = norm(req.name)
    if name in ("jax", "flax", "transformer-engine") and name in now:
      if not req.specifier.contains(now[name][0], prereleases=True):  # a base's nightly JAX is a .dev version
        errors.append(f"the base image has {name} {now[name][0]}, maxlm supports {req}: pick another BASE_IMAGE "
                      "(docker/README.md)")
  return errors


def check(pyproject: str) -> None:
  before = json.loads(RECORD.read_text())
  now = protected_now()
  project = tomllib.loads(Path(pyproject).read_text())["project"]
  errors = stack_errors(before, now, project["dependencies"] + project.get("optional-dependencies", {}).get("te", []))
  if errors:
    sys.exit("install: error: " + "; ".join(errors))
  link_base_nvidia(Path(sysconfig.get_path("purelib")), sys.path)
  for n in ("jax", "jaxlib", "flax", "transformer-engine", "transformer-engine-jax"):
    if n in now:
      say(f"{n} {now[n][0]} ({now[n][1]})")
  say(f"check passed: the {len(before)} protected packages are unchanged")


def link_base_nvidia(purelib: Path, paths: list[str]) -> None:
  """Let TE find the base's pip CUDA libraries (nvidia/cudnn, nvidia/nccl, ...) from the venv.

  TE looks for them only under the running interpreter's purelib (the venv), then in system paths.
  On a base whose JAX uses pip `nvidia-*` wheels in its own site-packages, TE would then miss them, or
  find another copy: one link makes TE load the same cuDNN as JAX. Nothing to do when the venv has its
  own (plain base) or the base has none (the NVIDIA JAX container: system cuDNN, found by ldconfig).
  """
  mine = purelib / "nvidia"
  if mine.exists() or mine.is_symlink():
    return
  for path in paths:
    theirs = Path(path) / "nvidia"
    if path and theirs.is_dir() and Path(path).resolve() != purelib.resolve():
      mine.symlink_to(theirs)
      say(f"linked {mine} -> {theirs} (TE loads the base's CUDA libraries, the ones JAX uses)")
      return


def main(argv: list[str]) -> None:
  cmd = argv[0] if argv else ""
  if cmd == "stack":
    stack(argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
  elif cmd == "deps" and len(argv) == 2:
    deps(argv[1])
  elif cmd == "check" and len(argv) == 2:
    check(argv[1])
  else:
    sys.exit(__doc__)


if __name__ == "__main__":
  main(sys.argv[1:])
