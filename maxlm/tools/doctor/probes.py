"""What the doctor's checks need from this machine: installed versions and the supported ranges, a
fresh process started under XLA_FLAGS, the driver, the libraries mapped into this process, JAX's CUDA
library versions, and an all-reduce over every device.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import subprocess
import sys
import threading
import time
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# What `versions` reports, in order (distribution names; transformer-engine may also be installed as its
# transformer-engine-jax part only).
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "transformer-engine")
CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")
PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
START_BACKEND = "import jax; jax.devices()"


def _version(dist: str) -> str | None:
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def installed_versions() -> dict[str, str | None]:
  out: dict[str, str | None] = {"python": ".".join(map(str, sys.version_info[:3]))}
  for name in PACKAGES:
    out[name] = _version(name)
  if out["transformer-engine"] is None:
    out["transformer-engine"] = _version("transformer-engine-jax")
  return out


def installed_plugins() -> dict[str, str]:
  return {name: v for name in CUDA_PLUGINS if (v := _version(name))}


def _declared() -> tuple[list[str], str]:
  """maxlm's dependency strings (extras included) and requires-python: from the installed metadata,
  else (a source tree never installed) from pyproject.toml."""
  try:
    reqs = metadata.requires("maxlm") or []
    return reqs, metadata.metadata("maxlm").get("Requires-Python") or ""
  except metadata.PackageNotFoundError:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
      reqs += extra
    return reqs, project.get("requires-python", "")


def required_ranges() -> dict[str, str]:
  """Name -> specifier: pyproject's dependencies (the `te` extra too), jax's own pin of jaxlib, and
  requires-python. The one place the supported ranges are declared is pyproject.toml."""
  reqs, python = _declared()
  out = {"python": python}
  jax_reqs = [r for r in (metadata.requires("jax") or []) if "extra ==" not in r] if _version("jax") else []
  for text in reqs + jax_reqs:
    try:
      req = Requirement(text)
    except InvalidRequirement:
      continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if name in PACKAGES and str(req.specifier):
      out[name] = str(req.specifier)
  return out


def start_backend(xla_flags: str, timeout_s: float = 180) -> tuple[int | None, str]:
  """(exit code or None on timeout, stderr) of a fresh Python starting the JAX backend under `xla_flags`
  (XLA aborts on an unknown flag, so this cannot run in the doctor's own process)."""
  env = {**os.environ, "XLA_FLAGS": xla_flags, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  try:
    r = subprocess.run([sys.executable, "-c", START_BACKEND], env=env, capture_output=True, text=True,
                       timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return None, ""
  return r.returncode, r.stderr


def driver_version() -> str | None:
  try:
    with open("/sys/module/nvidia/version", encoding="utf-8") as f:
      return f.read().strip() or None
  except OSError:
    pass
  try:
    r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  first = r.stdout.split("\n")[0].strip() if r.returncode == 0 else ""
  return first or None


def loaded_libraries(maps: str = "/proc/self/maps") -> list[str]:
  """Paths of the shared libraries mapped into this process."""
  try:
    with open(maps, encoding="utf-8", errors="replace") as f:
      paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
  except OSError:
    return []
  return sorted(p for p in paths if p.startswith("/") and ".so" in p)


def jax_cuda_versions() -> dict[str, int]:
  """CUDA runtime and cuDNN versions JAX's CUDA plugin loaded ({} without the plugin)."""
  from jax._src.lib import cuda_versions  # noqa: PLC0415 - private; imported only when asked
  out = {}
  if cuda_versions is None:
    return out
  for key, fn in (("cuda", "cuda_runtime_get_version"), ("cudnn", "cudnn_get_version")):
    try:
      out[key] = int(getattr(cuda_versions, fn)())
    except Exception:  # noqa: BLE001 - a plugin without this function or without a GPU: unknown
      pass
  return out


def nccl_version(loaded: list[str]) -> int | None:
  """ncclGetVersion() of the libnccl this process loaded (after an all-reduce on GPUs), else of the one
  JAX would load (the nvidia-nccl wheel, else the system's; one device needs no NCCL, so none may be
  loaded yet)."""
  libs = [p for p in loaded if os.path.basename(p).startswith("libnccl.so")]
  libs += sorted({p for base in sys.path for p in glob.glob(os.path.join(base, "nvidia", "nccl", "lib", "libnccl.so*"))})
  libs.append("libnccl.so.2")  # last: the dynamic loader's search (a system NCCL, as in NVIDIA's images)
  for path in libs:
    try:
      version = ctypes.c_int()
      if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(version)) == 0:
        return version.value
    except (OSError, AttributeError):
      continue
  return None


def all_reduce(timeout_s: float) -> dict:
  """psum over every device of every process: device i contributes i + 1, so the sum is n(n+1)/2.
  Runs in a thread: an all-reduce that cannot reach a peer hangs, and the doctor must still report."""
  out: dict = {}

  def work():
    try:
      import jax  # noqa: PLC0415 - the backend is up by now
      import numpy as np  # noqa: PLC0415
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415

      devices = jax.devices()
      n = len(devices)
      mesh = Mesh(np.array(devices), ("i",))
      sharding = NamedSharding(mesh, P("i"))
      x = jax.make_array_from_callback((n,), sharding, lambda idx: np.arange(n, dtype=np.float32)[idx] + 1)  # [N]
      total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))
      total(x).block_until_ready()  # compile and warm up
      t0 = time.perf_counter()
      got = float(np.asarray(total(x).addressable_data(0)).reshape(-1)[0])
      out.update(seconds=time.perf_counter() - t0, got=got, want=n * (n + 1) / 2)
      out["ok"] = got == out["want"]
    except Exception as e:  # noqa: BLE001 - reported as the check's finding
      out["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"

  thread = threading.Thread(target=work, daemon=True, name="maxlm-doctor-allreduce")
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    return {"error": f"did not finish within {timeout_s:.0f} s (a peer unreachable?)", "hung": True}
  return out
