"""Config: defaults <- YAML (with `base:`) <- key=value; locked keys, typed values, one-line errors."""

import dataclasses

import pytest

from maxlm.config import CONFIG_DIR, Config, ConfigError, dump_yaml, load_config, load_yaml
from maxlm.model import count_params


def test_defaults_are_the_tiny_model():
  cfg = load_config([])
  assert cfg == Config() and cfg.model.name == "tiny"


def test_yaml_then_overrides():
  cfg = load_config(["config=llama8b.yml", "train.steps=7", "model.backend=flax", "output_dir=/tmp/r",
                     "optim.learning_rate=1e-4", "model.tie_embeddings=true"])
  assert cfg.model.d_model == 4096 and cfg.model.n_kv_heads == 8
  assert cfg.train.steps == 7 and cfg.model.backend == "flax" and cfg.output_dir == "/tmp/r"
  assert cfg.optim.learning_rate == 1e-4 and cfg.model.tie_embeddings is True


def test_base_include_and_override_order():
  cfg = load_config(["config=mistral7b.yml"])
  assert cfg.model.sliding_window == 4096 and cfg.model.vocab_size == 32000  # from llama2-7b.yml
  assert cfg.model.n_kv_heads == 8 and cfg.data.seq_len == 8192


@pytest.mark.parametrize("name,billions", [("llama8b", 8.03), ("llama70b", 70.55), ("llama3.2-1b", 1.24),
                                           ("llama3.2-3b", 3.21), ("llama2-7b", 6.74), ("mistral7b", 7.24)])
def test_model_configs_have_the_published_sizes(name, billions):
  cfg = load_config([f"config={name}.yml"])
  assert count_params(cfg.model)["total"] / 1e9 == pytest.approx(billions, abs=0.01)


def test_every_shipped_config_loads():
  for path in CONFIG_DIR.glob("*.yml"):
    load_config([f"config={path}"])


@pytest.mark.parametrize("args,message", [
    (["model.n_layer=3"], "unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)"),
    (["trian.steps=3"], "unknown config key 'trian.steps' (did you mean 'train.steps'?)"),
    (["train.steps=abc"], "config key 'train.steps' expects int, got 'abc'"),
    (["train.steps=1.5"], "config key 'train.steps' expects int, got 1.5"),
    (["model.scan_layers=maybe"], "config key 'model.scan_layers' expects bool, got 'maybe'"),
    (["model.precision=fp4"], "config key 'model.precision' must be one of bf16, fp8_delayed, fp8_current; got 'fp4'"),
    (["model=3"], "config key 'model' is a section"),
    (["steps"], "argument 'steps' is not key=value"),
    (["config=missing.yml"], "config file 'missing.yml' not found"),
    (["model.n_heads=6", "model.n_kv_heads=4"], "model.n_heads (6) must be a multiple of model.n_kv_heads (4)"),
    (["data.global_batch_size=6", "train.grad_accum=4"], "must be divisible by train.grad_accum"),
])
def test_bad_input_gives_one_line_error(args, message):
  with pytest.raises(ConfigError) as e:
    load_config(args)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_yaml_file(tmp_path):
  p = tmp_path / "bad.yml"
  p.write_text("model:\n  d_model: [1,\n")
  with pytest.raises(ConfigError, match="is not valid YAML"):
    load_config([f"config={p}"])
  p.write_text("model:\n  d_modle: 3\n")
  with pytest.raises(ConfigError, match="did you mean 'model.d_model'"):
    load_config([f"config={p}"])


def test_config_is_frozen_and_round_trips(tmp_path):
  cfg = load_config(["config=llama3.2-1b.yml"])
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.model.d_model = 3
  p = tmp_path / "c.yml"
  p.write_text(dump_yaml(cfg))
  assert load_config([f"config={p}"]) == cfg
  assert load_yaml(p)["model"]["rope_scaling"] == "llama3"
