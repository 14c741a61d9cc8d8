"""The one place that wires what every trace of the model needs: the device mesh, the logical-axis rules and
Transformer Engine's precision scope (its quantization recipe and mesh resource).

Training enters `model_scope(m, backend, mesh)` for initialization and every trace, with `model.precision`'s
recipe. Inference and evaluation of a loaded model (`maxlm.Model`, `maxlm eval`, generation) pass
`quantized=False`: TE's unquantized scope whatever `model.precision` says, since an FP8 recipe needs the
training's scaling state, which a set of weights does not carry.
"""

from __future__ import annotations

import contextlib

import jax

from maxlm.config import ModelConfig
from maxlm.layers import precision_scope
from maxlm.parallel.sharding import TE_MESH_AXES, axis_rules


@contextlib.contextmanager
def model_scope(m: ModelConfig, backend: str, mesh=None, *, quantized: bool = True):
  """Mesh (when given) + axis rules + precision scope. Without a mesh (one-device generation) no rules are set
  and TE gets no mesh resource. An AbstractMesh (the dry run sizes meshes of devices it does not have) gets the
  axis rules alone: `jax.set_mesh` takes only a concrete mesh, and TE no mesh resource."""
  precision = m.precision if quantized else "bf16"
  concrete = isinstance(mesh, jax.sharding.Mesh)
  with contextlib.ExitStack() as stack:
    if concrete:
      stack.enter_context(jax.set_mesh(mesh))
    if mesh is not None:
      stack.enter_context(axis_rules())
    stack.enter_context(precision_scope(precision, backend, m.fp8_amax_history_len,
                                        TE_MESH_AXES if concrete else None))
    yield
