"""`maxlm doctor`: every check on made-up findings (its pass and failure paths), the probes that gather
the findings on this machine, and the command end to end (lines, --json, exit codes)."""

import json
import os
import shutil
import subprocess
import sys
import threading
import tomllib
from importlib import metadata
from pathlib import Path

import jax
import pytest

from maxlm.tools import doctor
from maxlm.config import load_config
from maxlm.tools.doctor import checks, probes
from maxlm.tools.doctor.checks import NO_GPU, Result
from maxlm.layers import te_backend, te_probe

# subprocess runs compile like the suite's own (conftest): XLA's CPU backend at optimization level 0
FAST_CPU = "--xla_backend_optimization_level=0"

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["versions", "xla_flags", "devices", "cuda", "te", "fused_attention", "cudnn", "fp8", "nccl",
         "memory_settings", "memory_fit", "output_dir"]
GPU_CHECKS = ["cuda", "fused_attention", "cudnn", "fp8", "memory_settings", "memory_fit"]
OK_VERSIONS = {"python": "3.11.7", "jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "transformer-engine": "2.20.2"}
RANGES = {"python": ">=3.11", "jax": ">=0.10.2", "jaxlib": "<=0.10.2,>=0.10.1", "flax": ">=0.12.8",
          "transformer-engine": ">=2.20"}


def cli(args, env=None, timeout=600):
  e = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + FAST_CPU, "JAX_PLATFORMS": "cpu", **(env or {})}
  return subprocess.run([sys.executable, "-m", "maxlm.tools.doctor", *args], cwd=ROOT, env=e, capture_output=True,
                        text=True, timeout=timeout)


# --- versions ------------------------------------------------------------------------------------------

def test_versions_pass_and_each_failure():
  assert checks.check_versions(OK_VERSIONS, RANGES).status == "pass"
  r = checks.check_versions({**OK_VERSIONS, "jax": "0.9.1"}, RANGES)
  assert r.status == "fail" and "jax 0.9.1 (needs >=0.10.2)" in r.found and "pip install 'jax>=0.10.2'" in r.fix
  r = checks.check_versions({**OK_VERSIONS, "python": "3.10.12"}, RANGES)
  assert r.status == "fail" and "python 3.10.12 (needs >=3.11)" in r.found
  r = checks.check_versions({**OK_VERSIONS, "flax": None}, RANGES)
  assert r.status == "fail" and "flax missing" in r.found
  r = checks.check_versions({**OK_VERSIONS, "transformer-engine": None}, RANGES)  # optional: the te check decides
  assert r.status == "pass" and "transformer-engine not installed" in r.found
  r = checks.check_versions(OK_VERSIONS, RANGES, {"jax-cuda13-plugin": "0.10.1"})
  assert r.status == "fail" and "jax-cuda13-plugin 0.10.1 != jaxlib 0.10.2" in r.found
  assert checks.check_versions({**OK_VERSIONS, "jax": "0.11.2.dev20261201"}, RANGES).status == "pass"


def test_supported_ranges_come_from_pyproject_and_jax():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  declared = {d.split(">=")[0]: ">=" + d.split(">=")[1] for d in project["dependencies"] if ">=" in d}
  ranges = probes.required_ranges()
  for name in ("jax", "flax", "optax", "orbax-checkpoint", "grain"):
    assert ranges[name] == declared[name], name
  assert ranges["python"] == project["requires-python"]
  te = [d for d in project["optional-dependencies"]["te"] if d.startswith("transformer-engine")]
  assert ranges["transformer-engine"] == ">=" + te[0].split(">=")[1]
  pin = [r for r in metadata.requires("jax") if r.startswith("jaxlib") and "extra" not in r][0]
  assert sorted(ranges["jaxlib"].split(",")) == sorted(pin[len("jaxlib"):].split(","))
  assert checks.check_versions(probes.installed_versions(), ranges, probes.installed_plugins()).status == "pass"


# --- XLA_FLAGS -----------------------------------------------------------------------------------------

def test_xla_flags_names_the_rejected_flag():
  stderr = ("F1203 07:29:22.001154 18879 parse_flags_from_env.cc:234] Unknown flags in XLA_FLAGS: "
            "--xla_gpu_graph_level=0 --xla_bogus\n*** Check failure stack trace: ***\n")
  r = checks.check_xla_flags("--xla_gpu_graph_level=0 --xla_bogus", None, 1, stderr)
  assert r.status == "fail" and r.found == "this jaxlib rejects --xla_gpu_graph_level=0 --xla_bogus (XLA aborts at start)"
  assert "remove --xla_gpu_graph_level=0 --xla_bogus from XLA_FLAGS" in r.fix
  assert checks.check_xla_flags("", None, 0, "").status == "pass"
  assert checks.check_xla_flags("--a=1", None, None, "").status == "fail"
  r = checks.check_xla_flags("--a=1", "xla.preset=hopper (set): ...", 1, "RuntimeError: no CUDA\n")
  assert r.status == "fail" and "no CUDA" in r.found


def test_start_backend_really_rejects_an_unknown_flag():
  code, stderr = probes.start_backend("--xla_force_host_platform_device_count=2 --xla_not_a_flag=1")
  r = checks.check_xla_flags("", None, code, stderr)
  assert code != 0 and r.status == "fail" and "--xla_not_a_flag=1" in r.found
  assert "--xla_force_host_platform_device_count" not in r.found


# --- devices, CUDA, cuDNN ------------------------------------------------------------------------------

def test_devices():
  r = checks.check_devices("gpu", ["NVIDIA H200"] * 8, 8, 2, 150 * 2**30, "slurm, process 0", "NVIDIA H200")
  assert r.status == "pass" and r.found == ("8 x NVIDIA H200 (150.0 GiB each) per process, 2 process(es), "
                                            "launcher: slurm, process 0")
  r = checks.check_devices("cpu", ["cpu"], 1, 1, None, "none", "NVIDIA H200")  # CUDA plugin missing
  assert r.status == "fail" and "although the driver lists NVIDIA H200" in r.found and "jax[cuda13]" in r.fix
  r = checks.check_devices("cpu", ["cpu"] * 8, 8, 1, None, "none", None)
  assert r.status == "pass" and r.found.endswith("no GPU (CPU only)")


def test_cuda():
  assert checks.check_cuda(False, None, None, None) == Result("cuda", "skip", NO_GPU)
  r = checks.check_cuda(True, "580.95.05", 13000, 13000)
  assert r.status == "pass" and r.found == "driver 580.95.05, CUDA runtime 13.0 (JAX), TE built for CUDA 13.0"
  r = checks.check_cuda(True, "575.57.08", 13000, 13000)
  assert r.status == "fail" and "CUDA 13 needs driver >= 580.65" in r.fix
  r = checks.check_cuda(True, "580.95.05", 13000, 12090)
  assert r.status == "fail" and "transformer-engine-cu13" in r.fix
  assert checks.check_cuda(True, "580.95.05", None, None).status == "fail"


SITE = "/usr/lib/python3/site-packages/nvidia/cudnn/lib"


def test_cudnn_one_library_passes_two_copies_fail():
  one = [f"{SITE}/libcudnn.so.9", f"{SITE}/libcudnn_graph.so.9", "/usr/lib/libc.so.6"]
  r = checks.check_cudnn(True, one, 92400, 92400)
  assert r.status == "pass" and r.found == f"one cuDNN (JAX 9.24.0, TE 9.24.0) from {SITE}"
  two = one + ["/opt/conda/lib/libcudnn_engines_precompiled.so.9.14.0"]  # a dispatcher/engine mix
  r = checks.check_cudnn(True, two, 92400, 92400)
  assert r.status == "fail" and "two cuDNN copies loaded" in r.found
  assert "/opt/conda/lib (libcudnn_engines_precompiled.so.9.14.0)" in r.found and SITE in r.found
  r = checks.check_cudnn(True, one, 92400, 91400)
  assert r.status == "fail" and "JAX 9.24.0, TE 9.14.0" in r.found
  assert checks.check_cudnn(True, [], 92400, 92400).status == "warn"
  assert checks.check_cudnn(False, two, None, None).found == NO_GPU


def test_loaded_libraries_reads_the_maps_format(tmp_path):
  maps = tmp_path / "maps"
  maps.write_text(
      "55d0c000-55d0d000 r--p 00000000 08:01 123 /usr/bin/python3.11\n"
      f"7f00-7f01 r-xp 00000000 08:01 456 {SITE}/libcudnn.so.9\n"
      f"7f01-7f02 r--p 00001000 08:01 456 {SITE}/libcudnn.so.9\n"
      "7f02-7f03 rw-p 00000000 00:00 0 \n"
      "7f03-7f04 r--p 00000000 00:00 0 [vdso]\n"
      "7f04-7f05 r-xp 00000000 08:01 789 /opt/my libs/libnccl.so.2\n")
  assert probes.loaded_libraries(str(maps)) == ["/opt/my libs/libnccl.so.2", f"{SITE}/libcudnn.so.9"]  # sorted
  assert probes.loaded_libraries(str(tmp_path / "absent")) == []
  assert probes.loaded_libraries()  # this process's own: python's shared libraries at least


# --- Transformer Engine --------------------------------------------------------------------------------

def test_te_check_paths():
  r = checks.check_te(False, "auto", None, "2.20.2", None, "false")
  assert r.status == "pass" and r.found == f"Transformer Engine 2.20.2 imports; GPU custom calls: {NO_GPU}"
  assert checks.check_te(False, "auto", "not installed", None, None, None).status == "warn"
  assert checks.check_te(False, "te", "not installed", None, None, None).status == "fail"
  assert checks.check_te(True, "auto", "not installed", None, None, None).status == "fail"
  r = checks.check_te(True, "auto", "ImportError: undefined symbol: cudnnGetLastErrorString", None, None, None)
  assert r.status == "fail" and "undefined symbol" in r.found and "cudnn check" in r.fix
  r = checks.check_te(True, "auto", None, "2.20.2", [], None)
  assert r.status == "fail" and "calls none of its GPU kernels" in r.found
  assert checks.check_te(True, "auto", None, "2.20.2", ["te_norm_forward_ffi"], "false").status == "fail"
  r = checks.check_te(True, "auto", None, "2.20.2", ["te_norm_backward_ffi", "te_norm_forward_ffi"], None)
  assert r.status == "pass" and "custom calls active (te_norm_backward_ffi, te_norm_forward_ffi)" in r.found


def test_te_not_importable_is_reported(monkeypatch):
  monkeypatch.setattr(te_probe, "te_installed", lambda: False)
  assert te_probe.te_import_error() == "not installed"
  monkeypatch.setattr(te_probe, "te_installed", lambda: True)

  def broken():
    raise ImportError("libtransformer_engine.so: undefined symbol: cudnnGetVersion_v9\nmore")
  monkeypatch.setattr(te_probe, "import_te", broken)
  assert te_probe.te_import_error() == "ImportError: libtransformer_engine.so: undefined symbol: cudnnGetVersion_v9"


def test_custom_call_names_in_hlo_and_stablehlo():
  hlo = ('%cc = (bf16[2,8,64]{2,1,0}, f32[2,8]{1,0}) custom-call(bf16[2,8,64]{2,1,0} %p0, f32[64]{0} %p1), '
         'custom_call_target="te_norm_forward_ffi", api_version=API_VERSION_TYPED_FFI\n'
         '%fa = custom-call(%q, %k, %v), custom_call_target="te_fused_attn_forward_ffi"\n')
  assert te_probe.custom_call_names(hlo) == ["te_norm_forward_ffi", "te_fused_attn_forward_ffi"]
  shlo = '%0:2 = stablehlo.custom_call @CustomSPMDPartitioning(%arg0) {api_version = 2 : i32}\n'
  assert te_probe.custom_call_names(shlo) == ["CustomSPMDPartitioning"]
  assert te_probe.custom_call_names("%1 = stablehlo.add %0, %0 : tensor<2xf32>") == []


@pytest.mark.te
def test_te_probes_on_cpu():
  assert te_probe.te_import_error() is None
  assert te_probe.custom_call_targets() == []  # CPU: TE runs as plain JAX (NVTE_JAX_CUSTOM_CALLS=false)
  assert set(te_probe.te_library_versions()) >= {"cudnn", "cuda"}


FUSED_OK = {"selected": True, "fallback_warning": False, "custom_calls": [], "err_out": 1e-3, "tol_out": 4e-3,
            "err_grad": 2e-3, "tol_grad": 8e-3}


def test_fused_attention_check_paths():
  shape = "32 heads / 8 kv (GQA 4), head_dim 128, window none, bfloat16"
  assert checks.check_fused_attention(False, True, shape, None, None).found == NO_GPU
  assert checks.check_fused_attention(True, False, shape, None, None).status == "skip"
  assert checks.check_fused_attention(True, True, shape, FUSED_OK, None).status == "pass"
  r = checks.check_fused_attention(True, True, shape, {**FUSED_OK, "selected": False, "fallback_warning": True}, None)
  assert r.status == "fail" and "falls back" in r.found and "head_dim" in r.fix
  r = checks.check_fused_attention(True, True, shape, {**FUSED_OK, "err_grad": 0.5}, None)
  assert r.status == "fail" and "wrong vs the reference" in r.found
  assert checks.check_fused_attention(True, True, shape, FUSED_OK, "0").status == "fail"


@pytest.mark.te
@pytest.mark.slow
def test_fused_attention_probe_measures_errors_and_catches_a_wrong_window(monkeypatch):
  """On CPU TE takes its unfused path: not 'selected', but the comparison runs. Dropping the window
  from TE's call (a wrong mask) must exceed the bound the probe derives."""
  shape = dict(n_heads=4, n_kv_heads=2, head_dim=32, window=24, dtype="bfloat16", max_segments=4, seq_len=64)
  good = te_probe.probe_fused_attention(**shape)
  assert good["selected"] is False
  assert 0 < good["err_out"] <= good["tol_out"] and 0 < good["err_grad"] <= good["tol_grad"]
  real = te_backend.attention
  monkeypatch.setattr(te_backend, "attention", lambda *a, window=0, **k: real(*a, window=0, **k))
  bad = te_probe.probe_fused_attention(**shape)
  assert bad["err_out"] > 10 * bad["tol_out"] and bad["err_grad"] > bad["tol_grad"]


def test_fp8():
  assert checks.check_fp8(False, "fp8_delayed", "te", []).found == NO_GPU
  assert checks.check_fp8(True, "fp8_delayed", "te", ["bf16", "fp8_delayed", "fp8_current"]).status == "pass"
  r = checks.check_fp8(True, "fp8_delayed", "te", ["bf16"])
  assert r.status == "fail" and r.found == "supported here: bf16; configured model.precision=fp8_delayed"
  assert "backend=te" in checks.check_fp8(True, "fp8_current", "flax", ["bf16"]).fix


# --- NCCL ----------------------------------------------------------------------------------------------

def test_nccl_check_and_version_text():
  assert checks.nccl_text(22307) == "2.23.7" and checks.nccl_text(23007) == "2.30.7" and checks.nccl_text(2804) == "2.8.4"
  ok = {"ok": True, "got": 36.0, "want": 36.0, "seconds": 0.002}
  r = checks.check_nccl(True, 8, 1, ok, 23007)
  assert r.status == "pass" and r.found == "NCCL 2.30.7; all-reduce over 8 device(s) in 1 process(es) correct (2 ms)"
  assert checks.check_nccl(False, 8, 1, ok, None).found.startswith(f"NCCL {NO_GPU}; all-reduce")
  assert checks.check_nccl(True, 8, 1, {**ok, "ok": False, "got": 35.0}, 23007).status == "fail"
  r = checks.check_nccl(True, 16, 2, {"error": "did not finish within 300 s"}, None)
  assert r.status == "fail" and "NCCL_SOCKET_IFNAME" in r.fix


def test_nccl_version_of_the_installed_library():
  try:
    want = metadata.version("nvidia-nccl-cu13")
  except metadata.PackageNotFoundError:
    pytest.skip("the nvidia-nccl-cu13 wheel is not installed")
  assert checks.nccl_text(probes.nccl_version([])) == want
  assert probes.nccl_version(["/nonexistent/libnccl.so.2"]) == probes.nccl_version([])  # falls through


def test_all_reduce_runs_over_the_cpu_devices():
  n = jax.device_count()
  out = probes.all_reduce(timeout_s=300)
  assert out["ok"] and out["want"] == out["got"] == n * (n + 1) / 2 and n == 8


def test_all_reduce_that_hangs_is_reported(monkeypatch):
  release = threading.Event()
  monkeypatch.setattr(jax, "shard_map", lambda *a, **k: release.wait(60))
  out = probes.all_reduce(timeout_s=1.0)
  release.set()
  assert out["hung"] and "did not finish within 1 s" in out["error"]


# --- memory --------------------------------------------------------------------------------------------

def test_memory_settings():
  assert checks.check_memory_settings(False, {}).found == NO_GPU
  assert checks.check_memory_settings(True, {}).status == "pass"
  assert checks.check_memory_settings(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}).status == "pass"
  for bad in ("1.5", "0", "lots"):
    assert checks.check_memory_settings(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": bad}).status == "fail", bad
  assert checks.check_memory_settings(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}).status == "warn"
  r = checks.check_memory_settings(True, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  assert r.status == "warn" and "on demand" in r.found
  assert checks.check_memory_settings(True, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}).status == "warn"


def test_memory_fit():
  gib = 2**30
  est = {"lower_bound": 60 * gib, "total": 90 * gib}
  assert checks.check_memory_fit(False, est, None, "").found == NO_GPU
  assert checks.check_memory_fit(True, est, 100 * gib, "1 device").status == "pass"
  r = checks.check_memory_fit(True, est, 80 * gib, "1 device")
  assert r.status == "warn" and "remat" in r.fix
  r = checks.check_memory_fit(True, est, 50 * gib, "1 device")
  assert r.status == "fail" and r.found == ("estimated peak 90.0 GiB per device (certain part 60.0 GiB) of "
                                            "50.0 GiB usable, 1 device")


def test_checkpoint_bytes_is_params_and_both_moments():
  cfg = load_config(["model.vocab_size=100", "model.d_model=8", "model.n_layers=1", "model.n_heads=2",
                     "model.n_kv_heads=1", "model.head_dim=4", "model.ffn_dim=16", "mesh.tensor=2"])
  # by hand: embed 100*8 + head 8*100 + attention 8*(2+2*1)*4 + 2*4*8 + mlp 3*8*16 + norms 3*8
  n = 800 + 800 + 128 + 64 + 384 + 24
  assert doctor.checkpoint_bytes(cfg) == 3 * 4 * n  # fp32 params + Adam mu and nu, whatever the mesh


# --- output_dir ----------------------------------------------------------------------------------------

def test_output_dir_writable_and_nothing_left(tmp_path):
  run_dir = tmp_path / "out" / "run"
  r = checks.check_output_dir(run_dir, True, 3, 1000)
  assert r.status == "pass" and r.found.startswith(f"{tmp_path} writable")
  assert list(tmp_path.iterdir()) == []  # neither the run directory nor a probe file left behind
  free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
  assert checks.check_output_dir(run_dir, True, 3, free + 2**30).status == "fail"
  r = checks.check_output_dir(run_dir, True, 3, free // 3)
  assert r.status == "warn" and "fewer than the 4 kept while saving" in r.found
  assert checks.check_output_dir(run_dir, False, 3, free * 2).status == "pass"  # no checkpoints: no need


def test_output_dir_under_a_file(tmp_path):
  (tmp_path / "file").write_text("x")
  r = checks.check_output_dir(tmp_path / "file" / "runs" / "r", False, 3, 1)
  assert r.status == "fail" and r.found == f"{tmp_path / 'file'} is not a directory, so {tmp_path}/file/runs/r cannot be created"


def _readonly_reason(tmp_path) -> str | None:
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && ! touch "$0/x"', str(probe)],
                       capture_output=True, text=True, timeout=30)
  except FileNotFoundError:
    return "unshare is not installed"
  probe.rmdir()
  return None if r.returncode == 0 else f"unshare -m / mount --bind -o ro not permitted: {r.stderr.strip()}"


def test_output_dir_read_only_mount(tmp_path):
  reason = _readonly_reason(tmp_path)
  if reason:
    pytest.skip(reason)
  out = tmp_path / "ro"
  out.mkdir()
  code = ("import sys; from pathlib import Path; from maxlm.tools.doctor.checks import check_output_dir\n"
          "r = check_output_dir(Path(sys.argv[1]) / 'run', False, 3, 1); print(r.status); print(r.found)")
  r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(out),
                      sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  status, found = r.stdout.splitlines()[:2]
  assert status == "fail" and found == f"cannot write {out} (for {out}/run): Read-only file system"
  assert list(out.iterdir()) == []


# --- the command -----------------------------------------------------------------------------------------

def test_results_are_one_line_each_with_the_fix():
  assert doctor.format_line(Result("cudnn", "fail", "two copies", "keep one")) == (
      "fail  cudnn            two copies  -> fix: keep one")
  assert doctor.format_line(Result("nccl", "pass", "ok", "ignored")) == "pass  nccl             ok"
  with pytest.raises(ValueError):
    Result("x", "maybe", "")


def test_a_check_that_raises_fails_alone(capsys):
  def boom():
    raise KeyError("cuda_runtime_get_version")
  r = doctor.guarded("cuda", boom)
  assert r.status == "fail" and r.found == "the check raised KeyError: 'cuda_runtime_get_version'"
  assert "Traceback" in capsys.readouterr().err


def test_in_process_all_checks_and_te_import_failure(monkeypatch, tmp_path, capsys):
  """Every check runs on CPU (GPU checks skipped); TE failing to import fails the te check and the exit code."""
  monkeypatch.setattr(te_probe, "te_import_error", lambda: "ImportError: undefined symbol: cudnnGetVersion")
  code = doctor.main(["--json", f"output_dir={tmp_path}", "model.backend=te"])
  report = json.loads(capsys.readouterr().out)
  by_name = {r["name"]: r for r in report["results"]}
  assert [r["name"] for r in report["results"]] == NAMES
  assert code == report["exit_code"] == 1 and report["summary"]["fail"] == 1
  assert by_name["te"]["status"] == "fail" and "undefined symbol" in by_name["te"]["found"]
  assert all(by_name[n]["found"] == NO_GPU for n in GPU_CHECKS)
  assert by_name["nccl"]["status"] == "pass" and "all-reduce over 8 device(s)" in by_name["nccl"]["found"]
  assert list(tmp_path.iterdir()) == []


def test_bad_config_is_exit_2(capsys):
  assert doctor.main(["model.n_layer=3"]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err == (
      "maxlm: error: unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)\n")


@pytest.mark.slow
def test_command_on_cpu_passes_and_a_bad_flag_fails(tmp_path):
  r = cli([f"output_dir={tmp_path}"])
  lines = r.stdout.splitlines()
  assert r.returncode == 0, r.stdout + r.stderr[-3000:]
  assert [ln.split()[1] for ln in lines[:-1]] == NAMES
  assert {ln.split()[0] for ln in lines[:-1]} == {"pass", "skip"}
  assert all(f"{n}" in ln and ln.endswith(NO_GPU) for n, ln in zip(NAMES, lines[:-1]) if n in GPU_CHECKS)
  assert lines[-1] == "maxlm doctor: 6 pass, 0 warn, 0 fail, 6 skip"
  bad = cli([f"output_dir={tmp_path}", "--json"],
            env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_gpu_no_such_flag=true"})
  report = json.loads(bad.stdout)
  by_name = {x["name"]: x for x in report["results"]}
  assert bad.returncode == 1 and report["exit_code"] == 1
  assert by_name["xla_flags"]["status"] == "fail" and "--xla_gpu_no_such_flag=true" in by_name["xla_flags"]["found"]
  assert "--xla_force_host_platform_device_count" not in by_name["xla_flags"]["found"]
  assert {by_name[n]["status"] for n in NAMES[2:-1]} == {"skip"}  # the backend was never started
  assert by_name["output_dir"]["status"] == "pass"


@pytest.mark.mpi
@pytest.mark.slow
def test_two_processes_under_mpirun_each_check_and_all_reduce_across_both(tmp_path):
  """Under `mpirun -np 2` (OpenMPI, started by scripts/ci_services.sh) with 2 CPU devices each: every process
  runs every check, the all-reduce spans the 4 devices of both, and with --json each process's stdout holds
  exactly its JSON document (Gloo prints connection lines to stdout from C++; they must go to stderr)."""
  if not shutil.which("mpirun"):
    pytest.skip("OpenMPI is not installed here (run scripts/ci_services.sh start)")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + FAST_CPU, "JAX_PLATFORMS": "cpu"}
  mpirun = ["mpirun", "-np", "2", "--allow-run-as-root", "--bind-to", "none", "-x", "XLA_FLAGS", "-x", "JAX_PLATFORMS",
            "-x", "PATH", "-x", "PYTHONPATH"]
  per_rank = f"{sys.executable} -m maxlm.tools.doctor output_dir={tmp_path} --json > {tmp_path}/r$OMPI_COMM_WORLD_RANK.json"
  r = subprocess.run([*mpirun, "sh", "-c", per_rank], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr[-3000:]
  for rank in (0, 1):
    report = json.loads((tmp_path / f"r{rank}.json").read_text())  # the whole file is one document
    by_name = {x["name"]: x for x in report["results"]}
    assert report["exit_code"] == 0 and [x["name"] for x in report["results"]] == NAMES
    assert "2 x cpu" in by_name["devices"]["found"] and "2 process(es)" in by_name["devices"]["found"]
    assert f"launcher: mpi, process {rank}" in by_name["devices"]["found"]
    assert by_name["nccl"]["status"] == "pass" and "all-reduce over 4 device(s) in 2 process(es) correct" in \
        by_name["nccl"]["found"]
  # The lines, merged by mpirun: both processes report every check, each line with its process prefix.
  lines = subprocess.run([*mpirun, sys.executable, "-m", "maxlm.tools.doctor", f"output_dir={tmp_path}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
  assert lines.returncode == 0, lines.stdout + lines.stderr[-3000:]
  for rank in (0, 1):
    mine = [ln for ln in lines.stdout.splitlines() if ln.startswith(f"[process {rank}/2 ")]
    assert [ln.split("] ", 1)[1].split()[1] for ln in mine[:-1]] == NAMES, lines.stdout
    assert mine[-1].endswith("maxlm doctor: 6 pass, 0 warn, 0 fail, 6 skip")


@pytest.mark.gpu
def test_every_check_passes_on_the_gpu(tmp_path):
  """On the H200: `pytest -m gpu tests/test_doctor.py` (llama8b shape, FP8 delayed as configured)."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  r = subprocess.run([sys.executable, "-m", "maxlm.tools.doctor", "config=llama8b.yml", "model.n_layers=4",
                      "data.seq_len=4096", "data.global_batch_size=4", "model.precision=fp8_delayed",
                      f"output_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  print(r.stdout)
  assert r.returncode == 0, r.stdout + r.stderr[-3000:]
  statuses = {ln.split()[1]: ln.split()[0] for ln in r.stdout.splitlines()[:-1]}
  assert list(statuses) == NAMES
  # warn is allowed (e.g. memory_settings when the machine sets XLA_PYTHON_CLIENT_PREALLOCATE=false)
  assert set(statuses.values()) <= {"pass", "warn"} and statuses["fused_attention"] == "pass", r.stdout
