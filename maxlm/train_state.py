"""The train state (params, optimizer state, non-param model collections, step, RNG, fp16 loss scale) and
its shardings, with their memory kinds: `optim.offload=host` keeps the optimizer state in pinned host
memory between steps (maxlm/offload.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh

from maxlm.loss_scale import LossScale, init_loss_scale
from maxlm.offload import place
from maxlm.parallel.sharding import shardings_from_logical, strip_boxes


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  # Every non-param collection of the model, e.g. TE's `fp8_metas` under delayed scaling.
  # Updated through the backward pass, never by the optimizer.
  model_state: Any
  rng: jax.Array  # uint32 key data
  nonfinite_steps: jax.Array  # int32 scalar: updates skipped for a non-finite loss / gradient
  # model.precision=fp16: the dynamic loss scale and its counters (maxlm/loss_scale.py); else None (no
  # leaves: states and checkpoints of other precisions are unchanged).
  loss_scale: LossScale | None = None


def init_boxed(model: nn.Module, optimizer: optax.GradientTransformation, rng: jax.Array,
               batch: int, seq_len: int) -> TrainState:
  """Initial state with LogicallyPartitioned boxes kept (so shardings can be read off it)."""
  init_rng, state_rng = jax.random.split(rng)
  tokens = jnp.zeros((batch, seq_len), jnp.int32)  # [B, T]
  variables = model.init(init_rng, tokens)
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"}
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    model_state=model_state, rng=jax.random.key_data(state_rng),
                    nonfinite_steps=jnp.zeros((), jnp.int32), loss_scale=init_loss_scale(model.cfg))


def abstract_state(model: nn.Module, optimizer: optax.GradientTransformation, mesh: Mesh, batch: int,
                   seq_len: int, offload: str = "none"):
  """(ShapeDtypeStructs with shardings, shardings) of the state, without allocating it; `offload` as in
  `place`."""
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))  # its shape only: no key made on a device (compile-only
  # devices, e.g. a GPU topology compiled for without a GPU, cannot hold one)
  abstract = jax.eval_shape(lambda r: init_boxed(model, optimizer, r, batch, seq_len), key)
  shardings = place(shardings_from_logical(abstract, mesh), offload)
  structs = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   strip_boxes(abstract), shardings)
  return structs, shardings


THREEFRY_KERNEL = "jax_threefry_gpu_kernel_lowering"


@contextlib.contextmanager
def threefry_kernel():
  """JAX's prebuilt threefry kernel for the RNG calls traced inside (GPU only; a no-op elsewhere).

  Why: by default XLA:GPU gets every threefry call unrolled into its own fusion, one per parameter tensor, each
  compiled by LLVM and ptxas: the init of llama3.2-3b (28 unrolled layers) took 54 s to compile on the H200 for
  0.05 s of running (benchmarks/init_profile.py, 2026-12-04). The kernel computes the same threefry2x32 (the
  same bits; tests/test_gpu.py checks it), and costs its inputs broadcast to each tensor's shape for the
  duration of one call, at init, when the train step's activations do not exist yet. Scoped, not global: the
  flag is part of the jit key, so the train step's own programs are unchanged."""
  old = getattr(jax.config, THREEFRY_KERNEL)
  jax.config.update(THREEFRY_KERNEL, True)
  try:
    yield
  finally:
    jax.config.update(THREEFRY_KERNEL, old)


def create_train_state(model: nn.Module, optimizer: optax.GradientTransformation, mesh: Mesh, seed: int,
                       batch: int, seq_len: int, offload: str = "none", compiler: Callable | None = None):
  """(state, shardings): the state initialized directly into its shards (no host copy), each leaf in
  the memory `offload` gives it (see `place`). `compiler(kind, jitted, args)`, when given, supplies the init's
  executable (maxlm/runtime/warm_start.py `Compiler`: loaded from an earlier start, else compiled and kept); an init
  kept by an earlier start also gives the shardings (its output's), so nothing is traced."""
  key = jax.random.PRNGKey(seed)
  with threefry_kernel():  # the init's entries are keyed under the kernel's flag (one of JAX's settings)
    kept = compiler.kept("init", (key,)) if compiler is not None else None
  if kept is not None:
    return kept(key), kept.output_shardings
  _, shardings = abstract_state(model, optimizer, mesh, batch, seq_len, offload)

  def init(r):
    return nn.unbox(init_boxed(model, optimizer, r, batch, seq_len))

  with threefry_kernel():
    jitted = jax.jit(init, out_shardings=shardings)
    state = jitted(key) if compiler is None else compiler("init", jitted, (key,)).executable(key)
  return state, shardings
