"""Compile-only GPU targets: the train step compiled by XLA:GPU for N GPUs of a named kind, with none present.

JAX's CUDA plugin makes compile-only devices from a GPU description (`jax.experimental.topologies.
get_topology_desc(platform="cuda", target_config=<GpuTargetConfigProto text>, topology="1xMxK")`: M hosts of K
GPUs, each host a process, so maxlm.parallel.mesh lays the mesh's dcn axes over them as over the nodes of a cluster).
XLA:GPU then compiles maxlm's step for them on a CPU machine, no driver needed, and its `memory_analysis()` is
XLA:GPU's own buffer assignment. Against an H200 measuring itself (docs/plan.md, "Compiled for XLA:GPU without
a GPU"): within -5.3% to +1.8% with jax 0.10.2 and the guard compiled as a select, and within 3% with jax 0.11.2
as shipped; the CPU simulation (maxlm/plan/target.py's Simulator) was 13.5% to 22% high.

The kinds (`KINDS`, files in gpu_targets/): h200, h100 (SXM, 80 GB) and b200, XLA's own specs trimmed. Where
the plugin is: importable here (a GPU machine's jax[cuda]), else the folder `$MAXLM_GPU_COMPILER`, else
`<venv>/maxlm-gpu-compiler` (scripts/setup.sh installs it there with `pip install --target`: importable
in the venv, its CUDA checks would print a traceback at every JAX start on a machine without a GPU). The
plugin must be the installed jaxlib's version. `GpuCompiler` measures in one child process per device count
(the plugin must be on the path when JAX starts), with `JAX_PLATFORMS=cpu` (the plugin then skips its checks
of the CUDA libraries) and the XLA flags `xla.preset` gives that GPU (maxlm/runtime/xla_presets.py). Its
attention is fused attention's footprint, as in the simulation (no Transformer Engine kernels on a CPU host).

Known difference: jax 0.10.2's XLA:GPU keeps a copy of the donated state under the step's `lax.cond` (the
non-finite guard); 0.11.2 does not (docs/plan.md). Every result says which jax measured.

Host memory (optim.offload): compile-only devices have no memories, and a NamedSharding over them drops its memory
kind (JAX canonicalizes it against the devices' memories), so the state's shardings as the trainer builds them
would compile the offload=none program. `compile_in_host_memory` compiles the trainer's step function again with
the state's shardings over the mesh's AbstractMesh, which keeps memory kinds, lowered inside the concrete mesh:
XLA:GPU's own program with the state in pinned host memory (its host bytes in memory_analysis's host_* fields).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from maxlm.offload import place
from maxlm.plan.kinds import KINDS, GpuKind, kind_for  # noqa: F401 - KINDS, kind_for: the kinds compiled for, read here by callers
from maxlm.runtime import xla_presets

ENV_FOLDER = "MAXLM_GPU_COMPILER"
# a what-if (benchmarks/gpu_plan.py --guard-as-select): the child compiles the step's non-finite guard as a select
# (maxlm/plan/standins.py for_gpu_step's guard_select), as jax 0.11.2's XLA:GPU updates the state in place under the cond
GUARD_AS_SELECT = "MAXLM_PLAN_GUARD_AS_SELECT"
FOLDER_NAME = "maxlm-gpu-compiler"
PLUGINS = ("xla_cuda13", "xla_cuda12")  # jax_plugins.<name>; the pip names are jax-cuda13-plugin/-pjrt, ...


COND_COPY = ("jax 0.10's XLA:GPU keeps a copy of the donated state under the step's lax.cond (docs/plan.md): "
             "high by up to the parameters and moments; jax 0.11.2's does not")


def cond_copies() -> bool:
  """Whether this jax's XLA:GPU copies the donated state under a lax.cond (0.10.2 does, 0.11.2 does not)."""
  return tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)




@dataclasses.dataclass(frozen=True)
class Plugin:
  folder: str  # to put on the child's path; "" where this interpreter imports the plugin already
  version: str


def _jaxlib_version() -> str:
  return importlib.metadata.version("jaxlib")


def _folder_version(folder: Path) -> str | None:
  """The version of the CUDA plugin installed (pip --target) in `folder`, or None."""
  if not any((folder / "jax_plugins" / name).is_dir() for name in PLUGINS):
    return None
  for dist in importlib.metadata.distributions(path=[str(folder)]):
    if dist.metadata["Name"] and dist.metadata["Name"].lower().replace("_", "-").startswith("jax-cuda1"):
      return dist.version
  return None


def find_plugin() -> tuple[Plugin | None, str]:
  """(the CUDA plugin to compile with, or None; why none)."""
  want = _jaxlib_version()
  for name in PLUGINS:
    if importlib.util.find_spec("jax_plugins") is not None and importlib.util.find_spec(f"jax_plugins.{name}"):
      try:
        have = importlib.metadata.version(f"jax-{name.removeprefix('xla_')}-plugin")
      except importlib.metadata.PackageNotFoundError:
        have = want  # a jaxlib built with it (no separate wheel)
      if have == want:
        return Plugin("", have), ""
  env = os.environ.get(ENV_FOLDER)
  folder = Path(env) if env else Path(sys.prefix) / FOLDER_NAME
  have = _folder_version(folder)
  if have is None:
    where = f"${ENV_FOLDER}={env}" if env else str(folder)
    return None, f"no CUDA plugin for jaxlib {want} (none in {where}; bash scripts/setup.sh installs it)"
  if have != want:
    return None, f"the CUDA plugin in {folder} is {have}, jaxlib is {want} (bash scripts/setup.sh reinstalls it)"
  return Plugin(str(folder), have), ""


def preset_flags(preset: str, kind: GpuKind) -> tuple[str, ...]:
  """The XLA flags xla.preset gives a GPU of this kind (auto: by its compute capability)."""
  name, _ = xla_presets.resolve(preset, gpu=(kind.kind, kind.capability))
  return xla_presets.PRESETS[name]


def compiler_env(plugin: Plugin, preset: str, kind: GpuKind) -> dict[str, str]:
  """The environment of a child that compiles for GPUs of `kind` (see the module doc)."""
  env = dict(os.environ)
  if plugin.folder:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin.folder, env.get("PYTHONPATH", "")) if p)
  env["XLA_FLAGS"] = xla_presets.merge(env.get("XLA_FLAGS", ""), preset_flags(preset, kind))[0]
  # LLVM's optimization of the generated code, not the buffer assignment before it (the same bytes measured)
  env["XLA_FLAGS"] = xla_presets.merge(env["XLA_FLAGS"], ("--xla_backend_optimization_level=0",
                                                          "--xla_llvm_disable_expensive_passes=true"))[0]
  env["JAX_PLATFORMS"] = "cpu"
  return env


def compile_only_devices(kind: GpuKind, n_devices: int, n_nodes: int = 1) -> list:
  """n_devices compile-only GPUs of `kind` on n_nodes hosts (device id // (n_devices / n_nodes) = its host).
  Only where the plugin was on the path when JAX started (the child of `maxlm.plan.measure.gpu_compiler`)."""
  if n_devices % n_nodes:
    raise ValueError(f"{n_devices} devices do not split over {n_nodes} nodes")
  topo = topologies.get_topology_desc(platform="cuda", target_config=kind.config_text(),
                                      topology=f"1x{n_nodes}x{n_devices // n_nodes}")
  return list(topo.devices)


# the child's program: measure.py's `gpu_worker`, which compiles on `compile_only_devices`
WORKER = "import sys; from maxlm.plan.measure import gpu_worker; sys.exit(gpu_worker(*sys.argv[1:]))"


def drops_memory_kinds(mesh) -> bool:
  """Compile-only devices: no memories, so a sharding over them loses its memory kind (see the module doc)."""
  return not mesh.devices.flat[0].addressable_memories()


def compile_in_host_memory(built, offload: str):
  """The train step of `built` (maxlm/build.py) compiled on its compile-only devices with the state in the memories
  `offload` gives it (maxlm/offload.py `place`), through shardings over the mesh's AbstractMesh."""
  am = built.mesh.abstract_mesh
  shardings = place(jax.tree.map(lambda s: NamedSharding(am, s.spec), built.state_shardings), offload)
  structs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), built.state, shardings)
  bs = NamedSharding(am, built.batch_sharding.spec)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bs) for k, v in built.batch_structs().items()}
  jitted = built.train_step.jitted_with(shardings, {k: bs for k in batch}, NamedSharding(am, PartitionSpec()))
  with built.scope():
    return jitted.lower(structs, batch).compile()
