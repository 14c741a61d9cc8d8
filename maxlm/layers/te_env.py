"""Import Transformer Engine (JAX) lazily, making it usable on a machine without a GPU.

On a CPU-only host TE needs three things (see the project README): `libnccl.so.2` preloaded
(TE's libraries link it without an RPATH), `NVTE_JAX_CUSTOM_CALLS=false` so GEMM/norm/softmax
run as pure JAX, and the fused-attention backend probe (which raises without a CUDA driver)
treated as "no fused backend" so `DotProductAttention` takes its pure-JAX path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import importlib.metadata
import importlib.util
import os
import sys
import warnings


def te_installed() -> bool:
  """TE with its JAX extension: pip's `transformer_engine_jax` distribution, or (NVIDIA's JAX containers
  build TE as one `transformer_engine` wheel) the extension module itself, found without importing it."""
  if importlib.util.find_spec("transformer_engine") is None:
    return False
  try:
    importlib.metadata.version("transformer_engine_jax")
  except importlib.metadata.PackageNotFoundError:
    return importlib.util.find_spec("transformer_engine_jax") is not None
  return True


def on_gpu() -> bool:
  import jax  # noqa: PLC0415 - only after the host set-up
  return jax.default_backend() == "gpu"


def _preload_nccl() -> None:
  for base in sys.path:
    for lib in glob.glob(os.path.join(base, "nvidia", "nccl", "lib", "libnccl.so.2")):
      ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
      return


@contextlib.contextmanager
def _without_te_pytorch():
  """TE's package `__init__` also imports its PyTorch half when torch is installed: `import torch` (3.4 s on the
  H200 image), and where TE's PyTorch extension is absent (maxlm installs only the JAX one) a 2-line
  RuntimeWarning at every start. maxlm uses only `transformer_engine.jax`. A `None` in sys.modules makes that
  import fail for the moment of this import, which TE's `__init__` takes as "no PyTorch" (`except ImportError:
  pass`); `transformer_engine.pytorch` is importable again afterwards, and a process that imported it already
  keeps it."""
  name = "transformer_engine.pytorch"
  blocked = name not in sys.modules
  if blocked:
    sys.modules[name] = None
  try:
    yield
  finally:
    if blocked and sys.modules.get(name, 0) is None:
      del sys.modules[name]


@functools.lru_cache(maxsize=None)
def import_te():
  """Return the `transformer_engine.jax` module, set up for this host (GPU or CPU fallback)."""
  if not te_installed():
    raise ImportError("Transformer Engine for JAX is not installed (bash scripts/setup.sh installs it)")
  cpu = not on_gpu()
  if cpu:
    os.environ["NVTE_JAX_CUSTOM_CALLS"] = "false"
    os.environ.setdefault("NVTE_FUSED_ATTN", "0")
    _preload_nccl()
    # With the custom calls off (above, on purpose) TE's softmax always takes its JAX path and says so at
    # every trace; on a CPU that is the expected path, not news. Only this message, only on a CPU.
    warnings.filterwarnings("ignore", message="Using unfused JAX softmax", category=UserWarning)
  with _without_te_pytorch():
    import transformer_engine.jax as te  # noqa: PLC0415 - only after the host set-up
  if cpu:
    from transformer_engine.jax.cpp_extensions import attention as te_attn  # noqa: PLC0415 - only after the host set-up
    from transformer_engine_jax import NVTE_Fused_Attn_Backend  # noqa: PLC0415 - only after the host set-up

    original = te_attn.FusedAttnHelper.get_fused_attn_backend

    def no_fused_backend_on_cpu(self):
      try:
        return original(self)
      except RuntimeError as e:  # "CUDA driver version is insufficient": no GPU here
        return NVTE_Fused_Attn_Backend.NVTE_No_Backend, str(e)

    te_attn.FusedAttnHelper.get_fused_attn_backend = no_fused_backend_on_cpu
  return te
