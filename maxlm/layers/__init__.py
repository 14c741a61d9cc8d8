"""Layer backends and everything precision-related. Only this package imports Transformer Engine.

`get_backend("te"|"flax")` returns a module exposing the same functions with the same parameter
trees: `rms_norm`, `norm_dense`, `dense`, `norm_mlp`, `attention`, `no_quantization`.
"""

from __future__ import annotations

import contextlib
import types

import jax

from maxlm.errors import BadInput
from maxlm.layers import flax_backend
from maxlm.layers.te_env import import_te, on_gpu, te_installed
from maxlm.tables import PRECISIONS, REMATS

BACKENDS = ("te", "flax")
# model.precision -> the TE recipe class that runs it (maxlm/tables.py). TE reports which of these the GPU
# supports (`supported_precisions`): FP8 from Hopper, MXFP8 and NVFP4 from Blackwell.
RECIPES = {name: p.recipe for name, p in PRECISIONS.items() if p.quantized}
FP8_COLLECTION = "fp8_metas"  # == transformer_engine.jax.NVTE_FP8_COLLECTION_NAME


class PrecisionError(BadInput, RuntimeError):
  """The configured precision cannot run on this machine or backend."""


def resolve_backend(name: str) -> str:
  """`auto` means TE when it is installed, else the pure Flax backend."""
  if name == "auto":
    return "te" if te_installed() else "flax"
  if name == "te" and not te_installed():
    raise PrecisionError("model.backend=te but Transformer Engine is not installed "
                         "(bash scripts/setup.sh installs it; or use model.backend=flax)")
  if name not in BACKENDS:
    raise ValueError(f"unknown backend {name!r}")
  return name


def get_backend(name: str) -> types.ModuleType:
  name = resolve_backend(name)
  if name == "te":
    import_te()
    from maxlm.layers import te_backend  # noqa: PLC0415 - TE: only once chosen and set up
    return te_backend
  return flax_backend


def make_recipe(precision: str, amax_history_len: int = 1024):
  """The TE quantization recipe of a precision name (None for the unquantized ones)."""
  if precision not in RECIPES:
    return None
  import_te()  # sets up the host (CPU fallbacks, NCCL preload) before TE's first import
  from transformer_engine.common import recipe  # noqa: PLC0415 - TE is imported only when a recipe is used
  if precision == "fp8_delayed":
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=amax_history_len,
                                 amax_compute_algo="max")
  if precision == "fp8_current":
    return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
  if precision == "mxfp8":  # forward and backward
    return recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3)
  # NVFP4 (E2M1 values, E4M3 scale per 16 elements + a per-tensor scale) with TE's defaults: random
  # Hadamard transform and 2D weight blocks on. Stochastic rounding of gradients is off: it draws from an
  # `sr_rng` stream that the train step does not pass to model.apply (yet).
  return recipe.NVFP4BlockScaling(disable_stochastic_rounding=True)


def supported_precisions() -> list[str]:
  """Precisions this machine can run with TE (bf16 and fp16 always; FP8 recipes as the GPU reports)."""
  out = [name for name, p in PRECISIONS.items() if not p.quantized]
  if not te_installed():
    return out
  te = import_te()
  from transformer_engine.jax.quantize import device_utils  # noqa: PLC0415 - TE: only once chosen and set up
  try:
    # Ask for the compute capability first: without a CUDA driver it raises, and TE's recipe probe must
    # not run then, since it caches a scaling mode as supported before its check raises (after a few
    # calls a CPU host would claim every recipe).
    device_utils.get_device_compute_capability(0)
    recipes = te.quantize.get_supported_quantization_recipes()
  except Exception:  # noqa: BLE001 - no GPU driver: no quantized recipes here
    return out
  names = {type(r).__name__ for r in recipes}
  out += [p for p, n in RECIPES.items() if n in names]
  return out


def check_precision(precision: str, backend: str) -> None:
  """Stop with a clear message when `precision` cannot run here; never fall back silently."""
  if precision not in PRECISIONS:
    raise PrecisionError(f"unknown model.precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
  if not PRECISIONS[precision].quantized:  # any backend, any device
    return
  if backend != "te":
    raise PrecisionError(f"model.precision={precision} needs model.backend=te (quantized matmuls run "
                         "through Transformer Engine)")
  ok = supported_precisions()
  if precision not in ok:
    where = jax.devices()[0].device_kind
    later = [n for n, p in PRECISIONS.items() if p.gpu == "Blackwell"]
    need = f" ({' and '.join(n.upper() for n in later)} need a Blackwell GPU)" if precision in later else ""
    raise PrecisionError(f"model.precision={precision} is not supported on this device ({where}){need}; "
                         f"supported here: {', '.join(ok)}")


def check_remat(remat: str, backend: str) -> None:
  """A policy that recomputes TE's primitives (`recompute_norm_act`: its RMSNorm and activation) needs the TE
  backend."""
  if remat not in REMATS:
    raise ValueError(f"unknown remat policy {remat!r}")
  if REMATS[remat].te_only and backend != "te":
    raise PrecisionError(f"model.remat={remat} needs model.backend=te (it leaves out the outputs of "
                         "TE's RMSNorm and activation kernels)")


@contextlib.contextmanager
def precision_scope(precision: str, backend: str, amax_history_len: int = 1024,
                    mesh_axes: dict[str, str] | None = None):
  """Enter TE's autocast (quantization recipe + mesh resource) around init *and* tracing.

  mesh_axes maps TE roles to mesh axis names, e.g. {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "cp": "context",
  "pp": "pipeline"} (TE reduces its FP8 amaxes over every axis but the pipeline one: each stage has its own layers).
  The flax backend needs no scope.
  """
  if backend != "te":
    yield
    return
  te = import_te()
  axes = mesh_axes or {}
  resource = te.MeshResource(dp_resource=axes.get("dp"), fsdp_resource=axes.get("fsdp"),
                             tp_resource=axes.get("tp"), cp_resource=axes.get("cp"), pp_resource=axes.get("pp"))
  recipe = make_recipe(precision, amax_history_len)
  enabled = recipe is not None
  with te.autocast(enabled=enabled, recipe=recipe, mesh_resource=resource):
    yield


def remat_policy(name: str, backend: str):
  """The `model.remat` policy of its row in maxlm/tables.py (what each saves); `None` means no remat at all. On
  the TE backend, saving the attention output ("context") also saves what cuDNN's fused attention returns (its
  output and softmax statistics): its backward needs both, so keeping "context" alone would still recompute
  attention; and `dots` counts TE's GEMMs too. A policy recomputing TE primitives (`recompute_norm_act`) keeps
  everything but their outputs (elementwise kernels, no GEMM); on CPU (TE's pure-JAX path) those primitives do
  not run and it keeps all."""
  cp = jax.checkpoint_policies
  check_remat(name, backend)
  r = REMATS[name]
  if name == "none":
    return None
  te = backend == "te"
  if te:
    # lazy on purpose (PLC0415): TE is imported only once the TE backend is chosen (and set up for this host)
    from transformer_engine.jax.checkpoint_policies import dots_and_te_gemms_with_no_batch_dims  # noqa: PLC0415
    from transformer_engine.jax.cpp_extensions import activation, attention, normalization  # noqa: PLC0415

    primitives = {"NormFwdPrimitive": normalization.NormFwdPrimitive, "ActLuPrimitive": activation.ActLuPrimitive,
                  "FusedAttnFwdPrimitive": attention.FusedAttnFwdPrimitive}
    if r.te_recomputed:
      redone = tuple(primitives[p].outer_primitive for p in r.te_recomputed)
      return lambda prim, *_, **__: prim not in redone
    # cuDNN's forward, alone or inside one of TE's context-parallel strategies (maxlm/parallel/context.py)
    fused = {getattr(attention, n).outer_primitive for n in (
        "FusedAttnFwdPrimitive", "FusedAttnCPWithAllGatherFwdPrimitive", "FusedAttnCPStripedWithAllGatherFwdPrimitive",
        "FusedRingAttnFwdPrimitive", "FusedRingAttnStripedFwdPrimitive")}
  saved = []
  if r.dots:
    saved.append(dots_and_te_gemms_with_no_batch_dims if te else cp.checkpoint_dots_with_no_batch_dims)
  names = [n for n in r.names if n != "context"]  # the names first, then the attention output (policy order)
  if names:
    saved.append(cp.save_only_these_names(*names))
  if "context" in r.names:
    saved.append(cp.save_only_these_names("context"))
    if te:
      saved.append(lambda prim, *_, **__: prim in fused)
  if not saved:
    return cp.nothing_saveable
  policy = saved[0]
  for p in saved[1:]:
    policy = cp.save_from_both_policies(policy, p)
  return policy


__all__ = ["BACKENDS", "FP8_COLLECTION", "RECIPES", "PrecisionError", "check_precision",
           "check_remat", "get_backend", "make_recipe", "on_gpu", "precision_scope", "remat_policy",
           "resolve_backend",
           "supported_precisions", "te_installed"]
