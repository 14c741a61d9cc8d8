"""The train state's init (maxlm/train_state.py): `create_train_state` gives the state that model.init and
optimizer.init give for its seed, bit for bit, on every backend and precision (the reference is written here:
model.init jitted on its own, outside `threefry_kernel`, with the RNG split the state documents), and
`threefry_kernel` leaves JAX's flag as it found it. On a GPU, tests/test_gpu.py checks that the threefry kernel
gives the bits of XLA's default threefry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from maxlm.config import MeshConfig, ModelConfig, OptimConfig
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.optim import make_optimizer
from maxlm.scope import model_scope
from maxlm.train_state import THREEFRY_KERNEL, create_train_state, threefry_kernel


def _model(backend: str, precision: str) -> ModelConfig:
  return ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                     dtype="float32", remat="none", backend=backend, precision=precision)


def test_threefry_kernel_sets_the_flag_inside_and_restores_it_after_an_error():
  before = getattr(jax.config, THREEFRY_KERNEL)
  with pytest.raises(RuntimeError):
    with threefry_kernel():
      assert getattr(jax.config, THREEFRY_KERNEL) is True
      raise RuntimeError("inside")
  assert getattr(jax.config, THREEFRY_KERNEL) == before


@pytest.mark.parametrize("backend, precision", [("flax", "bf16"), pytest.param("te", "fp8_delayed", marks=pytest.mark.te)])
def test_state_is_model_init_and_optimizer_init_of_the_seed(backend, precision, request):
  if backend == "te":
    request.getfixturevalue("fake_fp8_gpu")  # TE's CPU path, told the GPU can run FP8
  m = _model(backend, precision)
  model = Transformer(m)
  optimizer, _ = make_optimizer(OptimConfig(), 10)
  mesh = make_mesh(MeshConfig(fsdp=2), jax.devices()[:2])
  batch, seq = 4, 16
  with model_scope(m, backend, mesh):
    state, _ = create_train_state(model, optimizer, mesh, seed=3, batch=batch, seq_len=seq)
  init_rng, state_rng = jax.random.split(jax.random.PRNGKey(3))
  with model_scope(m, backend, None):
    variables = nn.unbox(jax.jit(model.init)(init_rng, jnp.zeros((batch, seq), jnp.int32)))  # [B, T] tokens
  params = variables.pop("params")
  want = {"params": params, "model_state": dict(variables), "opt_state": optimizer.init(params),
          "rng": jax.random.key_data(state_rng), "step": np.int32(0)}
  got = {"params": state.params, "model_state": state.model_state, "opt_state": state.opt_state, "rng": state.rng,
         "step": state.step}
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  if precision == "fp8_delayed":
    assert state.model_state, "delayed scaling keeps its fp8 metadata in the state"
