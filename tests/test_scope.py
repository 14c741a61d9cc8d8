"""maxlm/scope.py: the mesh, the logical-axis rules and the precision scope, entered in one place."""

import dataclasses

import jax
import pytest
from flax import linen as nn

from maxlm.config import MeshConfig, ModelConfig
from maxlm.parallel.mesh import make_mesh
from maxlm.scope import model_scope
from maxlm.parallel.sharding import LOGICAL_RULES


def test_scope_sets_the_mesh_and_the_rules_only_with_a_mesh():
  mesh = make_mesh(MeshConfig())
  m = ModelConfig(backend="flax")
  assert not nn.get_logical_axis_rules()
  with model_scope(m, "flax", mesh):
    assert jax.sharding.get_abstract_mesh().shape == dict(mesh.shape)
    assert tuple(nn.get_logical_axis_rules()) == tuple(LOGICAL_RULES)
  assert not nn.get_logical_axis_rules()
  with model_scope(m, "flax"):  # one-device generation: no mesh, no rules
    assert not nn.get_logical_axis_rules() and jax.sharding.get_abstract_mesh().empty


@pytest.mark.te
def test_inference_scope_is_unquantized_whatever_the_training_precision(monkeypatch):
  import maxlm.scope as scope
  seen = []
  monkeypatch.setattr(scope, "precision_scope", lambda precision, *a: seen.append(precision) or _nothing())
  m = dataclasses.replace(ModelConfig(), precision="fp8_delayed")
  with scope.model_scope(m, "te"):
    pass
  with scope.model_scope(m, "te", quantized=False):
    pass
  assert seen == ["fp8_delayed", "bf16"]


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
