"""Expert parallelism's exchange (maxlm/parallel/experts.py) on simulated CPU devices: the experts split over an
`expert` mesh axis (2 and 4 devices, alone and beside a data axis), each token's k experts' outputs against a
per-token loop in float64 written here, values and gradients, with balanced, skewed (every token to one expert:
dropless must keep them all) and random routing."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm.parallel import experts

U32 = 2.0 ** -24  # float32 unit roundoff
N, D, F, E, K = 32, 8, 16, 8, 2  # tokens, model width, expert width, experts, experts per token


def swiglu_groups(rows, params, sizes):
  """The experts' SwiGLU on their contiguous groups of rows (JAX's ragged_dot; not maxlm's code)."""
  w1, w3, w2 = params
  return jax.lax.ragged_dot(jax.nn.silu(jax.lax.ragged_dot(rows, w1, sizes)) * jax.lax.ragged_dot(rows, w3, sizes),
                            w2, sizes)


def loop_reference(x, weights, chosen, w1, w3, w2, absolute=False):
  """float64, token by token and slot by slot: sum_j weight_j * SwiGLU_{e_j}(x). absolute: the same sum over the
  absolute values of every product (the scale of the rounding errors)."""
  x, weights, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, weights, w1, w3, w2))
  silu = lambda a: a / (1 + np.exp(-a))
  out = np.zeros((x.shape[0], w2.shape[-1]))
  for n in range(x.shape[0]):
    for j in range(chosen.shape[1]):
      e = int(chosen[n, j])
      if absolute:  # |silu(a)| |x||W3| + |b| |silu'| |x||W1| (|silu'| <= 1.1, |b| <= |x||W3|), then through |W2|
        ax, b_abs = np.abs(x[n]), np.abs(x[n]) @ np.abs(w3[e])
        h = np.abs(silu(x[n] @ w1[e])) * b_abs + 1.1 * b_abs * (ax @ np.abs(w1[e]))
        out[n] += abs(weights[n, j]) * (h @ np.abs(w2[e]))
      else:
        out[n] += weights[n, j] * ((silu(x[n] @ w1[e]) * (x[n] @ w3[e])) @ w2[e])
  return out


def inputs(routing: str, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((N, D)).astype(np.float32)
  w1, w3 = (rng.standard_normal((E, D, F)).astype(np.float32) / np.sqrt(D) for _ in range(2))
  w2 = rng.standard_normal((E, F, D)).astype(np.float32) / np.sqrt(F)
  if routing == "skewed":  # every token's first choice expert 5, second expert 2: two experts get everything
    chosen = np.tile(np.array([5, 2], np.int32), (N, 1))
  elif routing == "balanced":
    chosen = np.stack([np.arange(N) % E, (np.arange(N) + 3) % E], axis=1).astype(np.int32)
  else:
    chosen = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
  weights = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
  return x, weights / weights.sum(axis=1, keepdims=True), chosen, w1, w3, w2


@contextlib.contextmanager
def on_mesh(shape, names, batch):
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
  with jax.set_mesh(mesh), nn.logical_axis_rules([("activation_batch", batch), ("expert", "expert")]):
    yield mesh


def split_apply(mesh, batch, ep, x, weights, chosen, w1, w3, w2):
  tok, per_expert = NamedSharding(mesh, P(batch)), NamedSharding(mesh, P("expert"))
  args = [jax.device_put(a, tok) for a in (x, weights, chosen)] + [jax.device_put(a, per_expert) for a in (w1, w3, w2)]
  fn = lambda x, w, c, w1, w3, w2: experts.apply(swiglu_groups, x, w, c, (w1, w3, w2), n_experts=E, name="expert",
                                                 ep=ep)
  return fn, args


MESHES = [((2,), ("expert",), ("expert",)), ((4,), ("expert",), ("expert",)),
          ((2, 2), ("data", "expert"), ("data", "expert"))]


@pytest.mark.parametrize("routing", ["balanced", "skewed", "random"])
@pytest.mark.parametrize("shape,names,batch", MESHES)
def test_split_experts_equal_the_per_token_loop(shape, names, batch, routing):
  """Each output is a sum of k products of a SwiGLU (dots of length D and F) and a weight: in float32 each
  differs from the exact value by at most about (D + F + k + 2) u times the same sum over absolute values (the
  standard dot-product bound, one rounding per add and multiply along the chain)."""
  x, weights, chosen, w1, w3, w2 = inputs(routing)
  ep = shape[names.index("expert")]
  with on_mesh(shape, names, batch) as mesh:
    fn, args = split_apply(mesh, batch, ep, x, weights, chosen, w1, w3, w2)
    out = np.asarray(jax.jit(fn)(*args), np.float64)
  ref = loop_reference(x, weights, chosen, w1, w3, w2)
  bound = (D + F + K + 2) * U32 * loop_reference(x, weights, chosen, w1, w3, w2, absolute=True)
  assert out.shape == (N, D)
  np.testing.assert_array_less(np.abs(out - ref), bound + 1e-30)


@pytest.mark.parametrize("routing", ["skewed", "random"])
def test_gradients_equal_one_devices(routing):
  """Gradients of a weighted sum of the outputs, through the exchange (all-to-all's transpose is the reverse
  all-to-all), against the same function on one device by a dense one-hot formulation written here; both in
  float32, each gradient a sum of at most N k (D + F) products: bound 2 (D + F + N K) u x max |gradient|."""
  x, weights, chosen, w1, w3, w2 = inputs(routing, seed=1)
  probe = np.random.default_rng(2).standard_normal((N, D)).astype(np.float32)

  def dense(x, weights, w1, w3, w2):  # [N, E] one-hot routing, every expert on every token
    gate = jnp.einsum("nd,edf->enf", x, w1)
    h = jnp.einsum("enf,efd->end", jax.nn.silu(gate) * jnp.einsum("nd,edf->enf", x, w3), w2)  # [E, N, D]
    mix = jnp.sum(jax.nn.one_hot(chosen, E) * weights[..., None], axis=1)  # [N, E]
    return jnp.sum(jnp.einsum("end,ne->nd", h, mix) * probe)

  want = jax.grad(dense, argnums=(0, 1, 2, 3, 4))(x, weights, w1, w3, w2)
  with on_mesh((4,), ("expert",), ("expert",)) as mesh:
    fn, args = split_apply(mesh, ("expert",), 4, x, weights, chosen, w1, w3, w2)
    loss = lambda x, w, w1, w3, w2: jnp.sum(fn(x, w, args[2], w1, w3, w2) * probe)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(args[0], args[1], *args[3:])
  for name, g, r in zip(("x", "weights", "w1", "w3", "w2"), got, want):
    r = np.asarray(r)
    np.testing.assert_allclose(np.asarray(g), r, rtol=0, atol=2 * (D + F + N * K) * U32 * np.abs(r).max(),
                               err_msg=name)


def test_experts_that_do_not_split_and_tokens_not_on_the_axis_are_refused():
  x, weights, chosen, w1, w3, w2 = inputs("random")
  with on_mesh((4,), ("expert",), ("expert",)) as mesh:
    fn, args = split_apply(mesh, ("expert",), 4, x, weights, chosen, w1, w3, w2)
    with pytest.raises(ValueError, match="6 experts do not split over 4 devices"):
      experts.apply(swiglu_groups, *args[:3], (w1[:6], w3[:6], w2[:6]), n_experts=6, name="expert", ep=4)
  with on_mesh((2, 2), ("data", "expert"), ("data",)) as mesh:
    fn, args = split_apply(mesh, ("data",), 2, x, weights, chosen, w1, w3, w2)
    with pytest.raises(ValueError, match="tokens must be split over the expert axis"):
      fn(*args)


def test_the_axis_is_found_from_the_mesh_and_rules():
  with on_mesh((4,), ("expert",), ("expert",)):
    assert experts.axis() == ("expert", 4)
  with on_mesh((1, 4), ("expert", "data"), ("data",)):
    assert experts.axis() is None  # one device on the axis: nothing to split
  assert experts.axis() is None  # no mesh
