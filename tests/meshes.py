"""A simulated mesh with the trainer's logical rules, for the context-parallel tests (tests/test_parallel_context.py,
tests/test_cp_attention.py)."""

import contextlib

import jax

from maxlm.config import MeshConfig
from maxlm.parallel.mesh import make_mesh
from maxlm.parallel.sharding import axis_rules


@contextlib.contextmanager
def on_mesh(cp: int, **mesh_kw):
  """The trainer's scope (maxlm/scope.py) without TE: mesh with `cp` devices on the context axis + the rules."""
  mesh = make_mesh(MeshConfig(context=cp, fsdp=-1, **mesh_kw))
  with jax.set_mesh(mesh), axis_rules():
    yield mesh
