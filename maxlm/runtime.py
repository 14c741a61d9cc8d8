"""Process-level settings that must be in place before the JAX backend starts.

`configure(deterministic=...)` is called by every entry point that trains, before anything asks JAX
about devices: XLA reads `XLA_FLAGS` once, when the backend starts, and Transformer Engine reads
`NVTE_ALLOW_NONDETERMINISTIC_ALGO` whenever it traces fused attention.
"""

from __future__ import annotations

import os

from maxlm.config import ConfigError

# What a GPU run needs to repeat bit for bit (measured on an H200: with the XLA flag alone, two
# identical runs differed by 3.6e-4 in loss; with both, repeats and resumes were exact):
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true",)  # deterministic reductions/scatters
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}  # TE: cuDNN fused-attention backward


def backend_started() -> bool:
  """True once JAX has created a backend (XLA flags can no longer change)."""
  from jax._src import xla_bridge  # noqa: PLC0415 - private, read only here; jax is imported lazily
  return bool(getattr(xla_bridge, "_backends", None))


def _flag_name(flag: str) -> str:
  return flag.split("=", 1)[0]


def configure(deterministic: bool = False) -> list[str]:
  """Apply the process settings; returns a description of what was set (for the log)."""
  if not deterministic:
    return []
  done = []
  flags = os.environ.get("XLA_FLAGS", "").split()
  have = {_flag_name(f) for f in flags}
  missing = [f for f in DETERMINISTIC_XLA_FLAGS if _flag_name(f) not in have]
  user_set = [f for f in flags if _flag_name(f) in {_flag_name(d) for d in DETERMINISTIC_XLA_FLAGS}]
  conflict = [f for f in user_set if f not in DETERMINISTIC_XLA_FLAGS]
  if conflict:
    raise ConfigError(f"train.deterministic=true conflicts with XLA_FLAGS {' '.join(conflict)}")
  if missing:
    if backend_started():
      raise RuntimeError("train.deterministic=true must be applied before the JAX backend starts")
    os.environ["XLA_FLAGS"] = " ".join(flags + missing)
    done.append(f"XLA_FLAGS += {' '.join(missing)}")
  for key, value in DETERMINISTIC_ENV.items():
    if os.environ.get(key) not in (None, value):
      raise ConfigError(f"train.deterministic=true conflicts with {key}={os.environ[key]}")
    if os.environ.get(key) != value:
      os.environ[key] = value
      done.append(f"{key}={value}")
  return done


def configure_compile_cache(c) -> str:
  """`compile:` (a CompileConfig): JAX's persistent compilation cache, before the first compile. Returns
  what was set, for the log; ConfigError for a cache directory that cannot be used."""
  from maxlm import compile_cache, warm_start  # noqa: PLC0415 - import jax: only once a process is about to compile
  line = compile_cache.configure(c)
  warm_start.configure(compile_cache.directory(), c.warm_start)
  return line
