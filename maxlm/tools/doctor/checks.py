"""The doctor's checks as pure functions of what was found (maxlm/tools/doctor/probes.py gathers it), so each
one, failure paths included, can be tested by handing it made-up findings.

Each returns a `Result(name, status, found, fix)`; status is pass, warn, fail or skip. GPU checks on a
machine without a GPU return skip with found "skipped: no GPU".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from maxlm.tables import human_bytes

STATUSES = ("pass", "warn", "fail", "skip")
NO_GPU = "skipped: no GPU"
# Oldest Linux driver for each CUDA major version (CUDA minor-version compatibility; NVIDIA's CUDA
# release notes, table 2): a CUDA 13 runtime needs driver >= 580.
MIN_DRIVER = {12: (525, 60), 13: (580, 65)}


@dataclasses.dataclass(frozen=True)
class Result:
  name: str
  status: str
  found: str
  fix: str = ""

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"unknown status {self.status!r}")


def skip_no_gpu(name: str) -> Result:
  return Result(name, "skip", NO_GPU)


def cuda_text(v: int) -> str:
  """CUDA's version int (13000 = 13.0) as text."""
  return f"{v // 1000}.{v % 1000 // 10}"


def cudnn_text(v: int) -> str:
  """cuDNN 9's version int (92400 = 9.24.0) as text."""
  return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def nccl_text(v: int) -> str:
  """NCCL's version int (22307 = 2.23.7; before 2.9: 2804 = 2.8.4) as text."""
  return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 20900 else f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


# --- versions ----------------------------------------------------------------------------------------

def _satisfies(version: str, spec: str) -> bool:
  try:
    return SpecifierSet(spec).contains(Version(version), prereleases=True)
  except (InvalidVersion, InvalidSpecifier):
    return False


def check_versions(installed: Mapping[str, str | None], required: Mapping[str, str],
                   plugins: Mapping[str, str] | None = None) -> Result:
  """`installed`: name -> version (None: not installed); `required`: name -> specifier (pyproject's
  dependencies, jax's own jaxlib pin, requires-python); `plugins`: JAX's CUDA plugins, which must be
  exactly jaxlib's version."""
  found, bad, fixes = [], [], []
  for name, version in installed.items():
    spec = required.get(name, "")
    if version is None:
      found.append(f"{name} not installed")
      if name != "transformer-engine":  # optional: the te check says what its absence means
        bad.append(f"{name} missing")
        fixes.append(f"pip install '{name}{spec}'")
      continue
    found.append(f"{name} {version}")
    if spec and not _satisfies(version, spec):
      bad.append(f"{name} {version} (needs {spec})")
      fixes.append(f"pip install '{name}{spec}'")
  jaxlib = installed.get("jaxlib")
  for name, version in (plugins or {}).items():
    found.append(f"{name} {version}")
    if jaxlib and version != jaxlib:
      bad.append(f"{name} {version} != jaxlib {jaxlib}")
      fixes.append(f"pip install '{name}=={jaxlib}' (JAX's CUDA plugin must match jaxlib exactly)")
  if bad:
    return Result("versions", "fail", "unsupported: " + ", ".join(bad), "; ".join(fixes))
  return Result("versions", "pass", ", ".join(found))


# --- XLA_FLAGS ---------------------------------------------------------------------------------------

def check_xla_flags(flags: str, preset_line: str | None, returncode: int | None, stderr: str) -> Result:
  """`returncode`/`stderr`: a fresh process that started the backend under `flags` (None: timed out)."""
  what = f"XLA_FLAGS: {len(flags.split())} flag(s)" if flags.strip() else "XLA_FLAGS empty"
  if preset_line:
    what += f", {preset_line}"
  if returncode == 0:
    return Result("xla_flags", "pass", f"{what}: the backend starts with them")
  if returncode is None:
    return Result("xla_flags", "fail", f"{what}: starting the backend with them did not finish",
                  "start python -c 'import jax; jax.devices()' with the same XLA_FLAGS to see where it hangs")
  for line in stderr.splitlines():
    marker = "in XLA_FLAGS: "
    if "Unknown flag" in line and marker in line:
      bad = line.split(marker, 1)[1].strip()
      return Result("xla_flags", "fail", f"this jaxlib rejects {bad} (XLA aborts at start)",
                    f"remove {bad} from XLA_FLAGS (or the preset: xla.preset=none)")
  last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), f"exit code {returncode}")
  return Result("xla_flags", "fail", f"{what}: the backend did not start: {last.strip()[:300]}",
                "fix or unset XLA_FLAGS (and try xla.preset=none)")


# --- devices, CUDA, cuDNN ----------------------------------------------------------------------------

def check_devices(platform: str, kinds: list[str], n_local: int, n_processes: int, memory: int | None,
                  launcher: str, gpu_hardware: str | None) -> Result:
  """`gpu_hardware`: the NVIDIA GPU the driver lists (None: none), to catch JAX running on the CPU
  although a GPU is there (a missing or mismatched CUDA plugin)."""
  kind = ", ".join(sorted(set(kinds))) or "none"
  mem = f" ({human_bytes(memory)} each)" if memory else ""
  found = f"{n_local} x {kind}{mem} per process, {n_processes} process(es), launcher: {launcher}"
  if platform != "gpu" and gpu_hardware:
    return Result("devices", "fail", f"JAX runs on {platform} although the driver lists {gpu_hardware}: {found}",
                  "install the CUDA plugin matching jaxlib: pip install 'jax[cuda13]==<jax version>' "
                  "(or cuda12), and check JAX_PLATFORMS and CUDA_VISIBLE_DEVICES")
  if n_local < 1:
    return Result("devices", "fail", found, "no devices visible: check CUDA_VISIBLE_DEVICES")
  if platform != "gpu":
    found += "; no GPU (CPU only)"
  return Result("devices", "pass", found)


def _driver_tuple(driver: str) -> tuple[int, ...]:
  return tuple(int(p) for p in driver.split(".")[:2] if p.isdigit())


def check_cuda(gpu: bool, driver: str | None, jax_cuda: int | None, te_cuda: int | None) -> Result:
  if not gpu:
    return skip_no_gpu("cuda")
  if jax_cuda is None:
    return Result("cuda", "fail", f"driver {driver or 'unknown'}; JAX's CUDA plugin reports no runtime version",
                  "reinstall JAX's CUDA plugin (pip install 'jax[cuda13]==<jax version>')")
  found = f"driver {driver or 'unknown'}, CUDA runtime {cuda_text(jax_cuda)} (JAX)"
  if te_cuda is not None:
    found += f", TE built for CUDA {cuda_text(te_cuda)}"
  major = jax_cuda // 1000
  need = MIN_DRIVER.get(major)
  if driver and need and _driver_tuple(driver) < need:
    return Result("cuda", "fail", found, f"CUDA {major} needs driver >= {need[0]}.{need[1]}: update the driver "
                  f"or use JAX/TE built for an older CUDA")
  if te_cuda is not None and te_cuda // 1000 != major:
    return Result("cuda", "fail", found, f"install Transformer Engine built for CUDA {major} "
                  f"(transformer-engine-cu{major}) to match JAX")
  return Result("cuda", "pass", found)


def cudnn_libraries(loaded: list[str]) -> dict[str, list[str]]:
  """Directory -> cuDNN library files, from the paths of the libraries this process has mapped."""
  out: dict[str, list[str]] = {}
  for path in loaded:
    base = os.path.basename(path)
    if base.startswith("libcudnn") and ".so" in base:
      files = out.setdefault(os.path.dirname(os.path.realpath(path)), [])
      if base not in files:
        files.append(base)
  return out


def check_cudnn(gpu: bool, loaded: list[str], jax_cudnn: int | None, te_cudnn: int | None) -> Result:
  """One cuDNN: every libcudnn* mapped into this process (after JAX and TE both ran) must come from one
  directory, and JAX and TE must report the same version; two copies crash with undefined symbols."""
  if not gpu:
    return skip_no_gpu("cudnn")
  dirs = cudnn_libraries(loaded)
  versions = f"JAX {cudnn_text(jax_cudnn) if jax_cudnn else 'unknown'}, TE {cudnn_text(te_cudnn) if te_cudnn else 'unknown'}"
  if len(dirs) > 1:
    where = "; ".join(f"{d} ({', '.join(sorted(f))})" for d, f in sorted(dirs.items()))
    return Result("cudnn", "fail", f"two cuDNN copies loaded ({versions}): {where}",
                  "keep one: e.g. unset LD_LIBRARY_PATH/CUDNN_PATH entries that point at another cuDNN, or "
                  "pip uninstall the extra nvidia-cudnn-cu* wheel, so JAX and TE load the same libcudnn")
  if jax_cudnn and te_cudnn and jax_cudnn != te_cudnn:
    return Result("cudnn", "fail", f"JAX and TE report different cuDNN versions ({versions})",
                  "install one cuDNN that both load (the version JAX's plugin was built for)")
  if not dirs:
    return Result("cudnn", "warn", f"no libcudnn mapped in this process ({versions})",
                  "run with the te backend so TE's fused attention loads cuDNN, then check again")
  (where, files), = dirs.items()
  return Result("cudnn", "pass", f"one cuDNN ({versions}) from {where}")


# --- Transformer Engine --------------------------------------------------------------------------------

def check_te(gpu: bool, backend: str, import_error: str | None, version: str | None,
             custom_calls: list[str] | None, env_value: str | None) -> Result:
  """TE importable (any backend), and on a GPU its custom calls in a jitted TE layer's HLO."""
  if import_error == "not installed":
    status = "fail" if backend == "te" or (gpu and backend == "auto") else "warn"
    return Result("te", status, f"Transformer Engine not installed (model.backend={backend})",
                  "bash scripts/setup.sh installs it (or pip install 'transformer-engine[jax]'); "
                  "without it runs use the slower flax backend and no FP8")
  if import_error:
    return Result("te", "fail", f"Transformer Engine does not import: {import_error}",
                  "an undefined symbol usually means two cuDNN/CUDA copies (see the cudnn check) or a TE "
                  "built for another JAX/CUDA: reinstall transformer-engine-jax for this JAX")
  found = f"Transformer Engine {version} imports"
  if not gpu:
    return Result("te", "pass", f"{found}; GPU custom calls: {NO_GPU}")
  if env_value is not None and env_value.strip().lower() == "false":
    return Result("te", "fail", f"{found}; NVTE_JAX_CUSTOM_CALLS=false turns its GPU kernels off",
                  "unset NVTE_JAX_CUSTOM_CALLS")
  if not custom_calls:
    return Result("te", "fail", f"{found} but a jitted TE layer calls none of its GPU kernels (pure JAX)",
                  "check NVTE_JAX_CUSTOM_CALLS and that transformer_engine_jax was built with CUDA")
  return Result("te", "pass", f"{found}; custom calls active ({', '.join(custom_calls)})")


def check_fused_attention(gpu: bool, te_ok: bool, shape: str, probe: Mapping | None,
                          nvte_fused_attn: str | None) -> Result:
  """`shape`: the configured attention (heads, GQA, head_dim, window, dtype); `probe`:
  maxlm.layers.te_probe.probe_fused_attention's result."""
  if not gpu:
    return skip_no_gpu("fused_attention")
  if not te_ok:
    return Result("fused_attention", "skip", f"{shape}: skipped: Transformer Engine unavailable (see te)")
  if nvte_fused_attn is not None and nvte_fused_attn.strip() == "0":
    return Result("fused_attention", "fail", f"{shape}: NVTE_FUSED_ATTN=0 forces unfused attention",
                  "unset NVTE_FUSED_ATTN")
  if not probe["selected"]:
    why = "TE warned it falls back to unfused attention" if probe["fallback_warning"] else "no cuDNN fused call"
    return Result("fused_attention", "fail", f"{shape}: cuDNN fused attention not selected ({why})",
                  "cuDNN has no fused kernel for this head_dim/window/dtype on this GPU: use model.dtype=bfloat16 "
                  "and a head_dim of 64/128/256, or a newer cuDNN; NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 shows why")
  errs = (f"max error out {probe['err_out']:.2e} (bound {probe['tol_out']:.2e}), "
          f"grads {probe['err_grad']:.2e} (bound {probe['tol_grad']:.2e})")
  if probe["err_out"] > probe["tol_out"] or probe["err_grad"] > probe["tol_grad"]:
    return Result("fused_attention", "fail", f"{shape}: fused attention selected but wrong vs the reference: {errs}",
                  "report it with this line (cuDNN/TE versions above); meanwhile NVTE_FUSED_ATTN=0 is correct but slower")
  return Result("fused_attention", "pass", f"{shape}: cuDNN fused attention selected, forward+backward match "
                f"the reference: {errs}")


def check_fp8(gpu: bool, precision: str, backend: str, supported: list[str]) -> Result:
  if not gpu:
    return skip_no_gpu("fp8")
  found = f"supported here: {', '.join(supported)}; configured model.precision={precision}"
  if precision in supported:
    return Result("fp8", "pass", found)
  if precision != "bf16" and backend == "flax":
    return Result("fp8", "fail", found, "FP8 needs model.backend=te (or auto with TE installed)")
  return Result("fp8", "fail", found, f"use one of {', '.join(supported)} on this GPU")


# --- NCCL ----------------------------------------------------------------------------------------------

def check_nccl(gpu: bool, n_devices: int, n_processes: int, allreduce: Mapping, nccl_version: int | None) -> Result:
  """`allreduce`: {ok, got, want, seconds, error} of a psum over every device of every process."""
  version = (f"NCCL {nccl_text(nccl_version)}" if nccl_version else "NCCL version unknown") if gpu else f"NCCL {NO_GPU}"
  where = f"{n_devices} device(s) in {n_processes} process(es)"
  if allreduce.get("error"):
    return Result("nccl", "fail", f"{version}; all-reduce over {where} failed: {allreduce['error']}",
                  "check that every process reaches every other (NCCL_DEBUG=INFO shows the transport; "
                  "NCCL_SOCKET_IFNAME / NCCL_IB_HCA select the network)")
  if not allreduce.get("ok"):
    return Result("nccl", "fail", f"{version}; all-reduce over {where} gave {allreduce.get('got')}, "
                  f"expected {allreduce.get('want')}", "a wrong all-reduce: rerun with NCCL_DEBUG=INFO and report it")
  return Result("nccl", "pass", f"{version}; all-reduce over {where} correct ({allreduce['seconds'] * 1e3:.0f} ms)")


# --- memory --------------------------------------------------------------------------------------------

def check_memory_settings(gpu: bool, env: Mapping[str, str]) -> Result:
  if not gpu:
    return skip_no_gpu("memory_settings")
  pre = env.get("XLA_PYTHON_CLIENT_PREALLOCATE")
  frac = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR")
  found = (f"XLA_PYTHON_CLIENT_PREALLOCATE={pre if pre is not None else '(unset: true)'}, "
           f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac if frac is not None else '(unset: 0.75)'}")
  if frac is not None:
    try:
      value = float(frac)
    except ValueError:
      value = -1.0
    if not 0 < value <= 1:
      return Result("memory_settings", "fail", found, "XLA_PYTHON_CLIENT_MEM_FRACTION must be in (0, 1], e.g. 0.9")
    if value < 0.5:
      return Result("memory_settings", "warn", found + f": JAX may use only {value:.0%} of the GPU",
                    "set XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 unless the GPU is shared")
  if allocator == "platform":
    return Result("memory_settings", "warn", found + ", XLA_PYTHON_CLIENT_ALLOCATOR=platform (slow, for debugging)",
                  "unset XLA_PYTHON_CLIENT_ALLOCATOR")
  if pre is not None and pre.strip().lower() in ("false", "0"):
    return Result("memory_settings", "warn", found + ": memory grows on demand (fragmentation, slower steps)",
                  "unset XLA_PYTHON_CLIENT_PREALLOCATE for training (and set XLA_PYTHON_CLIENT_MEM_FRACTION=0.9)")
  return Result("memory_settings", "pass", found)


def check_memory_fit(gpu: bool, estimate: Mapping[str, int], limit: int | None, where: str) -> Result:
  """`estimate`: maxlm.plan.memory.estimate for the configured run; `limit`: the allocator's bytes per device."""
  if not gpu:
    return skip_no_gpu("memory_fit")
  if not limit:
    return Result("memory_fit", "warn", "the device reports no memory limit", "")
  found = (f"estimated peak {human_bytes(estimate['total'])} per device (certain part "
           f"{human_bytes(estimate['lower_bound'])}) of {human_bytes(limit)} usable, {where}")
  if estimate["lower_bound"] > limit:
    return Result("memory_fit", "fail", found, "the run cannot fit: use more devices, a smaller model, or a "
                  "smaller data.global_batch_size/seq_len")
  if estimate["total"] > limit:
    return Result("memory_fit", "warn", found, "activations may not fit: use model.remat=full (or save_attn), "
                  "train.grad_accum>1, or raise XLA_PYTHON_CLIENT_MEM_FRACTION")
  return Result("memory_fit", "pass", found)


# --- output_dir ----------------------------------------------------------------------------------------

def check_output_dir(run_dir: Path, checkpoints: bool, keep: int, checkpoint_bytes: int) -> Result:
  """Writable (a probe file in the run directory or its nearest existing parent, removed again; nothing
  created) and free space for the checkpoints the run keeps (keep + 1 while saving)."""
  probe = next((p for p in (run_dir, *run_dir.parents) if os.path.lexists(p)), Path("/"))
  if not probe.is_dir():
    return Result("output_dir", "fail", f"{probe} is not a directory, so {run_dir} cannot be created",
                  "set output_dir to a directory path")
  test_file = probe / f".maxlm-doctor-{os.getpid()}"
  try:
    test_file.write_bytes(b"")
    test_file.unlink()
  except OSError as e:
    return Result("output_dir", "fail", f"cannot write {probe} (for {run_dir}): {e.strerror or e}",
                  "set output_dir to a writable place (or fix the mount/permissions)")
  free = os.statvfs(probe).f_bavail * os.statvfs(probe).f_frsize
  found = f"{probe} writable, {human_bytes(free)} free"
  if not checkpoints:
    return Result("output_dir", "pass", f"{found}; checkpoints off (one would be {human_bytes(checkpoint_bytes)})")
  copies = keep + 1 if keep else 2
  found += f"; a checkpoint is {human_bytes(checkpoint_bytes)}"
  if free < checkpoint_bytes:
    return Result("output_dir", "fail", found + ": not even one fits",
                  "free space or point output_dir at a larger file system")
  if free < copies * checkpoint_bytes:
    return Result("output_dir", "warn", found + f": fewer than the {copies} kept while saving "
                  f"(checkpoint.keep={keep}{', keeps all' if not keep else ''})",
                  "free space, lower checkpoint.keep, or use a larger file system")
  return Result("output_dir", "pass", found + f"; room for {free // max(checkpoint_bytes, 1)}")
