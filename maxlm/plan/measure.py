"""Per-device memory of the real train step, measured by XLA: compiled ahead of time on abstract shapes.

`measure(cfg)` builds the train step with the trainer's builder (maxlm/build.py: the same model, optimizer,
shardings, `jax.jit` in/out shardings and donation), lowers it on `jax.ShapeDtypeStruct`s that carry their
shardings, compiles it and reads `memory_analysis()`. Nothing is allocated. Per device: arguments + outputs +
temporaries - aliased (the donated state), `maxlm.build.memory_stats`; the host_* fields (state in pinned host
memory) are kept apart.

On the devices at hand the step is the one that will run. For more devices than are present,
`Simulator(n)` (maxlm/plan/target.py) runs the same measurement in one child process on n simulated CPU devices
(`--xla_force_host_platform_device_count=n`, `JAX_PLATFORMS=cpu`), one JSON line per config. That is
XLA:CPU's buffer assignment, not XLA:GPU's: no Transformer Engine kernels, other fusions. Its worst
difference, the [B, H, T, T] attention scores that CPU attention materializes and cuDNN's fused attention
never holds (52.3 GB of temporaries per device for the 8B shape at sequence 8192 on 8 devices, of which the
scores are most), is removed by `gpu_footprint=True`: a stand-in with fused attention's footprint
(custom VJP keeping q, k, v, the output and fp32 softmax statistics [B, H, T]; its values are not
attention's), used only for such measurements. Its other big difference, bf16 computed (and FSDP's weights
gathered) in f32, is removed there too: the step is compiled with bf16 kept (`GPU_DTYPE_OPTIONS`). Unrolled
layers (`model.scan_layers=false`) are measured scanned: XLA:CPU's unrolled program keeps far more than
XLA:GPU's memory-aware scheduler does, and more with every layer (the 8B shape on one simulated device, full
remat, bfloat16 moments: 679 GiB unrolled, where the H200 measured 110 GiB with save_attn; cut to 4 layers on 8
devices: 19.9 GiB unrolled, 12.0 GiB scanned, 3.9 GB more per unrolled layer against 0.57 GB per scanned one,
about a layer's state and activations; both before bf16 was kept). Scanned, 80 layers also compile in the time
of 4. Against XLA:GPU on one H200 (the 8B shape cut to 4 layers, batch 4 x 4096, every remat policy;
docs/plan.md) the scanned simulation was 29% to 67% high, and is 13.5% to 22% high with bf16 kept: a
conservative stand-in, not a measurement of the GPU. XLA's own warnings during a compile are caught and summarized
in the result ("xla_log", maxlm/plan/xla_log.py); `Target.progress` gets a line every 30 s of a compile (heartbeat.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax

from maxlm.build import Built, build_step, memory_stats
from maxlm.config import Config, ConfigError, from_dict
from maxlm.parallel.mesh import make_mesh
from maxlm.optim import LAG
from maxlm.parallel.pipelining import check as check_pipeline
from maxlm.plan import collectives, xla_gpu, xla_log
from maxlm.plan.kinds import KINDS
from maxlm.plan.standins import GPU_DTYPE_OPTIONS, for_gpu_step
from maxlm.runtime.devices import is_oom


def _shard_bytes(structs) -> int:
  """Bytes one device holds of a tree of abstract arrays carrying their shardings."""
  return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(structs))


def compile_step(cfg: Config, devices=None, fused_attention: bool = False, unrolled: bool = False,
                 guard_select: bool = False):
  """(compiled train step of `cfg` on `devices` (default: all), {"params", "opt_state", "opt_leaf_fp32": bytes
  per device, "bf16_kept"}), from abstract shapes only: the trainer's step (maxlm/build.py). fused_attention
  (measuring a GPU's step): with fused attention's footprint, and on CPU devices with bf16 kept
  (GPU_DTYPE_OPTIONS; bf16_kept: True, False where XLA:CPU could not compile it so, None where not asked).
  unrolled: the model is scanned for the measurement only, so a scanned stack counts per layer in opt_leaf_fp32
  (as it does where an offloaded state streams the stack a layer at a time: no pipeline stages, maxlm/optim.py)."""
  built, gpu_dtypes = measured_build(cfg, devices, fused_attention, guard_select)
  structs, batch = built.state, built.batch_structs()
  split = built.mesh.shape["pipeline"] == 1  # maxlm/build.py's make_optimizer(split_layers=...)
  kept, host = None, cfg.optim.offload != "none" and xla_gpu.drops_memory_kinds(built.mesh)
  if host:  # compile-only GPUs: the state in host memory through AbstractMesh shardings (maxlm/plan/xla_gpu.py)
    compiled = xla_gpu.compile_in_host_memory(built, cfg.optim.offload)
  elif not gpu_dtypes:
    compiled = built.train_step.compile(structs, batch)
  else:
    lowered, kept = built.train_step.lower(structs, batch), True
    try:
      compiled = lowered.compile(GPU_DTYPE_OPTIONS)
    except jax.errors.JaxRuntimeError as e:
      if is_oom(e):
        raise
      # a bf16 instruction XLA:CPU cannot emit (a bf16 GEMM not traced through `_gpu_dot`): its usual
      # program, bf16 computed in f32 (higher, as before GPU_DTYPE_OPTIONS)
      compiled, kept = lowered.compile(), False
  return compiled, {"params": _shard_bytes(structs.params), "opt_state": _shard_bytes(structs.opt_state),
                    "opt_leaf_fp32": _largest_parameter(structs.params, cfg.model.n_layers if unrolled or split else 1),
                    "bf16_kept": kept, "host_memory": host}


def measured_build(cfg: Config, devices=None, fused_attention: bool = False,
                   guard_select: bool = False) -> tuple[Built, bool]:
  """(the abstract build of `cfg`'s train step on `devices` that `compile_step` compiles, whether it keeps bf16
  as a GPU does). Without fused_attention it is the trainer's own program: under compile.warm_start it is kept,
  so that the run's start loads it instead of tracing it again (maxlm/runtime/warm_start.py)."""
  mesh = make_mesh(cfg.mesh, devices)
  check_pipeline(cfg.model, cfg.train, cfg.mesh, mesh.shape["pipeline"], mesh.shape["context"])  # as the trainer
  gpu_dtypes = fused_attention and mesh.devices.flat[0].platform == "cpu"  # a GPU's step, on XLA:CPU
  standins = for_gpu_step(gpu_dtypes, guard_select) if fused_attention else None
  return build_step(cfg, mesh, abstract=True, standins=standins), gpu_dtypes


def _largest_parameter(params, n_layers: int) -> int:
  """Float32 bytes of one device's shard of the largest parameter, a scanned stack counted per layer (what
  an unrolled model's streamed update moves at once, and a scanned one's where it streams the stack a layer at a
  time; see `offloaded`)."""
  sizes = []
  for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
    n = math.prod(a.sharding.shard_shape(a.shape)) * 4
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    sizes.append(n // n_layers if stacked else n)
  return max(sizes, default=0)


def measure(cfg: Config, devices=None, gpu_footprint: bool = False, inspect=None, guard_select: bool = False,
            xla_gpu: bool = False) -> dict:
  """memory_stats of cfg's compiled train step, with the state's parts and "how" the device bytes were
  found; {"oom": message} where XLA itself runs out compiling. gpu_footprint (measuring for a GPU on CPU
  devices, or on compile-only GPUs: maxlm/plan/xla_gpu.py): attention with fused attention's footprint,
  unrolled layers scanned, and an offloaded optimizer state by `offloaded`. inspect(compiled) -> dict: more
  fields read off the compiled step (the GPU target's collectives). guard_select: see standins.for_gpu_step.
  xla_gpu (compile-only GPUs): an unrolled model with optim.offload=host_params is compiled as written, not
  scanned. There XLA:GPU hoists the recomputed MLP products of every layer to the start of the backward pass
  at grad_accum=1, which the scanned stand-in misses: the 8B on one H100, save_attn, grad_accum=1, measured
  203.6 GiB unrolled against 71.5 GiB scanned (benchmarks/results/2026-12-06-host_params_deviceless_h100.jsonl)."""
  as_written = xla_gpu and cfg.optim.offload == "host_params"
  how, unrolled = "measured", gpu_footprint and not cfg.model.scan_layers and not as_written
  if unrolled:  # see the module doc
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
    how = "measured, layers scanned"
  try:
    with xla_log.caught() as log:  # XLA's own warnings (glog, fd 2): summarized in the result, not printed
      compiled, parts = compile_step(cfg, devices, gpu_footprint, unrolled, guard_select)
  except jax.errors.JaxRuntimeError as e:
    if not is_oom(e):
      raise
    return {"oom": str(e).splitlines()[0][:300]} | log.fields()
  if parts.pop("bf16_kept") is False:
    how += ", bf16 computed in f32 (XLA:CPU could not compile the step with bf16 kept: higher)"
  host = parts.pop("host_memory")  # XLA:GPU's own program with the state in host memory: no arithmetic
  out = memory_stats(compiled) | parts | {"how": how} | log.fields() | (inspect(compiled) if inspect else {})
  return offloaded(out, cfg.optim.offload) if gpu_footprint and cfg.optim.offload != "none" and not host else out


def offloaded(stats: dict, offload: str = "host") -> dict:
  """XLA:CPU has one memory (host offload compiles to the same program), and XLA:GPU's compile-only devices
  report no host memory (a sharding over them drops its memory kind: benchmarks/gpu_deviceless.py), so there the
  device bytes of an optimizer state kept in host memory are arithmetic: the measured peak less the state, plus
  what the streamed update (maxlm/optim.py) holds on the device at once: the moments of LAG parameters, each
  upcast to float32 and updated (old and new), taken for the largest parameter (of each layer where the layers
  were scanned for the measurement only or the stack streams a layer at a time; a whole stack where pipeline
  stages split it). offload="host_params": the parameters are left out too and stream with their moments
  (float32, old and new); the program measured holds their compute-dtype copy (the host_params step itself, or
  offload=none with model.cast_params_once: `Simulator`)."""
  both = offload == "host_params"
  stream = LAG * 2 * (3 if both else 2) * stats["opt_leaf_fp32"]  # LAG parameters x (old, new) x (mu, nu[, p])
  state = stats["opt_state"] + (stats["params"] if both else 0)
  what = "the parameters and the optimizer state" if both else "the optimizer state"
  moved = "parameters and moments" if both else "parameters' moments"
  return stats | {"device": stats["device"] - state + stream,
                  "how": f"arithmetic: the compiled peak - {what} + {LAG} streamed {moved}"}


def worker(measure_one=None, out=None) -> int:
  """Child side of `Simulator`: one config (JSON) per input line, one result (JSON) per output line (on `out`,
  default stdout), by measure_one(cfg) (default: `measure` with fused attention's footprint)."""
  out = out or sys.stdout
  sys.stdout = sys.stderr  # anything else printed goes to stderr: stdout carries the answers only
  for line in sys.stdin:
    try:
      result = (measure_one or (lambda c: measure(c, gpu_footprint=True)))(from_dict(json.loads(line)))
    except ConfigError as e:
      result = {"error": str(e)}
    out.write(json.dumps(result) + "\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(worker())


def gpu_worker(key: str, n_devices: str, n_nodes: str) -> int:
  """Child side of the XLA:GPU compiler (maxlm/plan/target.py `gpu_compiler`, maxlm/plan/xla_gpu.py): one config
  (JSON) per input line, one result (JSON) per output line: `measure`'s dict with the collectives of the compiled step and the jax
  version, compiled for n_devices compile-only GPUs of `key` on n_nodes hosts."""
  out = sys.stdout
  sys.stdout = sys.stderr  # anything else printed goes to stderr: stdout carries the answers only
  n, nodes = int(n_devices), int(n_nodes)
  devices = xla_gpu.compile_only_devices(KINDS[key], n, nodes)
  select = os.environ.get(xla_gpu.GUARD_AS_SELECT) == "1"

  def inspect(compiled) -> dict:
    inv = collectives.inventory(compiled.as_text(), n // nodes, n)
    return {"collectives": inv, "jax": jax.__version__} | ({"guard": "select (what-if)"} if select else {})
  return worker(lambda c: measure(c, devices, gpu_footprint=True, inspect=inspect, guard_select=select, xla_gpu=True),
                out)
