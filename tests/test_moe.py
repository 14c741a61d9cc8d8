"""maxlm/layers/moe.py: routing, the sort by expert and back, the grouped and dense expert computations, capacity,
the auxiliary losses, against references written here (hand numbers, a per-token loop in float64); the layer's
gradients against central finite differences in float64."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.layers import moe

E, K, D, F = 4, 2, 8, 16


def per_token_reference(x, weights, experts, w1, w3, w2):
  """[N, D] float64: for each token, the weighted sum of its experts' SwiGLU, one token and one expert at a time."""
  x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    for j in range(experts.shape[1]):
      e = int(experts[n, j])
      g, u = x[n] @ w1[e], x[n] @ w3[e]
      out[n] += float(weights[n, j]) * ((g / (1 + np.exp(-g))) * u) @ w2[e]
  return out


def params(seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(ks[0], (E, D, F), dtype) * 0.3, jax.random.normal(ks[1], (E, D, F), dtype) * 0.3,
          jax.random.normal(ks[2], (E, F, D), dtype) * 0.3)


def test_route_is_softmax_then_top_k_renormalized_by_hand():
  logits = jnp.array([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
  w, ex, probs = moe.route(logits, 2)
  assert ex[0].tolist() == [2, 1]
  # top-2 of a softmax renormalized: e^l_a / (e^l_a + e^l_b), the other experts' terms cancel
  assert np.allclose(w[0], [math.e ** 2 / (math.e ** 2 + math.e), math.e / (math.e ** 2 + math.e)])
  assert sorted(ex[1].tolist()) == [0, 3] and np.allclose(w[1], [0.5, 0.5])
  assert np.allclose(probs.sum(-1), 1.0)


def test_sort_by_expert_is_stable_with_the_group_sizes_by_hand():
  experts = jnp.array([[2, 0], [1, 2], [0, 1]])  # flat: 2 0 1 2 0 1
  order, sizes = moe.sort_by_expert(experts, 4)
  assert order.tolist() == [1, 4, 2, 5, 0, 3] and sizes.tolist() == [2, 2, 2, 0]


def test_capacity_keeps_the_first_assignments_of_each_expert_by_hand():
  experts = jnp.array([[0, 1], [0, 2], [0, 1]])  # expert 0 is asked 3 times, capacity 2: token 2's slot 0 dropped
  assert moe.capacity_keep(experts, 3, 2).tolist() == [[True, True], [True, True], [False, True]]
  assert moe.capacity(n_tokens=3, k=2, n_experts=3, factor=1.0) == 2 and moe.capacity(3, 2, 3, 1.25) == 3


@pytest.mark.parametrize("kernel", moe.KERNELS)
def test_the_experts_equal_a_per_token_loop(kernel):
  """float32 against float64: each output is a sum of F + D-term products of O(1) values, computed in float32;
  rtol 1e-5 and atol 1e-5 are ~100 float32 ulps (2**-24 ~ 6e-8) over those ~24-term sums, far below any wrong
  token, slot or expert (which moves an output by O(0.1))."""
  n = 12
  x = jax.random.normal(jax.random.PRNGKey(1), (n, D))
  logits = jax.random.normal(jax.random.PRNGKey(2), (n, E))
  w, ex, _ = moe.route(logits, K)
  w1, w3, w2 = params()
  got = moe.experts_apply(x, w, ex, w1, w3, w2, kernel)
  ref = per_token_reference(x, np.asarray(w), np.asarray(ex), w1, w3, w2)
  assert np.allclose(got, ref, rtol=1e-5, atol=1e-5), np.abs(got - ref).max()
  dropped = moe.experts_apply(x, w.at[3, 0].set(0.0), ex, w1, w3, w2, kernel)  # a dropped assignment adds nothing
  ref[3] -= float(w[3, 0]) * per_token_reference(x[3:4], np.ones((1, 1)), np.asarray(ex[3:4, :1]), w1, w3, w2)[0]
  assert np.allclose(dropped, ref, rtol=1e-5, atol=1e-5)


def test_the_auxiliary_losses_by_hand():
  uniform = jnp.full((4, 4), 0.25)
  balanced = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]])
  assert moe.load_balancing_loss(uniform, balanced) == pytest.approx(1.0)  # E * sum 1/4 * 1/4
  skewed = jnp.array([[1.0, 0, 0, 0]] * 4)  # every token: all probability and both slots on expert 0 and 1
  assert moe.load_balancing_loss(skewed, jnp.array([[0, 1]] * 4)) == pytest.approx(4 * (0.5 * 1.0 + 0.5 * 0.0))
  logits = jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: log 2, log 4
  assert moe.z_loss(logits) == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)


@pytest.mark.parametrize("kernel", moe.KERNELS)
def test_the_layer_equals_the_loop_and_reports_its_load(kernel):
  layer = moe.MoE(experts=E, top_k=K, ffn_dim=F, kernel=kernel)
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, D))
  variables = layer.init(jax.random.PRNGKey(4), x)
  p = jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, variables["params"],
                   is_leaf=lambda a: hasattr(a, "value"))
  y, stats = layer.apply(variables, x)
  tokens = np.asarray(x, np.float64).reshape(-1, D)
  logits = tokens @ np.asarray(p["router"], np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ex = np.argsort(-probs, axis=-1)[:, :K]
  top = np.take_along_axis(probs, ex, -1)
  ref = per_token_reference(tokens, top / top.sum(-1, keepdims=True), ex, p["w1"], p["w3"], p["w2"])
  assert np.allclose(np.asarray(y).reshape(-1, D), ref, rtol=1e-5, atol=1e-5)
  assert stats["tokens_per_expert"].tolist() == np.bincount(ex.reshape(-1), minlength=E).tolist()
  assert float(stats["dropped"]) == 0.0  # dropless


def test_a_capacity_layer_drops_and_says_how_much():
  layer = moe.MoE(experts=E, top_k=K, ffn_dim=F, capacity_factor=0.5)  # room for half the assignments at most
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 8, D))
  y, stats = layer.apply(layer.init(jax.random.PRNGKey(6), x), x)
  per_expert = np.asarray(stats["tokens_per_expert"])
  cap = moe.capacity(16, K, E, 0.5)  # 4
  assert float(stats["dropped"]) == pytest.approx(np.maximum(per_expert - cap, 0).sum() / (16 * K))
  assert float(stats["dropped"]) >= 0.5 and y.shape == x.shape


def test_gradients_equal_central_differences_in_float64():
  """The layer's output (a fixed random projection of it) differentiated by JAX, against central differences in
  float64 (step 1e-6: truncation O(h^2) ~ 1e-12, rounding ~ 1e-16 / 1e-6 = 1e-10), at a point where no routing
  decision is within the step of a tie, for the input and every parameter, along random directions."""
  with jax.enable_x64(True):
    layer = moe.MoE(experts=E, top_k=K, ffn_dim=F, param_dtype=jnp.float64)
    x = jax.random.normal(jax.random.PRNGKey(7), (1, 6, D), jnp.float64)
    variables = layer.init(jax.random.PRNGKey(8), x)
    proj = jax.random.normal(jax.random.PRNGKey(9), x.shape, jnp.float64)

    def f(params, x):
      y, stats = layer.apply({"params": params}, x)
      return jnp.sum(y * proj) + 0.1 * stats["load_balancing"] + 0.01 * stats["z_loss"]
    params = variables["params"]
    grads = jax.grad(f, argnums=(0, 1))(params, x)
    leaves, tree = jax.tree.flatten((params, x))
    dirs = [jax.random.normal(jax.random.PRNGKey(10 + i), a.shape, jnp.float64) for i, a in enumerate(leaves)]
    h = 1e-6
    for i, (g, v) in enumerate(zip(jax.tree.leaves(grads), dirs)):
      def at(s):
        moved = [a + s * v if j == i else a for j, a in enumerate(leaves)]
        return f(*jax.tree.unflatten(tree, moved))
      fd = (at(h) - at(-h)) / (2 * h)
      assert float(jnp.sum(g * v)) == pytest.approx(float(fd), rel=1e-6, abs=1e-8), i


U_BF16 = 2.0 ** -8  # bfloat16 unit roundoff (8 significant bits)


def _bf16_setup(seed):
  """A layer with float32 master weights, bf16 inputs [2, 8, D], and those inputs exactly in float64."""
  layer = moe.MoE(experts=E, top_k=K, ffn_dim=F)
  x = jax.random.normal(jax.random.PRNGKey(seed), (2, 8, D)).astype(jnp.bfloat16)
  w1, w3, w2 = params(seed + 1)  # O(1) outputs; a router of O(1) logits: decisions far from ties
  p = {"router": jax.random.normal(jax.random.PRNGKey(seed + 2), (D, E)), "w1": w1, "w3": w3, "w2": w2}
  return layer, x, p, np.asarray(x.astype(jnp.float32), np.float64)


def _top_k_gap(tokens, router):
  """The least gap between the k-th and (k+1)-th router probability (float64): routing far from ties."""
  logits = tokens @ np.asarray(router, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ranked = -np.sort(-probs, -1)
  return probs, float((ranked[:, K - 1] - ranked[:, K]).min())


@pytest.mark.parametrize("kernel", moe.KERNELS)
def test_bf16_forward_against_float64(kernel):
  """bf16 compute (router in float32) against the per-token loop in float64 on the same bf16 inputs and float32
  weights. Each output passes ~6 roundings to 8 significant bits (the weights cast to bf16 as operands, the
  gate and up GEMM outputs, silu(gate) * up, the down GEMM output, the weighted sum cast back), each <= u = 2^-8
  relative to terms whose magnitudes sum to ~sqrt(F) = 4 times the output scale; in quadrature ~sqrt(6) * 4 u
  ~ 10 u, so 16 u of the largest output bounds it. A wrong expert, slot or weight normalization moves outputs by
  a large part of their scale (> 0.2, i.e. > 50 u)."""
  _, x, p, x64 = _bf16_setup(11)
  layer = moe.MoE(experts=E, top_k=K, ffn_dim=F, kernel=kernel)
  y, _ = layer.apply({"params": p}, x)
  assert y.dtype == jnp.bfloat16
  tokens = x64.reshape(-1, D)
  probs, gap = _top_k_gap(tokens, p["router"])
  assert gap > 1e-5  # float32 router logits (within ~D u32 ~ 1e-6 of float64) cannot flip a decision
  ex = np.argsort(-probs, -1)[:, :K]
  top = np.take_along_axis(probs, ex, -1)
  ref = per_token_reference(tokens, top / top.sum(-1, keepdims=True), ex, p["w1"], p["w3"], p["w2"])
  err = np.abs(np.asarray(y, np.float64).reshape(-1, D) - ref).max()
  tol = 16 * U_BF16 * np.abs(ref).max()
  assert 0 < err <= tol, (err, tol)  # > 0: it computed in bf16


def test_bf16_gradients_against_float64():
  """Gradients of a fixed projection of the output (plus the auxiliary losses) with bf16 compute, against the
  layer's float64 gradients (which test_gradients_equal_central_differences_in_float64 checks against finite
  differences). The backward chains about twice the forward's roundings (each GEMM's input gradient and weight
  gradient rounded to bf16), ~sqrt(12) * 4 u ~ 14 u of each leaf's gradient scale; 32 u of its largest element
  bounds it. The router's gradient flows through float32 probabilities and bf16 expert outputs: the same bound."""
  layer, x, params, x64 = _bf16_setup(21)
  proj = np.asarray(jax.random.normal(jax.random.PRNGKey(5), x.shape), np.float64)

  def f(p, x, proj):
    y, stats = layer.apply({"params": p}, x)
    return jnp.sum(y.astype(jnp.float32) * proj.astype(jnp.float32)) + 0.1 * stats["load_balancing"] \
        + 0.01 * stats["z_loss"]
  assert _top_k_gap(x64.reshape(-1, D), params["router"])[1] > 1e-5  # as in the forward test
  got = jax.grad(f, argnums=(0, 1))(params, x, proj)
  with jax.enable_x64(True):
    layer64 = moe.MoE(experts=E, top_k=K, ffn_dim=F, param_dtype=jnp.float64)

    def f64(p, x):
      y, stats = layer64.apply({"params": p}, x)
      return jnp.sum(y * proj) + 0.1 * stats["load_balancing"] + 0.01 * stats["z_loss"]
    want = jax.grad(f64, argnums=(0, 1))(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params),
                                         jnp.asarray(x64))
    want = jax.tree.map(np.asarray, want)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
    err, tol = np.abs(g - w).max(), 32 * U_BF16 * np.abs(w).max()
    assert err <= tol, (jax.tree_util.keystr(path), err, tol)
