"""Check this machine for a run: versions, GPU, CUDA/cuDNN, TE, fused attention, FP8, NCCL, memory, XLA flags.

  maxlm doctor [config=FILE] [key=value ...] [--json]       (= python -m maxlm.tools.doctor ...)

One line per check: pass, warn, fail or skip, what was found, and (for warn/fail) the fix. The config
is the run's (same keys as `maxlm train`): fused attention is tried with its head_dim, GQA ratio,
sliding window and dtype; FP8 against its model.precision; memory against its size; output_dir against
its checkpoints. XLA_FLAGS are checked as the run would start with them (the xla.preset merged in) in
a separate process, since XLA aborts on an unknown flag. On a machine without a GPU the GPU checks say
"skipped: no GPU"; the all-reduce still runs over the CPU devices. Under srun/mpirun every process
checks, and the all-reduce spans all of them.

Checks: versions, xla_flags, devices, cuda, te, fused_attention, cudnn, fp8, nccl, memory_settings,
memory_fit, output_dir. `--json` prints one JSON object {"results": [...], "summary": {...},
"exit_code": N} instead of the lines, as the only output on stdout (one per process under srun/mpirun;
anything else, such as Gloo's connection lines, goes to stderr).

Exit codes: 0 no check failed (warnings allowed), 1 a check failed, 2 bad configuration or arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable

from maxlm.cli.grammar import command_main, parse_options
from maxlm.config import Config, ConfigError, MeshConfig, load_config
from maxlm import plan
from maxlm.runtime import distributed, process_output, startup, xla_presets
from maxlm.tools.doctor import checks, probes
from maxlm.tools.doctor.checks import STATUSES, Result

EXIT_FAILED = 1
BACKEND_CHECKS = ("devices", "cuda", "te", "fused_attention", "cudnn", "fp8", "nccl", "memory_settings",
                  "memory_fit")


def guarded(name: str, fn: Callable[[], Result]) -> Result:
  """Run one check; a check that raises is reported as failed (traceback on stderr), never kills the rest."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 - the doctor reports, whatever a probe raises
    traceback.print_exc(file=sys.stderr)
    return Result(name, "fail", f"the check raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
                  "see the traceback on stderr; report it if the cause is not in it")


def format_line(r: Result) -> str:
  line = f"{r.status:<4}  {r.name:<15}  {r.found}"
  return line + (f"  -> fix: {r.fix}" if r.fix and r.status in ("warn", "fail") else "")


def checkpoint_bytes(cfg: Config) -> int:
  """One checkpoint: parameters, both Adam moments and FP8 metadata of the whole model (one device)."""
  whole = dataclasses.replace(cfg, mesh=MeshConfig(data=1, fsdp=1, tensor=1, dcn_data=1, dcn_fsdp=1, dcn_tensor=1))
  est = plan.size(whole, devices=1, mode="off").analytic
  return est["params"] + est["optimizer"] + est["host"] + est.get("fp8_meta", 0)


def _attention_shape(m) -> str:
  return (f"{m.n_heads} heads / {m.n_kv_heads} kv (GQA {m.n_heads // m.n_kv_heads}), head_dim {m.head_dim}, "
          f"window {m.sliding_window or 'none'}, {m.dtype}")


def _on_timeout(msg: str) -> None:
  print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)
  os._exit(EXIT_FAILED)


def _backend_checks(cfg: Config, emit: Callable[[Result], None]) -> bool:
  """The checks that need the JAX backend (started here). Returns True when the all-reduce hung."""
  # Lazy on purpose: these import JAX (and TE), which `maxlm doctor --help` and the checks before the
  # backend (versions, the XLA_FLAGS subprocess) do not need.
  import jax  # noqa: PLC0415

  from maxlm.layers import supported_precisions, te_probe  # noqa: PLC0415
  from maxlm.runtime.devices import device_memory_bytes  # noqa: PLC0415

  launch_error = None
  try:
    launch = distributed.initialize(cfg, on_timeout=_on_timeout)
  except ConfigError as e:
    launch, launch_error = None, str(e)
  gpu = jax.default_backend() == "gpu"
  hardware = xla_presets.detect_gpu()

  def devices():
    if launch_error:
      return Result("devices", "fail", launch_error, "see launch/README.md for srun/mpirun set-ups")
    launcher = f"{launch.launcher}, process {launch.process_id}" if launch else "none (one process)"
    return checks.check_devices(jax.default_backend(), [d.device_kind for d in jax.local_devices()],
                                jax.local_device_count(), jax.process_count(), device_memory_bytes(), launcher,
                                hardware[0] if hardware else None)

  emit(guarded("devices", devices))
  te_error = te_probe.te_import_error()
  te_ok = te_error is None
  te_libs = te_probe.te_library_versions() if te_ok and gpu else {}
  emit(guarded("cuda", lambda: checks.check_cuda(gpu, probes.driver_version() if gpu else None,
                                                 probes.jax_cuda_versions().get("cuda") if gpu else None,
                                                 te_libs.get("cuda"))))
  emit(guarded("te", lambda: checks.check_te(
      gpu, cfg.model.backend, te_error, te_probe.te_version() if te_ok else None,
      te_probe.custom_call_targets() if te_ok and gpu else None, te_probe.env_custom_calls())))
  m = cfg.model

  def fused():
    probe = None
    if gpu and te_ok and os.environ.get("NVTE_FUSED_ATTN", "1").strip() != "0":
      probe = te_probe.probe_fused_attention(n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                                             window=m.sliding_window, dtype=m.dtype,
                                             max_segments=cfg.data.max_segments_per_row)
    return checks.check_fused_attention(gpu, te_ok, _attention_shape(m), probe, os.environ.get("NVTE_FUSED_ATTN"))

  emit(guarded("fused_attention", fused))
  emit(guarded("cudnn", lambda: checks.check_cudnn(gpu, probes.loaded_libraries(),
                                                   probes.jax_cuda_versions().get("cudnn") if gpu else None,
                                                   te_libs.get("cudnn"))))
  emit(guarded("fp8", lambda: checks.check_fp8(gpu, m.precision, m.backend,
                                               supported_precisions() if te_ok else ["bf16"])))
  allreduce = probes.all_reduce(cfg.distributed.initialization_timeout_s)
  emit(guarded("nccl", lambda: checks.check_nccl(gpu, jax.device_count(), jax.process_count(), allreduce,
                                                 probes.nccl_version(probes.loaded_libraries()) if gpu else None)))
  emit(guarded("memory_settings", lambda: checks.check_memory_settings(gpu, os.environ)))
  emit(guarded("memory_fit", lambda: checks.check_memory_fit(
      gpu, plan.size(cfg, devices=jax.device_count(), nodes=jax.process_count(), mode="off").analytic,
      device_memory_bytes() if gpu else None,
      f"{jax.device_count()} device(s), model.remat={m.remat}, batch {cfg.data.global_batch_size} x {cfg.data.seq_len}")))
  return bool(allreduce.get("hung"))


def run_checks(cfg: Config, emit: Callable[[Result], None]) -> bool:
  """Every check, in order, each handed to `emit` as it completes. Returns True if a collective hung
  (the process must then end with os._exit). Raises ConfigError for settings that conflict."""
  try:  # under srun/mpirun, every line names its process from the first one on (the backend starts later)
    launch = distributed.resolve(cfg.distributed, os.environ)
  except ConfigError:
    launch = None  # the devices check reports it, after the checks that need no backend
  if launch is not None:
    process_output.prefix_output(launch.prefix)
  startup.begin(cfg)  # as `maxlm train` starts: the preset, deterministic flags, memory share, cache
  preset_line = "xla.preset={} ({})".format(*xla_presets.resolve(cfg.xla.preset))
  emit(guarded("versions", lambda: checks.check_versions(probes.installed_versions(), probes.required_ranges(),
                                                         probes.installed_plugins())))
  flags = os.environ.get("XLA_FLAGS", "")
  xla = guarded("xla_flags", lambda: checks.check_xla_flags(flags, preset_line, *probes.start_backend(flags)))
  emit(xla)
  hung = False
  if xla.status == "fail":  # this process would abort as it starts the backend
    for name in BACKEND_CHECKS:
      emit(Result(name, "skip", "skipped: the JAX backend cannot start under these XLA_FLAGS (see xla_flags)"))
  else:
    hung = _backend_checks(cfg, emit)
  emit(guarded("output_dir", lambda: checks.check_output_dir(cfg.run_dir, cfg.checkpoint.enabled,
                                                             cfg.checkpoint.keep, checkpoint_bytes(cfg))))
  return hung


@contextlib.contextmanager
def _stdout_to_stderr():
  """With --json, file descriptor 1 points at stderr while the checks run, so the JSON document is all that
  reaches stdout: C++ libraries write there directly (Gloo's connection lines under mpirun, for one)."""
  sys.stdout.flush()
  saved = os.dup(1)
  os.dup2(2, 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


def run(argv: list[str]) -> int:
  opts, args = parse_options(argv, ("--json",))
  as_json = opts.get("json", False)
  results: list[Result] = []

  def emit(r: Result) -> None:
    results.append(r)
    if not as_json:
      print(format_line(r), flush=True)

  with _stdout_to_stderr() if as_json else contextlib.nullcontext():
    cfg = load_config(args)  # a bad config or argument: one line, exit 2 (command_main)
    hung = run_checks(cfg, emit)
  summary = {s: sum(r.status == s for r in results) for s in STATUSES}
  code = EXIT_FAILED if summary["fail"] else 0
  if as_json:  # unprefixed: the document is the whole of stdout (its `devices` result names the process)
    process_output.restore_output()
    print(json.dumps({"results": [dataclasses.asdict(r) for r in results], "summary": summary, "exit_code": code}),
          flush=True)
  else:
    print(f"maxlm doctor: {', '.join(f'{n} {s}' for s, n in summary.items())}", flush=True)
  if hung:  # a thread is stuck in a collective; interpreter shutdown could wait on it forever
    sys.stderr.flush()
    os._exit(code)
  return code


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
