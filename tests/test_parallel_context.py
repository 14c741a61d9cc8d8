"""Context parallelism's layout and exchanges (maxlm/parallel/context.py): the load-balanced orders written out by
hand and against Transformer Engine's own reorder functions, the strategy and layout choices, the axis found from
the mesh and rules, and the balanced order applied and restored."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.config import MeshConfig
from maxlm.layers.te_env import import_te
from maxlm.parallel import context
from maxlm.parallel.mesh import make_mesh
from meshes import on_mesh


# ---- orders ------------------------------------------------------------------------------------------------

def test_orders_written_out():
  dual = context.Layout("dual_chunk", 2)  # T=8 in 4 chunks of 2: device 0 holds chunks 0 and 3, device 1 1 and 2
  assert context.order(8, dual).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
  assert context.order(16, context.Layout("dual_chunk", 4)).tolist() == [
      0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  assert context.order(8, context.Layout("striped", 2)).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
  assert context.order(8, context.Layout("striped", 2, stripe=2)).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  for lay in (context.Layout("dual_chunk", 4), context.Layout("striped", 4, 2), context.Layout("striped", 2)):
    np.testing.assert_array_equal(context.restore(context.reorder(x, lay), lay), x)
    np.testing.assert_array_equal(context.reorder(x, lay)[0, :, 0], 3 * context.order(16, lay))


def test_each_device_gets_an_equal_share_of_causal_work():
  """Causal work of a query at original position i: i + 1 keys. Contiguous blocks of 16 give the last of 4
  devices 904 / 136 = 6.6x the first's; the dual-chunk order gives every device the same; stripes of 1 give
  device r (T/cp)(r) more than device 0's ~T^2 / (2cp): within 1 + 2cp / T."""
  t, cp = 64, 4
  def work(order):
    return [int((order.reshape(cp, -1) + 1)[r].sum()) for r in range(cp)]
  assert work(np.arange(t)) == [136, 392, 648, 904]
  assert work(context.order(t, context.Layout("dual_chunk", cp))) == [520] * 4
  striped = work(context.order(t, context.Layout("striped", cp)))
  assert max(striped) / min(striped) <= 1 + 2 * cp / t


@pytest.mark.te
@pytest.mark.parametrize("cp", [2, 4])
def test_orders_are_transformer_engines(cp):
  """TE's fused context-parallel attention expects its own orders (context_parallel_causal_load_balanced):
  DualChunkSwap for its BSHD layout, Striped (with the stripe size passed to fused_attn) for THD."""
  import_te()
  from transformer_engine.jax.attention import ReorderStrategy, reorder_causal_load_balancing
  x = jnp.arange(3 * 32).reshape(1, 32, 3)
  got = context.reorder(x, context.Layout("dual_chunk", cp))
  np.testing.assert_array_equal(got, reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, cp, 1))
  for stripe in (1, 2, 4):
    got = context.reorder(x, context.Layout("striped", cp, stripe))
    want = reorder_causal_load_balancing(x, ReorderStrategy.Striped, cp, 1, stripe_size=stripe)
    np.testing.assert_array_equal(got, want)


def test_strategy_and_layout_choices():
  assert context.resolve_strategy("all_gather", 8, 131072, True) == "all_gather"  # an explicit choice stands
  assert context.resolve_strategy("auto", 2, 8192, False) == "all_gather"
  assert context.resolve_strategy("auto", 4, 4 * context.RING_FROM, False) == "ring"
  assert context.resolve_strategy("auto", 4, 8192, True) == "ring"  # packed rows / window: TE's THD ring
  assert context.layout("all_gather", 4, 8192, False) == context.Layout("dual_chunk", 4)
  assert context.layout("ring", 4, 8192, True) == context.Layout("striped", 4, 1)
  assert context.layout("all_gather", 4, 8192, True) == context.Layout("striped", 4, 128)
  assert context.layout("all_gather", 4, 16, True) == context.Layout("striped", 4, 2)  # two stripes per device


def test_axis_found_from_the_mesh_and_rules():
  assert context.axis() is None  # no mesh
  with on_mesh(1):
    assert context.axis() is None  # a context axis of one device splits nothing
  with on_mesh(4):
    assert context.axis() == ("context", 4)
    with pytest.raises(ValueError, match="sequences of 12 tokens do not split into 2 x 4 chunks"):
      context.current_layout("auto", 12, False)
  mesh = make_mesh(MeshConfig(context=2, fsdp=-1))
  with jax.set_mesh(mesh):
    assert context.axis() is None  # a mesh without the rules: nothing maps the length to it


def test_apply_balanced_restores_the_order():
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  def fn(tokens, positions, segment_ids):
    assert segment_ids is None
    return jnp.stack([tokens, positions], axis=-1)  # [B, T, 2], per token
  toks = jnp.arange(32).reshape(2, 16)
  with on_mesh(4):
    seen = []
    out = jax.jit(lambda t: context.apply_balanced(lambda *a: seen.append(a[1]) or fn(*a), t, None, None,
                                                   strategy="auto", window=0))(toks)
    np.testing.assert_array_equal(out, jnp.stack([toks, pos], axis=-1))
  assert seen and seen[0].shape == (2, 16)  # fn saw positions made for it, in the reordered order
