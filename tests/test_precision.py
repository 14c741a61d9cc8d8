"""Precision names and their hardware gate: FP8 from Hopper, MXFP8 and NVFP4 from Blackwell.

TE decides what a GPU supports from its compute capability (and the CUDA / cuBLASLt versions); these
tests fake those probes on CPU, like conftest's `fake_fp8_gpu` (Hopper, 9.0), and check both sides of
the gate: refusal in one line naming what is supported, and acceptance with the right TE recipe.
"""

import jax
import jax.numpy as jnp
import pytest

from maxlm import layers
from maxlm.config import CHOICES, load_config
from maxlm.layers import PrecisionError, check_precision, make_recipe, precision_scope, supported_precisions
from maxlm.tables import PRECISIONS

# Precisions without a TE quantization recipe (bf16, and fp16 where present) run on any device.
ANYWHERE = [p for p in PRECISIONS if p not in layers.RECIPES]
HOPPER = ANYWHERE + ["fp8_delayed", "fp8_current"]  # written out: what TE 2.20 runs on compute capability 9.0
BLACKWELL = HOPPER + ["mxfp8", "nvfp4"]  # and on 10.0 with CUDA/cuBLASLt >= 12.8


@pytest.fixture
def fake_blackwell(monkeypatch):
  """TE's probes report a Blackwell GPU (compute capability 10.0, CUDA 13.0, cuBLASLt 13.0)."""
  from maxlm.layers.te_env import import_te
  import_te()
  import transformer_engine_jax
  from transformer_engine.jax.quantize import device_utils, helper
  monkeypatch.setattr(transformer_engine_jax, "get_device_compute_capability", lambda gpu_id=0: 100)
  monkeypatch.setattr(helper, "get_cublasLt_version", lambda: 130000)
  monkeypatch.setattr(helper, "get_cuda_version", lambda: 13000)
  device_utils.get_device_compute_capability.cache_clear()
  monkeypatch.setattr(helper, "_is_scaling_mode_supported", None)
  monkeypatch.setattr(helper, "_reason_for_no_scaling_mode", None, raising=False)
  yield
  device_utils.get_device_compute_capability.cache_clear()


def test_config_accepts_the_new_names_and_matches_the_layers():
  for name in ("mxfp8", "nvfp4"):
    assert load_config([f"model.precision={name}"]).model.precision == name
  assert set(CHOICES["model.precision"]) == set(PRECISIONS)


@pytest.mark.te
def test_recipe_objects():
  from maxlm.layers.te_env import import_te
  import_te()  # TE's libraries need the host set up before their first import
  from transformer_engine.common import recipe
  assert make_recipe("bf16") is None
  d = make_recipe("fp8_delayed", 16)
  assert type(d) is recipe.DelayedScaling and d.amax_history_len == 16 and d.fp8_format == recipe.Format.HYBRID
  assert type(make_recipe("fp8_current")) is recipe.Float8CurrentScaling
  mx = make_recipe("mxfp8")
  assert type(mx) is recipe.MXFP8BlockScaling and mx.fp8_format == recipe.Format.E4M3
  nv = make_recipe("nvfp4")
  assert type(nv) is recipe.NVFP4BlockScaling and nv.fp4_format == recipe.Format.E2M1
  assert nv.disable_stochastic_rounding  # no sr_rng stream in the train step yet (see make_recipe)


@pytest.mark.te
def test_cpu_supports_the_unquantized_precisions_only():
  assert "bf16" in ANYWHERE and supported_precisions() == ANYWHERE
  with pytest.raises(PrecisionError) as e:
    check_precision("mxfp8", "te")
  assert "\n" not in str(e.value) and str(e.value).endswith("supported here: " + ", ".join(ANYWHERE))


@pytest.mark.te
def test_asking_again_gives_the_same_answer():
  # TE's probe caches a scaling mode as supported before its check raises (no CUDA driver): asked blindly,
  # the 6th call on a CPU host claimed every recipe. Four recipes: 8 calls cover the poisoning.
  assert [supported_precisions() for _ in range(8)] == [ANYWHERE] * 8


@pytest.mark.te
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_hopper_refuses_blackwell_precisions(fake_fp8_gpu, name):
  assert supported_precisions() == HOPPER
  with pytest.raises(PrecisionError) as e:
    check_precision(name, "te")
  msg = str(e.value)
  assert "\n" not in msg and f"model.precision={name}" in msg and "Blackwell" in msg
  assert msg.endswith("supported here: " + ", ".join(HOPPER))
  check_precision("fp8_current", "te")  # FP8 itself is fine on Hopper


@pytest.mark.te
def test_blackwell_accepts_them(fake_blackwell):
  assert supported_precisions() == BLACKWELL
  for name in BLACKWELL:
    check_precision(name, "te")


def test_flax_backend_refuses_quantized_precisions():
  for name in ("mxfp8", "nvfp4"):
    with pytest.raises(PrecisionError, match=f"model.precision={name} needs model.backend=te"):
      check_precision(name, "flax")


@pytest.mark.te
@pytest.mark.parametrize("name, recipe_class", [("mxfp8", "MXFP8BlockScaling"), ("nvfp4", "NVFP4BlockScaling")])
def test_train_step_traces_under_the_recipe(fake_blackwell, name, recipe_class):
  """The whole train step (forward, backward, AdamW) traces under the recipe with no code change.

  Abstract evaluation only: TE's CPU fallback has no block-scaled GEMM to run, a Blackwell GPU does.
  """
  from transformer_engine.jax.quantize import helper
  from maxlm.model import Transformer
  from maxlm.optim import make_optimizer
  from maxlm.step import make_train_step
  from maxlm.train_state import init_boxed
  from flax import linen as nn

  cfg = load_config([f"model.precision={name}", "model.backend=te", "data.type=synthetic"])
  model = Transformer(cfg.model)
  optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps)
  step = make_train_step(model, optimizer, schedule)
  b, t = 2, 64
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
  with precision_scope(name, "te"):
    assert type(helper.get_global_quantize_recipe()).__name__ == recipe_class
    state = jax.eval_shape(lambda r: nn.unbox(init_boxed(model, optimizer, r, b, t)), jax.random.PRNGKey(0))
    new_state, metrics = jax.eval_shape(step, state, batch)
  assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(lambda a: (a.shape, a.dtype), state)
  assert metrics["loss"].shape == () and metrics["loss"].dtype == jnp.float32


@pytest.mark.te
def test_train_command_refuses_mxfp8_on_cpu_in_one_line(tmp_path, capsys):
  from maxlm.cli.train import main
  code = main(["model.precision=nvfp4", "model.backend=te", f"output_dir={tmp_path}", "train.steps=1"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1
  assert err[0].startswith("maxlm: error: model.precision=nvfp4 is not supported") and "supported here: bf16" in err[0]
  assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.te
def test_real_gpu_gate_and_blackwell_steps():
  """On the GPU itself, with TE's real probe: Hopper refuses MXFP8/NVFP4; Blackwell runs a few steps of each."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  major = int(str(jax.devices()[0].compute_capability).split(".")[0])
  ok = supported_precisions()
  if major < 10:
    assert ok == HOPPER
    for name in ("mxfp8", "nvfp4"):
      with pytest.raises(PrecisionError, match="supported here: " + ", ".join(HOPPER)):
        check_precision(name, "te")
    return
  from maxlm.config import load_config as load
  from maxlm.trainer import Trainer
  assert set(BLACKWELL) <= set(ok)
  for name in ("mxfp8", "nvfp4"):
    cfg = load([f"model.precision={name}", "model.backend=te", "data.type=synthetic", "model.d_model=256",
                "model.ffn_dim=512", "model.head_dim=64", "data.seq_len=256", "data.global_batch_size=8"])
    trainer = Trainer(cfg)
    trainer.build()
    for _ in range(3):
      trainer.state, metrics = trainer.train_step(trainer.state, trainer.to_device(next(trainer.train_data)))
    assert bool(jnp.isfinite(metrics["loss"])), name
