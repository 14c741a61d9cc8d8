"""Each layer backend against references written here, and TE vs Flax on identical parameters."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from maxlm.layers import get_backend, on_gpu, precision_scope
from maxlm.layers.rope import apply_rope, rope_frequencies

BACKENDS = [pytest.param("flax"), pytest.param("te", marks=pytest.mark.te)]
U32 = 2.0 ** -24  # float32 unit roundoff
F64_RTOL = 16 * 2.0 ** -53  # float64 frequencies: a power, a division and the llama3 blend, a few roundings
# Tolerances below are float32 rounding bounds (Higham): a dot product of length n, inputs exact, is
# within n * U32 * sum|a_i b_i| of the exact value; a sum of n positive terms within n * U32 of it.


class Wrap(nn.Module):
  fn: object

  @nn.compact
  def __call__(self, *args):
    return self.fn(*args)


def run(backend, fn, *args, params=None):
  """Init (or reuse `params`) and apply a backend function inside the backend's scope."""
  mod = Wrap(fn)
  with precision_scope("bf16", backend):
    if params is None:
      params = nn.unbox(jax.jit(mod.init)(jax.random.PRNGKey(0), *args))
    return jax.jit(mod.apply)(params, *args), params


def rand(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


# ---- references (float64 numpy) ------------------------------------------------------------------

def ref_rms(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def ref_llama3_inv_freq(dim, theta, factor, low, high, orig):
  out = []
  for i in range(0, dim, 2):
    f = 1.0 / theta ** (i / dim)
    wavelen = 2 * math.pi / f
    if wavelen < orig / high:
      out.append(f)
    elif wavelen > orig / low:
      out.append(f / factor)
    else:
      s = (orig / wavelen - low) / (high - low)
      out.append((1 - s) * f / factor + s * f)
  return np.array(out)


def ref_rope(x, pos, inv_freq):
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  ang = np.asarray(pos, np.float64)[..., None] * inv_freq  # [B, T, Dh/2]
  cos = np.concatenate([np.cos(ang)] * 2, -1)[:, :, None]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[:, :, None]
  rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rot * sin


def ref_attention(q, k, v, window=0, seg=None, probs=False):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, d = q.shape
  rep = h // k.shape[2]
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
  qi, ki = np.arange(t)[:, None], np.arange(t)[None]
  keep = np.broadcast_to(ki <= qi, (b, 1, t, t)).copy()
  if window:
    keep &= (qi - ki < window)
  if seg is not None:
    seg = np.asarray(seg)
    keep &= (seg[:, None, :, None] == seg[:, None, None, :]) & (seg[:, None, :, None] > 0)
  logits = np.where(keep, logits, -1e30)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", p, v)
  return (out, p, logits, keep) if probs else out


def ref_swiglu(x, scale, wi, wo, eps):
  y = ref_rms(x, scale, eps)
  wi = np.asarray(wi, np.float64)
  g, u = y @ wi[:, 0], y @ wi[:, 1]
  return (g / (1 + np.exp(-g)) * u) @ np.asarray(wo, np.float64)


# ---- float32 error bounds --------------------------------------------------------------------------

def rms_rtol(d):
  """RMSNorm in float32: mean of d squares (positive: d ulps, halved by the root), rsqrt, 2 products."""
  return (d / 2 + 8) * U32


def swiglu_tol(x, scale, wi, wo, eps):
  """Elementwise bound for the float32 SwiGLU MLP, each stage's error carried forward in absolute value."""
  wi, wo = np.asarray(wi, np.float64), np.asarray(wo, np.float64)
  d, f = wi.shape[0], wi.shape[2]
  y = ref_rms(x, scale, eps)  # [B, T, D]
  g, u = y @ wi[:, 0], y @ wi[:, 1]  # [B, T, F]
  e_g = (d + rms_rtol(d) / U32) * U32 * (np.abs(y) @ np.abs(wi[:, 0]))  # norm + dot of length D
  e_u = (d + rms_rtol(d) / U32) * U32 * (np.abs(y) @ np.abs(wi[:, 1]))
  silu = g / (1 + np.exp(-g))
  act = silu * u  # [B, T, F]; |silu'| <= 1.1, silu and the product: 4 ulps
  e_act = 1.1 * e_g * (np.abs(u) + e_u) + np.abs(silu) * e_u + 4 * U32 * np.abs(act)
  return e_act @ np.abs(wo) + f * U32 * (np.abs(act) @ np.abs(wo))  # [B, T, D]


def attention_tol(q, k, v, window, seg):
  """Elementwise bound for float32 softmax(q k^T / sqrt(Dh)) v: logits within Dh ulps of sum|q k|;
  a probability moves by at most 2 max|d logit| relative (plus the T-term normalization); the
  output by that times sum_j p_j |v_j|, plus T ulps of it for the weighted sum."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, dh = q.shape
  rep = h // k.shape[2]
  _, p, logits, keep = ref_attention(q, k, v, window, seg, probs=True)  # p, logits [B, H, T, T]
  ak = np.repeat(np.abs(k), rep, axis=2)
  e_logit = dh * U32 * np.einsum("bqhd,bkhd->bhqk", np.abs(q), ak) / np.sqrt(dh) + 2 * U32 * np.abs(logits)
  e_logit = np.where(keep, e_logit, 0).max(-1)  # [B, H, T]
  rel_p = 2 * e_logit + (t + 8) * U32
  pv = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(np.abs(v), rep, axis=2))  # [B, T, H, Dh]
  return (np.transpose(rel_p, (0, 2, 1))[..., None] + t * U32) * pv


def rope_tol(x, pos, inv_freq):
  """float32 RoPE: the angle pos * f is off by <= 2 |pos f| ulps (f and the product rounded), sin/cos
  by that plus 2 ulps, then x1 cos - x2 sin rounds 3 times."""
  x = np.abs(np.asarray(x, np.float64))
  ang = np.abs(np.asarray(pos, np.float64))[..., None] * inv_freq  # [B, T, Dh/2]
  e = ((2 * ang + 2) * U32)[:, :, None, :]  # [B, T, 1, Dh/2]
  half = x.shape[-1] // 2
  pair = x[..., :half] + x[..., half:]  # [B, T, N, Dh/2]
  return np.concatenate([(e + 3 * U32) * pair] * 2, -1)


def assert_within(actual, expected, tol, what=""):
  off = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)) - tol
  assert (off <= 0).all(), f"{what}: {(off > 0).sum()} elements beyond the float32 bound, by {off.max():.3g}"


# ---- tests -----------------------------------------------------------------------------------------

def test_rope_matches_reference_with_and_without_llama3_scaling():
  x = rand((2, 7, 3, 16))
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 11]])
  plain = rope_frequencies(16, 10000.0)
  np.testing.assert_allclose(plain, 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16), rtol=F64_RTOL)
  assert_within(apply_rope(x, pos, plain), ref_rope(x, pos, plain), rope_tol(x, pos, plain), "rope")
  scaled = rope_frequencies(128, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
  np.testing.assert_allclose(scaled, ref_llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192), rtol=F64_RTOL)
  assert not np.allclose(scaled, rope_frequencies(128, 500000.0))  # scaling changes low frequencies
  # the defaults are Llama 3.1's published values (factor 8, low 1, high 4, original context 8192)
  np.testing.assert_allclose(rope_frequencies(128, 500000.0, "llama3"), scaled, rtol=0)
  # a low-frequency factor other than 1 moves the low-wavelength bound (original / low)
  other = rope_frequencies(128, 500000.0, "llama3", 8.0, 2.0, 4.0, 8192)
  np.testing.assert_allclose(other, ref_llama3_inv_freq(128, 500000.0, 8.0, 2.0, 4.0, 8192), rtol=F64_RTOL)
  with pytest.raises(ValueError, match="^unknown rope scaling 'yarn'$"):
    rope_frequencies(128, 500000.0, "yarn")


def test_on_gpu_asks_jax_for_its_default_backend(monkeypatch):
  for backend, want in (("gpu", True), ("cpu", False), ("tpu", False)):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    assert on_gpu() is want


def test_rope_positions_restart_per_document():
  x = rand((1, 6, 2, 8))
  inv = rope_frequencies(8, 10000.0)
  pos = jnp.array([[0, 1, 2]])
  packed = apply_rope(x, jnp.array([[0, 1, 2, 0, 1, 2]]), inv)
  # Two float32 evaluations of the same rotation, each within rope_tol of the exact one.
  assert_within(packed[:, 3:], apply_rope(x[:, 3:], pos, inv), 2 * rope_tol(x[:, 3:], pos, inv), "restart")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm(backend):
  be = get_backend(backend)
  x = rand((2, 5, 32))
  y, p = run(backend, functools.partial(be.rms_norm, eps=1e-5, param_dtype=jnp.float32, name="n"), x)
  scale = np.asarray(p["params"]["n"]["scale"])
  ref = ref_rms(x, scale, 1e-5)
  assert_within(y, ref, rms_rtol(32) * np.abs(ref), "rms_norm")


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_carry_their_dtype_and_logical_axes(backend):
  """What mixed precision and sharding read: every parameter in param_dtype (bfloat16 here) and boxed with
  its logical axis names, the same names in both backends."""
  be = get_backend(backend)
  init, bf16 = nn.initializers.normal(0.02), jnp.bfloat16
  cases = {  # name: (function, input, {parameter: logical axes})
      "n": (functools.partial(be.rms_norm, eps=1e-5, param_dtype=bf16, name="n"), rand((2, 5, 32)),
            {"scale": ("norm",)}),
      "d": (functools.partial(be.norm_dense, features=(4, 8), kernel_axes=("embed", "heads", "head_dim"), eps=1e-5,
                              param_dtype=bf16, kernel_init=init, name="d"), rand((2, 5, 32)),
            {"scale": ("norm",), "kernel": ("embed", "heads", "head_dim")}),
      "o": (functools.partial(be.dense, features=(32,), axis=(-2, -1), kernel_axes=("heads", "head_dim", "embed"),
                              param_dtype=bf16, kernel_init=init, name="o"), rand((2, 5, 4, 8)),
            {"kernel": ("heads", "head_dim", "embed")}),
      "m": (functools.partial(be.norm_mlp, ffn_dim=16, eps=1e-5, param_dtype=bf16, kernel_init=init, name="m"),
            rand((2, 5, 32)), {"scale": ("norm",), "wi_kernel": ("embed", "act", "mlp"), "wo_kernel": ("mlp", "embed")}),
  }
  for name, (fn, x, axes) in cases.items():
    with precision_scope("bf16", backend):
      boxed = jax.eval_shape(Wrap(fn).init, jax.random.PRNGKey(0), x)["params"][name]
    assert {k: (tuple(v.names), v.value.dtype) for k, v in boxed.items()} == {
        k: (a, jnp.dtype(bf16)) for k, a in axes.items()}, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_dense_multi_dim_features(backend):
  be = get_backend(backend)
  x = rand((2, 5, 32))
  fn = functools.partial(be.norm_dense, features=(2, 3, 8),
                         kernel_axes=("embed", "kv_heads", "qkv", "head_dim"), eps=1e-5,
                         param_dtype=jnp.float32, kernel_init=nn.initializers.normal(0.1), name="qkv")
  y, p = run(backend, fn, x)
  w = np.asarray(p["params"]["qkv"]["kernel"])
  assert w.shape == (32, 2, 3, 8) and y.shape == (2, 5, 2, 3, 8)
  normed = ref_rms(x, p["params"]["qkv"]["scale"], 1e-5)  # [B, T, D]
  ref = np.einsum("btd,dkgh->btkgh", normed, w)
  # the norm's relative error, then a dot of length D
  tol = (32 + rms_rtol(32) / U32) * U32 * np.einsum("btd,dkgh->btkgh", np.abs(normed), np.abs(w))
  assert_within(y, ref, tol, "norm_dense")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_contracts_heads(backend):
  be = get_backend(backend)
  x = rand((2, 5, 4, 8))
  fn = functools.partial(be.dense, features=(32,), axis=(-2, -1), kernel_axes=("heads", "head_dim", "embed"),
                         param_dtype=jnp.float32, kernel_init=nn.initializers.normal(0.1), name="out")
  y, p = run(backend, fn, x)
  w = np.asarray(p["params"]["out"]["kernel"], np.float64)
  tol = 4 * 8 * U32 * np.einsum("bthd,hde->bte", np.abs(np.asarray(x, np.float64)), np.abs(w))  # length H*Dh
  assert_within(y, np.einsum("bthd,hde->bte", np.asarray(x, np.float64), w), tol, "dense")


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_mlp(backend):
  be = get_backend(backend)
  x = rand((2, 5, 32))
  fn = functools.partial(be.norm_mlp, ffn_dim=48, eps=1e-5, param_dtype=jnp.float32,
                         kernel_init=nn.initializers.normal(0.2), name="mlp")
  y, p = run(backend, fn, x)
  mp = p["params"]["mlp"]
  assert mp["wi_kernel"].shape == (32, 2, 48) and mp["wo_kernel"].shape == (48, 32)
  args = (x, mp["scale"], mp["wi_kernel"], mp["wo_kernel"], 1e-5)
  assert_within(y, ref_swiglu(*args), swiglu_tol(*args), "swiglu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,packed", [(0, False), (3, False), (0, True), (4, True)])
def test_gqa_attention(backend, window, packed):
  be = get_backend(backend)
  q, k, v = rand((2, 9, 4, 8), 1), rand((2, 9, 2, 8), 2), rand((2, 9, 2, 8), 3)
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2]]) if packed else None
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5, 0, 1, 2]]) if packed else None
  fn = functools.partial(be.attention, segment_ids=seg, positions=pos, window=window, max_segments=4,
                         name="a")
  y, _ = run(backend, fn, q, k, v)
  ref = ref_attention(q, k, v, window, seg)
  valid = np.asarray(seg > 0)[..., None, None] if packed else np.ones((1, 1, 1, 1), bool)
  tol = attention_tol(q, k, v, window, seg)
  assert_within(np.where(valid, y, 0), np.where(valid, ref, 0), tol, "attention")


@pytest.mark.te
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_te_equals_flax_on_the_same_parameters(dtype):
  te, fx = get_backend("te"), get_backend("flax")
  x = rand((2, 6, 32)).astype(dtype)

  def block(be):
    def fn(x):
      h = be.norm_dense(x, features=(2, 4, 8), kernel_axes=("embed", "kv_heads", "qkv", "head_dim"), eps=1e-5,
                        param_dtype=jnp.float32, kernel_init=nn.initializers.normal(0.2), name="qkv")
      q = h[:, :, :, :2].reshape(2, 6, 4, 8)
      a = be.attention(q, h[:, :, :, 2], h[:, :, :, 3], name="attn")
      o = be.dense(a, features=(32,), axis=(-2, -1), kernel_axes=("heads", "head_dim", "embed"),
                   param_dtype=jnp.float32, kernel_init=nn.initializers.normal(0.2), name="out")
      return be.norm_mlp(x + o, ffn_dim=64, eps=1e-5, param_dtype=jnp.float32,
                         kernel_init=nn.initializers.normal(0.2), name="mlp")
    return fn

  y_te, params = run("te", block(te), x)
  y_fx, params_fx = run("flax", block(fx), x, params=params)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(run("flax", block(fx), x)[1])
  assert y_te.dtype == y_fx.dtype == dtype
  a, b = np.asarray(y_te, np.float32), np.asarray(y_fx, np.float32)
  if dtype == jnp.float32:  # each against the float64 composition of the references above
    pp = jax.tree_util.tree_map(lambda w: np.asarray(w, np.float64), params["params"])
    x64 = np.asarray(x, np.float64)
    h = np.einsum("btd,dkgh->btkgh", ref_rms(x64, pp["qkv"]["scale"], 1e-5), pp["qkv"]["kernel"])
    ctx = ref_attention(h[:, :, :, :2].reshape(2, 6, 4, 8), h[:, :, :, 2], h[:, :, :, 3])
    x1 = x64 + np.einsum("bthd,hde->bte", ctx, pp["out"]["kernel"])
    ref = ref_swiglu(x1, pp["mlp"]["scale"], pp["mlp"]["wi_kernel"], pp["mlp"]["wo_kernel"], 1e-5)
    # 5 contraction stages (qkv, scores, context, out, MLP x2), each <= 64 ulps of the output scale
    # (lengths <= 64: ~sqrt(64) = 8 ulps with rounding of random sign, 8x margin).
    tol = 6 * 64 * U32 * np.abs(ref).max()
    assert_within(a, ref, tol, "te")
    assert_within(b, ref, tol, "flax")
  else:
    # bf16 keeps 8 bits: each of ~7 activation roundings (norm, qkv, probabilities, context, out,
    # MLP hidden, output) is <= 2^-9 relative, of random sign (RMS 2^-9 / sqrt(3)); two
    # implementations then differ by ~sqrt(2 * 7) * 2^-9 / sqrt(3) = 4.2e-3 in relative L2; 1e-2
    # leaves ~2x for the norm and softmax amplifying it.
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


@pytest.mark.parametrize("dist,module,want", [(True, True, True), (True, False, True), (False, True, True),
                                              (False, False, False)])
def test_te_is_found_as_a_pip_wheel_or_as_one_container_build(monkeypatch, dist, module, want):
  """pip installs TE's JAX extension as the `transformer_engine_jax` distribution; NVIDIA's JAX containers
  build TE as one `transformer_engine` wheel, where only the extension module itself is there."""
  import importlib.machinery
  import importlib.metadata
  import importlib.util

  from maxlm.layers import te_env
  spec = importlib.machinery.ModuleSpec("x", None)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "transformer_engine" or (
      name == "transformer_engine_jax" and module) else None)

  def version(name):
    if dist and name == "transformer_engine_jax":
      return "2.20.2"
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "version", version)
  assert te_env.te_installed() is want



@pytest.mark.te
def test_te_is_imported_without_its_pytorch_half(tmp_path):
  """TE's package imports its PyTorch half when torch is installed: `import torch` at every start, and without
  TE's PyTorch extension (maxlm installs the JAX one) a 2-line RuntimeWarning. import_te blocks only that import:
  a stand-in `torch` package on the path records whether it was imported, stderr has no warning, TE's JAX half
  works, and `transformer_engine.pytorch` is importable again afterwards (no `None` left in sys.modules)."""
  import os
  import subprocess
  import sys
  from pathlib import Path
  from maxlm.layers import te_env
  if not te_env.te_installed():
    pytest.skip("Transformer Engine is not installed")
  fake = tmp_path / "fake" / "torch"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("import os\nopen(os.environ['TORCH_MARK'], 'a').write('imported\\n')\n")
  mark = tmp_path / "mark"
  code = ("import sys; from maxlm.layers.te_env import import_te; te = import_te(); "
          "assert 'torch' not in sys.modules, 'torch imported'; "
          "assert sys.modules.get('transformer_engine.pytorch', 'absent') == 'absent'; "
          "print('te', te.__name__, callable(te.autocast))")
  root = Path(__file__).resolve().parents[1]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(root)]),
         "TORCH_MARK": str(mark), "PYTHONWARNINGS": "default"}
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip() == "te transformer_engine.jax True"
  assert not mark.exists()
  assert "PyTorch" not in r.stderr, r.stderr[-2000:]


# ---- backend and precision plumbing (surviving mutants of docs/mutation.md) --------------------------

@pytest.mark.te
def test_get_backend_returns_the_named_backend_module():
  from maxlm.layers import flax_backend, te_backend
  assert get_backend("te") is te_backend and get_backend("flax") is flax_backend
  assert get_backend("auto") is te_backend  # TE is installed wherever te-marked tests run
  with pytest.raises(ValueError, match="^unknown backend 'jax'$"):
    get_backend("jax")


@pytest.mark.te
def test_each_quantized_precision_gets_its_te_recipe():
  """The TE recipe classes and formats the README's precision table names (TE's recipe module)."""
  from maxlm.layers import make_recipe
  assert make_recipe("bf16") is None and make_recipe("fp16") is None
  want = {"fp8_delayed": ("DelayedScaling", "HYBRID"), "fp8_current": ("Float8CurrentScaling", "HYBRID"),
          "mxfp8": ("MXFP8BlockScaling", "E4M3"), "nvfp4": ("NVFP4BlockScaling", None)}
  for precision, (cls, fmt) in want.items():
    r = make_recipe(precision, amax_history_len=16)
    assert type(r).__name__ == cls, precision
    if fmt is not None:
      assert r.fp8_format.name == fmt, precision
  delayed = make_recipe("fp8_delayed", amax_history_len=16)
  assert (delayed.amax_history_len, delayed.amax_compute_algo) == (16, "max")
  assert make_recipe("fp8_delayed").amax_history_len == 1024  # the documented default
  assert make_recipe("nvfp4").disable_stochastic_rounding is True  # the step passes no sr_rng stream


def test_precision_errors_name_what_is_missing(monkeypatch):
  import maxlm.layers as layers
  monkeypatch.setattr(layers, "supported_precisions", lambda: ["bf16", "fp16", "fp8_delayed"])
  for precision, backend in (("bf16", "flax"), ("fp16", "flax"), ("bf16", "te"), ("fp16", "te"),
                             ("fp8_delayed", "te")):
    layers.check_precision(precision, backend)  # runs here: no error
  with pytest.raises(layers.PrecisionError, match=r"^unknown model.precision 'fp32'; choose one of bf16, fp16, "
                     r"fp8_delayed, fp8_current, mxfp8, nvfp4$"):
    layers.check_precision("fp32", "te")
  with pytest.raises(layers.PrecisionError, match=r"^model.precision=fp8_delayed needs model.backend=te "
                     r"\(quantized matmuls run through Transformer Engine\)$"):
    layers.check_precision("fp8_delayed", "flax")
  kind = jax.devices()[0].device_kind
  for precision in ("fp8_current", "mxfp8", "nvfp4"):
    need = " (MXFP8 and NVFP4 need a Blackwell GPU)" if precision != "fp8_current" else ""
    with pytest.raises(layers.PrecisionError) as e:
      layers.check_precision(precision, "te")
    assert str(e.value) == (f"model.precision={precision} is not supported on this device ({kind}){need}; "
                            "supported here: bf16, fp16, fp8_delayed")


@pytest.mark.te
@pytest.mark.parametrize("capability,want", [(90, ["fp8_delayed", "fp8_current"]),
                                             (100, ["fp8_delayed", "fp8_current", "mxfp8", "nvfp4"])])
def test_supported_precisions_follow_the_gpu_generation(monkeypatch, capability, want):
  """FP8 from Hopper (compute capability 9.0), MXFP8 and NVFP4 from Blackwell (10.0), as TE reports them."""
  from maxlm.layers import supported_precisions
  from maxlm.layers.te_env import import_te
  import_te()
  import transformer_engine_jax
  from transformer_engine.jax.quantize import device_utils, helper
  monkeypatch.setattr(transformer_engine_jax, "get_device_compute_capability", lambda gpu_id=0: capability)
  device_utils.get_device_compute_capability.cache_clear()
  monkeypatch.setattr(helper, "_is_scaling_mode_supported", None)
  monkeypatch.setattr(helper, "_reason_for_no_scaling_mode", None, raising=False)
  try:
    assert supported_precisions() == ["bf16", "fp16"] + want
  finally:
    device_utils.get_device_compute_capability.cache_clear()


@pytest.mark.parametrize("dtype,platform,computed", [
    (jnp.float16, "cpu", jnp.float32),  # XLA:CPU has no float16 dot with float32 accumulation
    (jnp.float16, "gpu", jnp.float16), (jnp.bfloat16, "cpu", jnp.bfloat16), (jnp.bfloat16, "gpu", jnp.bfloat16),
    (jnp.float32, "cpu", jnp.float32)])
def test_flax_attention_upcasts_only_float16_on_cpu(monkeypatch, dtype, platform, computed):
  """Elsewhere the attention runs in the compute dtype (a GPU's fused kernels need bf16/fp16 inputs); the
  result always comes back in it."""
  from maxlm.layers import flax_backend
  seen = []

  def spy(q, k, v, **kw):
    seen.append((q.dtype, k.dtype, v.dtype))
    return jnp.zeros(q.shape, q.dtype)  # [B, T, H, Dh]
  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  q, k = rand((1, 4, 2, 8), 1, dtype), rand((1, 4, 1, 8), 2, dtype)
  out = flax_backend.attention(q, k, k)
  assert seen == [(jnp.dtype(computed),) * 3] and out.dtype == dtype


TE_MASKS = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
            "padding_causal_bottom_right")  # transformer_engine.jax.attention.AttnMaskType's names


class FakeTEAttention:
  """Stands in for TE's DotProductAttention on a GPU (cuDNN): records how it is built and called, and
  computes what TE documents for a SequenceDescriptor (segment ids and positions of queries and keys):
  with a padding mask, a query sees keys of its own document (segment > 0); causal, by position in the
  document; window_size (left, 0) keeps keys at most `left` positions back."""
  built = []

  def __init__(self, **kw):
    self.kw = kw
    FakeTEAttention.built.append(kw)

  def __call__(self, q, k, v, desc, *, deterministic):
    kw = self.kw
    (seg_q, seg_k), (pos_q, pos_k) = desc.segment_ids, desc.segment_pos  # [B, T] each
    mask = kw["attn_mask_type"]
    assert mask in TE_MASKS, mask  # TE refuses other names
    keep = np.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)  # [B, 1, Tq, Tk]
    if "padding" in mask:
      seg_q, seg_k = np.asarray(seg_q)[:, None, :, None], np.asarray(seg_k)[:, None, None, :]
      keep &= (seg_q == seg_k) & (seg_q > 0)
    rel = np.asarray(pos_q)[:, None, :, None] - np.asarray(pos_k)[:, None, None, :]  # [B, 1, Tq, Tk]
    if "causal" in mask:
      keep &= rel >= 0
    if kw["window_size"] is not None:
      keep &= rel <= kw["window_size"][0]
    qd, kd, vd = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = kw["num_attention_heads"] // kw["num_gqa_groups"]
    kd, vd = np.repeat(kd, rep, axis=2), np.repeat(vd, rep, axis=2)
    logits = np.where(keep, np.einsum("bqhd,bkhd->bhqk", qd, kd) * kw["scale_factor"], -1e30)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vd)  # [B, T, H, Dh]


@pytest.mark.te
@pytest.mark.parametrize("window,packed", [(0, True), (3, False), (4, True)])
def test_te_attention_on_a_gpu_hands_te_the_documents(monkeypatch, window, packed):
  """The cuDNN branch (bf16 on a GPU): packed rows go to TE as THD with a SequenceDescriptor of the
  documents and a padding-causal mask, room for every document of a row, no dropout; a sliding window
  without packing as one document per row. TE is faked (FakeTEAttention: its documented semantics), so
  the result is checked against the reference attention of this file."""
  from maxlm.layers import te_backend
  from maxlm.layers.te_env import import_te
  te = import_te()
  FakeTEAttention.built = []
  monkeypatch.setattr(te.flax, "DotProductAttention", FakeTEAttention)
  monkeypatch.setattr(te_backend, "on_gpu", lambda: True)
  q, k, v = (rand(s, i, jnp.bfloat16) for i, s in enumerate([(2, 9, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8)], 1))
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2]]) if packed else None
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5, 0, 1, 2]]) if packed else None
  out = te_backend.attention(q, k, v, segment_ids=seg, positions=pos, window=window, max_segments=4)
  (kw,) = FakeTEAttention.built
  assert kw["qkv_layout"] == "thd_thd_thd" and kw.get("attention_dropout", 0.0) == 0.0  # TE's default: 0.0
  assert kw["max_segments_per_seq"] >= 3  # the most documents in a row here
  ref = ref_attention(q, k, v, window, seg)
  valid = np.asarray(seg > 0)[..., None, None] if packed else np.ones((1, 1, 1, 1), bool)
  # the fake computes in float64 from the same bf16 inputs as the reference: only summation order differs
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0), rtol=1e-12, atol=1e-12)


def test_resolve_backend_without_te(monkeypatch):
  import maxlm.layers as layers
  monkeypatch.setattr(layers, "te_installed", lambda: False)
  assert layers.resolve_backend("auto") == "flax" and layers.resolve_backend("flax") == "flax"
  with pytest.raises(layers.PrecisionError, match=r"^model.backend=te but Transformer Engine is not installed "
                     r"\(bash scripts/setup.sh installs it; or use model.backend=flax\)$"):
    layers.resolve_backend("te")
  monkeypatch.setattr(layers, "te_installed", lambda: True)
  assert layers.resolve_backend("auto") == "te" and layers.resolve_backend("te") == "te"
  with pytest.raises(ValueError, match="^unknown backend 'TE'$"):
    layers.resolve_backend("TE")


def saved_by(policy, capsys):
  """What jax.checkpoint keeps for the backward under `policy` in a function with a non-batched matmul
  named "qkv_proj", one named "context" and a batched matmul: (names kept, count of matmul outputs kept)."""
  from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

  def f(x, w):
    a = checkpoint_name(jnp.sin(x @ w), "qkv_proj")  # [4, 4]
    b = checkpoint_name(jnp.sin(a @ w), "context")  # [4, 4]
    return jnp.sum(jnp.sin(jnp.einsum("bij,bjk->bik", b[None], b[None])))  # a batched matmul
  capsys.readouterr()
  print_saved_residuals(jax.checkpoint(f, policy=policy), jnp.ones((4, 4)), jnp.ones((4, 4)))
  lines = capsys.readouterr().out.splitlines()
  names = {n for line in lines for n in ("qkv_proj", "context") if f"named '{n}'" in line}
  return names, sum("output of dot_general" in line for line in lines)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_policies_keep_what_their_names_say(backend, capsys):
  from maxlm.layers import remat_policy
  get_backend(backend)  # sets TE up on this host, as building a model does before remat_policy
  assert remat_policy("none", backend) is None  # no jax.checkpoint at all
  assert saved_by(remat_policy("full", backend), capsys) == (set(), 0)  # everything recomputed
  assert saved_by(remat_policy("save_dots", backend), capsys) == (set(), 2)  # the matmuls without batch dims
  assert saved_by(remat_policy("save_attn", backend), capsys) == ({"context"}, 0)
  assert saved_by(remat_policy("save_qkv_attn", backend), capsys) == ({"qkv_proj", "context"}, 0)
  assert saved_by(remat_policy("save_dots_attn", backend), capsys) == ({"context"}, 2)
  with pytest.raises(ValueError, match="^unknown remat policy 'save_all'$"):
    remat_policy("save_all", backend)


def test_recompute_norm_act_is_refused_on_the_flax_backend():
  from maxlm.layers import PrecisionError, check_remat, remat_policy
  msg = (r"^model.remat=recompute_norm_act needs model.backend=te \(it leaves out the outputs of TE's RMSNorm "
         r"and activation kernels\)$")
  with pytest.raises(PrecisionError, match=msg):
    check_remat("recompute_norm_act", "flax")
  with pytest.raises(PrecisionError, match=msg):
    remat_policy("recompute_norm_act", "flax")
  check_remat("recompute_norm_act", "te")
  check_remat("save_dots", "flax")


@pytest.mark.te
def test_te_recompute_norm_act_drops_the_outputs_of_te_norm_and_activation_primitives():
  """On a GPU TE's RMSNorm and SwiGLU are its own primitives (custom calls; tests/test_gpu.py counts them in
  the compiled gradient): the policy refuses exactly their outputs and keeps everything else's."""
  from maxlm.layers import remat_policy
  get_backend("te")  # sets TE up on this host before TE's imports below
  from transformer_engine.jax.cpp_extensions.activation import ActLuPrimitive, DActLuQuantizePrimitive
  from transformer_engine.jax.cpp_extensions.attention import FusedAttnFwdPrimitive
  from transformer_engine.jax.cpp_extensions.gemm import GemmPrimitive
  from transformer_engine.jax.cpp_extensions.normalization import NormBwdPrimitive, NormFwdPrimitive
  policy = remat_policy("recompute_norm_act", "te")
  name_p = jax.make_jaxpr(lambda x: jax.ad_checkpoint.checkpoint_name(x, "a"))(1.0).eqns[0].primitive
  assert not policy(NormFwdPrimitive.outer_primitive) and not policy(ActLuPrimitive.outer_primitive)
  for prim in (GemmPrimitive.outer_primitive, FusedAttnFwdPrimitive.outer_primitive, NormBwdPrimitive.outer_primitive,
               DActLuQuantizePrimitive.outer_primitive, name_p, jax.lax.sin_p,
               jax.lax.dot_general_p, jax.lax.add_p):
    assert policy(prim), prim


@pytest.mark.te
def test_te_save_dots_also_keeps_te_gemms():
  """On a GPU TE's GEMMs are custom calls, not dot_general: the TE backend needs TE's own policy."""
  from maxlm.layers import remat_policy
  get_backend("te")  # sets TE up on this host (NCCL preloaded) before TE's import below
  from transformer_engine.jax.checkpoint_policies import dots_and_te_gemms_with_no_batch_dims
  assert remat_policy("save_dots", "te") is dots_and_te_gemms_with_no_batch_dims
  assert remat_policy("save_dots", "flax") is jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims


def test_nccl_is_preloaded_globally_from_the_first_path_that_has_it(monkeypatch, tmp_path):
  """TE's libraries link libnccl.so.2 without an RPATH: the one of pip's nvidia-nccl wheel (first on
  sys.path) is loaded RTLD_GLOBAL before TE is imported; once."""
  import ctypes
  import sys

  from maxlm.layers import te_env
  for d in ("a", "b"):
    lib = tmp_path / d / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
  (tmp_path / "c" / "nvidia" / "nccl" / "lib").mkdir(parents=True)  # the wheel's folder without the library
  loaded = []
  monkeypatch.setattr(ctypes, "CDLL", lambda name, mode=None: loaded.append((name, mode)))
  monkeypatch.setattr(sys, "path", [str(tmp_path / d) for d in ("none", "c", "a", "b")])
  te_env._preload_nccl()
  assert loaded == [(str(tmp_path / "a" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"), ctypes.RTLD_GLOBAL)]
  loaded.clear()
  monkeypatch.setattr(sys, "path", [str(tmp_path / "none")])
  te_env._preload_nccl()  # no wheel: nothing loaded, no error
  assert loaded == []


def test_llama3_rope_scaling_at_the_low_frequency_boundary():
  """A wavelength exactly at original / low_freq_factor is blended with weight 0 (Llama 3.1's formula:
  only longer wavelengths take the plain inv_freq / factor branch, and the blend gives the same there):
  head_dim 2 has inv_freq [1], wavelength 2 pi, put on the boundary with original_max_position = 2 pi."""
  got = rope_frequencies(2, 10000.0, "llama3", 8.0, 1.0, 4.0, 2 * math.pi)
  np.testing.assert_allclose(got, ref_llama3_inv_freq(2, 10000.0, 8.0, 1.0, 4.0, 2 * math.pi), rtol=F64_RTOL)
  np.testing.assert_allclose(got, [1.0 / 8.0], rtol=F64_RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_are_initialized_by_the_given_initializer(backend):
  """model.init_std reaches every matmul weight through kernel_init (a constant here, to see it)."""
  be = get_backend(backend)
  init = nn.initializers.constant(0.25)
  fns = [functools.partial(be.norm_dense, features=(4, 8), kernel_axes=("embed", "heads", "head_dim"), eps=1e-5,
                           param_dtype=jnp.float32, kernel_init=init, name="d"),
         functools.partial(be.dense, features=(32,), axis=(-1,), kernel_axes=("embed", "mlp"),
                           param_dtype=jnp.float32, kernel_init=init, name="o"),
         functools.partial(be.norm_mlp, ffn_dim=16, eps=1e-5, param_dtype=jnp.float32, kernel_init=init, name="m")]
  for fn in fns:
    with precision_scope("bf16", backend):
      params = nn.unbox(Wrap(fn).init(jax.random.PRNGKey(0), rand((2, 3, 32))))["params"]
    kernels = {k: v for layer in params.values() for k, v in layer.items() if k.endswith("kernel")}
    assert kernels and all(np.all(np.asarray(v) == 0.25) for v in kernels.values()), fn.keywords["name"]


@pytest.mark.te
def test_te_layers_left_unquantized_under_an_fp8_recipe(fake_fp8_gpu):
  """quantize=False (what the model keeps out of FP8, e.g. the LM head): inside an FP8 autocast the GEMM
  runs unquantized, within float32 rounding of the exact product (D=32 terms: 32 ulps of sum |x w|);
  quantize=True rounds both operands to e4m3 (3 mantissa bits: errors of ~2**-4 relative, far outside)."""
  be = get_backend("te")
  x = rand((2, 3, 32))
  init = nn.initializers.normal(0.5)
  for name, fn in (("dense", functools.partial(be.dense, features=(16,), axis=(-1,), kernel_axes=("embed", "mlp"),
                                               param_dtype=jnp.float32, kernel_init=init, name="l")),
                   ("norm_dense", functools.partial(be.norm_dense, features=(16,), kernel_axes=("embed", "mlp"),
                                                    eps=1e-5, param_dtype=jnp.float32, kernel_init=init, name="l"))):
    for quantize in (False, True):
      mod = Wrap(functools.partial(fn, quantize=quantize))
      with precision_scope("fp8_current", "te"):
        params = nn.unbox(jax.jit(mod.init)(jax.random.PRNGKey(0), x))
        y = jax.jit(mod.apply)(params, x)
      p = params["params"]["l"]
      a = ref_rms(x, p["scale"], 1e-5) if name == "norm_dense" else np.asarray(x, np.float64)  # [B, T, D]
      w = np.asarray(p["kernel"], np.float64)
      rel = 32 + (rms_rtol(32) / U32 if name == "norm_dense" else 0)  # + the norm's error, as above
      tol = rel * U32 * (np.abs(a) @ np.abs(w))
      within = bool((np.abs(np.asarray(y, np.float64) - a @ w) <= tol).all())
      assert within == (not quantize), (name, quantize)
