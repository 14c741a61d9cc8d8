"""Mesh construction and sharding: one train step gives the same loss on every mesh layout."""

import contextlib
import dataclasses

import jax
import numpy as np
import pytest

from maxlm.config import ConfigError, MeshConfig, ModelConfig, OptimConfig
from maxlm.data import BATCH_KEYS as BATCH
from maxlm.layers import precision_scope
from maxlm.mesh import make_mesh, mesh_shape
from maxlm.model import Transformer
from maxlm.optim import make_optimizer
from maxlm.sharding import TE_MESH_AXES, axis_rules, batch_sharding, replicated
from maxlm.step import jit_step, make_train_step
from maxlm.train_state import create_train_state

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=128,
                    dtype="float32", remat="full")


def test_mesh_shape_fills_minus_one():
  assert mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == ([2, 2, 2], [1, 1, 1])
  assert mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=1, dcn_data=-1), 16, n_nodes=2) == ([1, 8, 1], [2, 1, 1])
  with pytest.raises(ConfigError, match="multiply to"):
    mesh_shape(MeshConfig(data=2, fsdp=2, tensor=1), 8)
  with pytest.raises(ConfigError, match="at most one"):
    mesh_shape(MeshConfig(data=-1, fsdp=-1), 8)
  with pytest.raises(ConfigError, match="not divisible"):
    mesh_shape(MeshConfig(data=3, fsdp=-1), 8)


def one_step(mesh_cfg, devices, backend="flax"):
  mesh = make_mesh(mesh_cfg, devices)
  model = Transformer(dataclasses.replace(MODEL, backend=backend))
  optimizer, schedule = make_optimizer(OptimConfig(warmup_steps=0, learning_rate=1e-2), 10)

  @contextlib.contextmanager
  def scope():
    with jax.set_mesh(mesh), axis_rules(), precision_scope("bf16", backend, mesh_axes=TE_MESH_AXES):
      yield

  with scope():
    state, shardings = create_train_state(model, optimizer, mesh, seed=0, batch=8, seq_len=16)
  bs = batch_sharding(mesh)
  step = jit_step(make_train_step(model, optimizer, schedule), shardings, {k: bs for k in BATCH},
                  scope, metrics_sharding=replicated(mesh))
  losses = []
  for i in range(2):
    rng = np.random.default_rng(i)
    toks = rng.integers(0, 256, (8, 17), dtype=np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((8, 16), np.int32),
             "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1))}
    batch = {k: jax.device_put(v, bs) for k, v in batch.items()}
    state, metrics = step(state, batch)
    losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return losses, state


@pytest.mark.parametrize("backend,shapes", [
    ("flax", [(8, 1, 1), (2, 2, 2), (1, 1, 8)]),
    pytest.param("te", [(2, 2, 2)], marks=pytest.mark.te),  # TE through its MeshResource
])
def test_same_loss_on_every_mesh(backend, shapes):
  devices = jax.devices()
  assert len(devices) == 8, "tests run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
  ref, ref_state = one_step(MeshConfig(data=1, fsdp=1, tensor=1), devices[:1], backend)
  for shape in shapes:
    losses, state = one_step(MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]), devices, backend)
    np.testing.assert_allclose(losses, ref, rtol=2e-5, err_msg=f"mesh {shape}")
    # Adam turns fp32 reduction-order noise on near-zero gradients into up to one step (lr=1e-2)
    # of difference, so parameters agree to 1% of a step rather than bitwise.
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4),
                           state.params, ref_state.params)


def test_params_are_actually_sharded():
  _, state = one_step(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
  qkv = state.params["layers"]["qkv"]["kernel"]  # [L, D, KV, G+2, Dh]
  spec = qkv.sharding.spec
  assert spec[1] == "fsdp" and spec[2] == "tensor"
  assert qkv.addressable_shards[0].data.shape == (2, 32, 2, 4, 8)
  mu = state.opt_state[1][0].mu["layers"]["qkv"]["kernel"]  # AdamW moments follow the params
  assert mu.sharding.spec == spec
