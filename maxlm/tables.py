"""The facts several modules read, one table each: the precisions (`model.precision`) and what each implies, the
remat policies (`model.remat`) and what each saves, the GPU models and their peak, memory and link figures; and
the one way bytes are written for people (`human_bytes`).

Data only: this module imports nothing of maxlm (nor JAX), so the config, the layers, the runtime and the
planner all read the same rows. Each consumer derives what it needs from a row; none keeps its own list.
"""

from __future__ import annotations

import dataclasses


# ---- precisions ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Precision:
  """A `model.precision`: the TE recipe that runs it and what it implies for the state and the step."""
  name: str
  recipe: str | None = None  # the TE recipe class (transformer_engine.common.recipe); None: GEMMs unquantized
  fp8_state: bool = False  # TE keeps delayed-scaling state (`fp8_metas`: amax history + scale per GEMM operand)
  loss_scaling: bool = False  # a dynamic loss scale in the train state (maxlm/loss_scale.py)
  compute_dtype: str | None = None  # the activations' dtype it forces; None: model.dtype
  gpu: str = ""  # the GPU generation that runs its recipe ("" any device)

  @property
  def quantized(self) -> bool:
    """Its GEMMs run quantized (through TE); else all of them run in the compute dtype."""
    return self.recipe is not None


PRECISIONS = {p.name: p for p in (
    Precision("bf16"),
    Precision("fp16", loss_scaling=True, compute_dtype="float16"),
    Precision("fp8_delayed", "DelayedScaling", fp8_state=True, gpu="Hopper"),
    Precision("fp8_current", "Float8CurrentScaling", gpu="Hopper"),
    Precision("mxfp8", "MXFP8BlockScaling", gpu="Blackwell"),  # E4M3 values, one E8M0 scale per 32 elements
    Precision("nvfp4", "NVFP4BlockScaling", gpu="Blackwell"),  # E2M1 values, E4M3 scale per 16 + per tensor
)}


# ---- remat policies ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Remat:
  """A `model.remat` policy: what the backward pass finds saved of each layer's forward, and what it redoes.

  names: the checkpoint names it saves (maxlm/model.py names `qkv_proj`, `context`, `out_proj`). Saving
  "context" on the TE backend also saves what cuDNN's fused attention returns (TE's FusedAttnFwdPrimitive: its
  output and softmax statistics), which its backward needs. dots: GEMM outputs without batch dimensions
  (jax's checkpoint_dots_with_no_batch_dims; on TE, TE's GEMMs too: dots_and_te_gemms_with_no_batch_dims).
  te_recomputed: TE primitives recomputed while everything else is saved (TE backend only).
  recomputed: the forward parts of a layer the backward redoes (qkv, out, mlp, attn), for the step-time
  estimate (maxlm/plan/cost.py). kept / redone: per token, the activation terms it keeps of every layer, and
  those one layer's backward recomputes at once, for the memory estimate (maxlm/plan/memory.py; a term with a
  leading '-' is subtracted)."""
  name: str
  saves: str
  names: tuple[str, ...] = ()
  dots: bool = False
  te_recomputed: tuple[str, ...] = ()
  recomputed: tuple[str, ...] = ("qkv", "out", "mlp", "attn")
  kept: tuple[str, ...] = ("input",)
  redone: tuple[str, ...] = ("whole",)

  @property
  def te_only(self) -> bool:
    return bool(self.te_recomputed)


# From the most kept to the least (the planner tries them in this order).
REMATS = {r.name: r for r in (
    Remat("none", "everything: no rematerialization", recomputed=(), kept=("whole",), redone=()),
    Remat("recompute_norm_act", "everything but the outputs of TE's RMSNorm and SwiGLU (elementwise to redo; "
          "on CPU, where those TE primitives do not run, everything)",
          te_recomputed=("NormFwdPrimitive", "ActLuPrimitive"), recomputed=(), kept=("whole", "-norm_act"),
          redone=("norm_act",)),
    Remat("save_dots_attn", "every GEMM output and the attention output (MaxText's minimal_with_context)",
          names=("context",), dots=True, recomputed=(), kept=("dots", "context")),
    Remat("save_dots", "every GEMM output", dots=True, recomputed=("attn",), kept=("dots",)),
    Remat("save_qkv_attn", "the QKV projection and the attention output", names=("qkv_proj", "context"),
          recomputed=("out", "mlp"), kept=("input", "qkv", "context")),
    Remat("save_attn", "the attention output", names=("context",), recomputed=("qkv", "out", "mlp"),
          kept=("input", "context")),
    Remat("full", "each layer's input only"),
)}


# ---- GPU models ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GPU:
  """An NVIDIA GPU model, matched by its name in `jax.Device.device_kind` (or nvidia-smi's): the first row whose
  name the kind contains, in table order (GH200 before H200, GB200 before B200). Figures per GPU, None where
  unknown here; bytes/s: HBM, NVLink per direction, the host link (PCIe Gen5 x16 in practice; Grace's C2C on
  GH/GB), the network (per GPU)."""
  name: str
  arch: str  # "hopper", "blackwell" (the XLA flag presets, maxlm/runtime/xla_presets.py), "ampere"
  bf16_flops: float | None = None  # dense BF16 peak, FLOP/s
  memory: int | None = None  # bytes JAX reports for the whole GPU (its allocator's limit at a fraction of 1)
  hbm: float | None = None
  nvlink: float | None = None
  host_link: float | None = None
  network: float | None = None


GPUS = (
    GPU("GH200", "hopper", 989e12, None, 4.0e12, 450e9, 450e9, 50e9),
    GPU("GB200", "blackwell", 2.5e15, None, 8e12, 900e9, 450e9, 100e9),
    GPU("GB300", "blackwell"),
    GPU("H200", "hopper", 989e12, int(139.87 * 2**30), 4.8e12, 450e9, 55e9, 50e9),  # 104.9 GiB at XLA's 0.75
    GPU("H100", "hopper", 989e12, None, 3.35e12, 450e9, 55e9, 50e9),
    GPU("H800", "hopper", 989e12),
    GPU("H20", "hopper"),
    GPU("B200", "blackwell", 2.25e15, None, 8e12, 900e9, 55e9, 100e9),
    GPU("B100", "blackwell"),
    GPU("B300", "blackwell"),
    GPU("A100", "ampere", 312e12),
)
DEFAULT_GPU = "H200"  # what the planner assumes without a GPU to ask, and the step-time estimate for unknown kinds


def gpu(kind: str) -> GPU | None:
  """The row of a device kind (e.g. "NVIDIA H200"), or None for another device."""
  return next((g for g in GPUS if g.name.lower() in kind.lower()), None)


def gpu_named(name: str) -> GPU:
  return next(g for g in GPUS if g.name == name)


# ---- bytes ---------------------------------------------------------------------------------------------

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def human_bytes(n: int | float) -> str:
  """1536 -> '1.5 KiB' (binary units, one decimal)."""
  if n < 1024:
    return f"{int(n)} B"
  x = float(n)
  for unit in UNITS[1:]:
    x /= 1024
    if x < 1024 or unit == UNITS[-1]:
      return f"{x:.1f} {unit}"
  raise AssertionError("unreachable")
