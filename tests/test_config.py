"""Config: defaults <- YAML (`base:`) <- key=value; locked keys, typed and ranged values, one-line errors."""

import contextlib
import dataclasses
import io
import math
import re
import typing

import pytest

from maxlm.config import CHOICES, Config, ConfigError, dump_yaml, from_dict, help_text, load_config, to_dict, validate
from maxlm.config.files import CONFIG_DIR, load_yaml
from maxlm.model import count_params
from maxlm.train import main as train_main

SECTIONS = ("model", "data", "optim", "mesh", "train", "checkpoint")


def leaf_keys(cls=Config, prefix=""):
  """(dotted key, field, type) of every non-section field, found by introspection."""
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(hints[f.name]):
      out += leaf_keys(hints[f.name], prefix + f.name + ".")
    else:
      out.append((prefix + f.name, f, hints[f.name]))
  return out


NUMERIC = [(k, f, t) for k, f, t in leaf_keys() if t in (int, float)]


def expect_error(args, *fragments):
  with pytest.raises(ConfigError) as e:
    load_config(args)
  msg = str(e.value)
  assert "\n" not in msg and all(fr in msg for fr in fragments), msg
  return msg


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


def test_a_config_anywhere_may_build_on_a_shipped_one(tmp_path):
  """`base: llama8b.yml` in exp/my.yml: beside the file first, then the shipped configs."""
  (tmp_path / "exp").mkdir()
  (tmp_path / "exp" / "my.yml").write_text("base: llama8b.yml\ntrain.steps: 7\n")
  cfg = load_config([f"config={tmp_path / 'exp' / 'my.yml'}"])
  assert cfg.train.steps == 7 and cfg.model.n_layers == 32 and cfg.model.vocab_size == 128256
  (tmp_path / "exp" / "llama8b.yml").write_text("model.n_layers: 3\n")  # one beside it wins
  assert load_config([f"config={tmp_path / 'exp' / 'my.yml'}"]).model.n_layers == 3


@pytest.mark.parametrize("name,billions", [("llama8b", 8.03), ("llama70b", 70.55), ("llama3.2-1b", 1.24),
                                           ("llama3.2-3b", 3.21), ("llama2-7b", 6.74), ("mistral7b", 7.24),
                                           ("mixtral8x7b", 46.70)])
def test_model_configs_have_the_published_sizes(name, billions):
  cfg = load_config([f"config={name}.yml"])
  assert count_params(cfg.model)["total"] / 1e9 == pytest.approx(billions, abs=0.01)


# The published Hugging Face config.json of each shipped model (values copied from those files:
# meta-llama/Meta-Llama-3-8B, Llama-3.1-8B, Meta-Llama-3-70B, Llama-3.2-1B, Llama-3.2-3B, Llama-2-7b-hf,
# mistralai/Mistral-7B-v0.1, mistralai/Mixtral-8x7B-v0.1). Llama 2's config.json has no rope_theta: transformers' default 10000.0.
_L3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
_L32_ROPE = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "rope_theta": 500000.0,
             "rope_scaling": None,
             "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "sliding_window": None}
PUBLISHED = {
    "llama8b.yml": LLAMA3_8B,
    "llama3.1-8b.yml": {**LLAMA3_8B, "rope_scaling": _L3_ROPE},
    "llama70b.yml": {"vocab_size": 128256, "hidden_size": 8192, "num_hidden_layers": 80,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                     "rope_theta": 500000.0, "rope_scaling": None, "rms_norm_eps": 1e-05,
                     "tie_word_embeddings": False, "sliding_window": None},
    "llama3.2-1b.yml": {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
                        "rope_theta": 500000.0, "rope_scaling": _L32_ROPE, "rms_norm_eps": 1e-05,
                        "tie_word_embeddings": True, "sliding_window": None, "head_dim": 64},
    "llama3.2-3b.yml": {"vocab_size": 128256, "hidden_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
                        "rope_theta": 500000.0, "rope_scaling": _L32_ROPE, "rms_norm_eps": 1e-05,
                        "tie_word_embeddings": True, "sliding_window": None, "head_dim": 128},
    "llama2-7b.yml": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                      "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-05,
                      "tie_word_embeddings": False, "sliding_window": None},
    "mistral7b.yml": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                      "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-05,
                      "tie_word_embeddings": False, "sliding_window": 4096},
    "mixtral8x7b.yml": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                        "rope_theta": 1e6, "rope_scaling": None, "rms_norm_eps": 1e-05,
                        "tie_word_embeddings": False, "sliding_window": None},
}
MIXTRAL_EXPERTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}


def test_every_shipped_model_config_has_published_values():
  shipped = {p.name for p in CONFIG_DIR.glob("*.yml")} - {"tiny.yml", "default.yml", "tiny_moe.yml"}  # unpublished
  assert shipped == set(PUBLISHED), f"no published entry for {sorted(shipped - set(PUBLISHED))}"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_matches_published_config_json(name):
  hf, m = PUBLISHED[name], load_config([f"config={name}"]).model
  ours = {"vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
          "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
          "intermediate_size": m.ffn_dim, "rope_theta": m.rope_theta, "rms_norm_eps": m.norm_eps,
          "tie_word_embeddings": m.tie_embeddings, "sliding_window": m.sliding_window or None,
          "rope_scaling": None if m.rope_scaling == "none" else {
              "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
              "high_freq_factor": m.rope_high_freq_factor,
              "original_max_position_embeddings": m.rope_original_max_position}}
  assert ours == {k: v for k, v in hf.items() if k != "head_dim"}
  assert m.head_dim == hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])


def test_mixtral_config_has_the_published_experts_and_counts():
  """Mixtral 8x7B's experts (its config.json) and its published totals: 46,702,792,704 parameters, of which a
  token uses 12.9B (the 6 experts of 8 it skips, 3 x 4096 x 14336 weights each, in 32 blocks, left out); MFU
  counts the GEMM weights of those (count_params "active": without the embedding table and the norms)."""
  m = load_config(["config=mixtral8x7b.yml"]).model
  assert {"num_local_experts": m.moe.experts, "num_experts_per_tok": m.moe.top_k,
          "router_aux_loss_coef": m.moe.aux_loss_coef} == MIXTRAL_EXPERTS and m.moe.every == 1
  counts = count_params(m)
  assert counts["total"] == 46_702_792_704
  skipped = 32 * 6 * 3 * 4096 * 14336
  assert counts["total"] - skipped == 12_879_925_248
  assert counts["active"] == counts["matmul"] - skipped and counts["matmul"] == counts["total"] - 32000 * 4096 - 65 * 4096


def test_every_shipped_config_loads():
  for path in CONFIG_DIR.glob("*.yml"):
    load_config([f"config={path}"])


@pytest.mark.parametrize("args,message", [
    (["model.n_layer=3"], "unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)"),
    (["trian.steps=3"], "unknown config key 'trian.steps' (did you mean 'train.steps'?)"),
    (["train.steps=abc"], "config key 'train.steps' expects int, got 'abc'"),
    (["train.steps=1.5"], "config key 'train.steps' expects int, got 1.5"),
    (["model.scan_layers=maybe"], "config key 'model.scan_layers' expects bool, got 'maybe'"),
    (["model.precision=fp4"],
     "config key 'model.precision' must be one of bf16, fp16, fp8_delayed, fp8_current, mxfp8, nvfp4; got 'fp4'"),
    (["model=3"], "config key 'model' is a section"),
    (["steps"], "argument 'steps' is not key=value; e.g. train.steps=100"),
    (["--config", "llama8b.yml"], "argument '--config' is not key=value; write config=llama8b.yml"),
    (["llama8b.yml"], "argument 'llama8b.yml' is not key=value; a config file is given as config=llama8b.yml"),
    (["--dryrun"], "argument '--dryrun' is not key=value; did you mean the option --dry-run?"),
    (["--device", "8"], "argument '--device' is not key=value; did you mean the option --devices?"),
    (["--steps", "5"], "argument '--steps' is not key=value; write train.steps=5"),
    (["--compile_only"], "argument '--compile_only' is not key=value; did you mean the option --compile-only?"),
    (["config=missing.yml"], "config file 'missing.yml' not found (looked in . and "),
    (["config=missing.yml"], "; shipped: default.yml, llama2-7b.yml, "),
    (["config=llama8"], "config file 'llama8' not found (looked in . and "),
    (["config=llama8"], "; did you mean config=llama8b.yml?"),
    (["model.n_heads=6", "model.n_kv_heads=4"],
     "model.n_heads (6) must be a multiple of model.n_kv_heads (4)"),
    (["data.global_batch_size=6", "train.grad_accum=4"], "must be divisible by train.grad_accum"),
    # Found by a fuzz: each used to end in a traceback (or a NaN run that exited 0).
    (["model.n_kv_heads=0"], "config key 'model.n_kv_heads' must be in [1, inf), got 0"),
    (["model.n_heads=0"], "config key 'model.n_heads' must be in [1, inf), got 0"),
    (["model.n_heads=-4"], "config key 'model.n_heads' must be in [1, inf), got -4"),
    (["model.n_kv_heads=-2"], "config key 'model.n_kv_heads' must be in [1, inf), got -2"),
    (["train.seed=1.0e+30"], "config key 'train.seed' must fit in a 64-bit integer"),
    (["train.seed=4294967296"], "config key 'train.seed' must be in [0, 2**32-1], got 4294967296"),
    (["data.seed=-1"], "config key 'data.seed' must be in [0, 2**31-1], got -1"),
    (["model.vocab_size=1099511627776"], "config key 'model.vocab_size' must be in [1, 2**31-1]"),
    (["data.seq_len=1099511627776"], "config key 'data.seq_len' must be in [1, 2**31-1]"),
    (["model.vocab_size=" + "9" * 5000], "'model.vocab_size' expects int"),  # Python reads <= 4300 digits
    (["optim.learning_rate=" + "9" * 400], "config key 'optim.learning_rate' must be a finite number"),
    (["optim.learning_rate=nan"], "config key 'optim.learning_rate' must be a finite number, got nan"),
    (["optim.learning_rate=-1e-3"], "config key 'optim.learning_rate' must be in [0, inf), got -0.001"),
    (["optim.b1=1.5"], "config key 'optim.b1' must be in [0, 1), got 1.5"),
    (["optim.b2=1"], "config key 'optim.b2' must be in [0, 1), got 1.0"),
    (["optim.eps=0"], "config key 'optim.eps' must be in (0, inf)"),
    (["optim.min_lr_ratio=1.5"], "config key 'optim.min_lr_ratio' must be in [0, 1]"),
    (["optim.wsd_decay_fraction=0"], "config key 'optim.wsd_decay_fraction' must be in (0, 1]"),
    (["optim.warmup_steps=-1"], "config key 'optim.warmup_steps' must be in [0, inf), got -1"),
    (["train.eval_every=-1"], "config key 'train.eval_every' must be in [0, inf), got -1"),
    (["train.eval_steps=-1"], "config key 'train.eval_steps' must be in [0, inf), got -1"),
    (["data.num_epochs=-1"], "config key 'data.num_epochs' must be in [0, inf), got -1"),
    (["model.sliding_window=-1"], "config key 'model.sliding_window' must be in [0, inf), got -1"),
    (["model.rope_theta=0"], "config key 'model.rope_theta' must be in (1, inf), got 0.0"),
    (["model.rope_factor=0"], "config key 'model.rope_factor' must be in (0, inf)"),
    (["model.rope_low_freq_factor=4"], "model.rope_low_freq_factor (4.0) must be below "
                                       "model.rope_high_freq_factor (4.0)"),
    (["model.head_dim=33"], "config key 'model.head_dim' must be even"),
    (["model.norm_eps=0"], "config key 'model.norm_eps' must be in (0, inf)"),
    (["model.init_std=-0.02"], "config key 'model.init_std' must be in (0, inf)"),
    (["model.fp8_amax_history_len=0"], "config key 'model.fp8_amax_history_len' must be in [1, inf)"),
    (["data.eval_fraction=0.6"], "config key 'data.eval_fraction' must be in [0, 0.5], got 0.6"),
    (["data.max_segments_per_row=0"], "config key 'data.max_segments_per_row' must be in [1, inf)"),
    (["data.packing_bins=0"], "config key 'data.packing_bins' must be in [1, inf)"),
    (["data.read_threads=-1"], "config key 'data.read_threads' must be in [0, inf)"),
    (["data.worker_count=-1"], "config key 'data.worker_count' must be in [0, inf)"),
    (["data.prefetch=-1"], "config key 'data.prefetch' must be in [0, inf)"),
    (["data.bos_id=-2"], "config key 'data.bos_id' must be in [-1, 2**31-1], got -2"),
    (["data.eos_id=8192"], "config key 'data.eos_id' (8192) must be below model.vocab_size (8192)"),
    (["mesh.fsdp=0"], "config key 'mesh.fsdp' must be in [1, inf) or -1, got 0"),
    (["mesh.dcn_data=-2"], "config key 'mesh.dcn_data' must be in [1, inf) or -1, got -2"),
    (["checkpoint.keep=-1"], "config key 'checkpoint.keep' must be in [0, inf), got -1"),
    (["data.type=csv"], "config key 'data.type' must be one of auto, embedded, synthetic, text, jsonl, parquet, "
                        "arrayrecord, mixture; got 'csv'"),
    (["data.tokenizer_type=bpe"], "config key 'data.tokenizer_type' must be one of auto, sentencepiece, hf, "
                                  "tiktoken; got 'bpe'"),
    (["data.text_split=word"],
     "config key 'data.text_split' must be one of line, paragraph, file; got 'word'"),
    (["config="], "argument 'config=' needs a file name"),
    (["config=tiny", "config=llama8b"], "argument 'config=' given twice"),
    (["config=" + "x" * 5000], "not found"),  # the file system refuses the name: no OSError traceback
    (["train.deterministic=maybe"], "config key 'train.deterministic' expects bool"),
])
def test_bad_input_gives_one_line_error(args, message):
  expect_error(args, message)


@pytest.mark.parametrize("args", [
    ["optim.b1=0", "optim.b2=0.999999"], ["optim.min_lr_ratio=0"], ["optim.min_lr_ratio=1"],
    ["optim.wsd_decay_fraction=1"], ["data.eval_fraction=0"], ["data.eval_fraction=0.5"],
    ["mesh.data=-1", "mesh.fsdp=1"], ["data.bos_id=-1", "data.eos_id=8191"], ["train.seed=4294967295"],
    ["data.seed=2147483647"], ["model.vocab_size=2147483647"], ["data.read_threads=0", "data.prefetch=0"],
    ["optim.learning_rate=0"], ["model.head_dim=2"], ["train.deterministic=true"],
])
def test_boundary_values_are_accepted(args):
  load_config(args)


def _outside(within):
  """Values just outside an interval, computed from its bounds (each side that is finite)."""
  out = []
  if math.isfinite(within.lo):
    out.append(within.lo if within.lo_open else within.lo - 1)
  if math.isfinite(within.hi):
    out.append(within.hi if within.hi_open else within.hi + 1)
  return [v for v in out if v != within.extra]


def replaced(key, value):
  """Config() with one dotted key set directly, bypassing load_config's coercion."""
  def put(obj, parts):  # one level at a time: sections nest (model.moe.experts)
    if len(parts) == 1:
      return dataclasses.replace(obj, **{parts[0]: value})
    return dataclasses.replace(obj, **{parts[0]: put(getattr(obj, parts[0]), parts[1:])})
  return put(Config(), key.split("."))


@pytest.mark.parametrize("key,field,typ", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_every_numeric_key_has_a_range_that_is_enforced(key, field, typ):
  within = field.metadata.get("within")
  assert within is not None, f"{key} declares no allowed range (option(..., within=...))"
  outside = _outside(within)
  assert outside, f"{key}: range {within.text} has no finite bound"
  named = re.escape(f"'{key}'")
  for bad in outside:
    expect_error([f"{key}={bad!r}" if typ is float else f"{key}={int(bad)}"], f"'{key}'")
    with pytest.raises(ConfigError, match=named):  # the same pass guards configs built in code
      validate(replaced(key, typ(bad)))
  if typ is float:
    for text in ("nan", ".nan", "inf", "-inf", ".inf", "1e400"):
      expect_error([f"{key}={text}"], f"'{key}'", "finite")
    with pytest.raises(ConfigError, match=named):
      validate(replaced(key, math.nan))
  else:
    expect_error([f"{key}={2**63}"], f"'{key}'", "64-bit")
    expect_error([f"{key}={-2**63 - 1}"], f"'{key}'", "64-bit")


def test_nan_in_a_yaml_file_is_refused(tmp_path):
  p = tmp_path / "nan.yml"
  p.write_text("optim:\n  learning_rate: .nan\n")
  expect_error([f"config={p}"], f"config file '{p}'", "'optim.learning_rate' must be a finite number")


def test_fixed_value_keys_have_choices():
  assert CHOICES["data.type"] == ("auto", "embedded", "synthetic", "text", "jsonl", "parquet", "arrayrecord",
                                  "mixture")
  assert CHOICES["data.tokenizer_type"] == ("auto", "sentencepiece", "hf", "tiktoken")
  assert CHOICES["data.text_split"] == ("line", "paragraph", "file")
  for key, values in CHOICES.items():
    expect_error([f"{key}=not_a_choice"], f"config key '{key}' must be one of {', '.join(values)}")
    for v in values:
      assert load_config([f"{key}={v}"]) is not None


def test_command_line_strings_keep_their_exact_text():
  cfg = load_config(["run_name=0123", "data.paths=1.50", "data.field=true", "checkpoint.load_params=1e3"])
  got = (cfg.run_name, cfg.data.paths, cfg.data.field, cfg.checkpoint.load_params)
  assert got == ("0123", "1.50", "true", "1e3")  # as YAML scalars: 83 (octal), 1.5, True


def test_messages_stay_on_one_line(tmp_path):
  msg = expect_error(["model.a\nb=1"], "unknown config key")
  assert "\\n" in msg
  p = tmp_path / "two\nlines.yml"  # a file name is quoted as it is: ConfigError escapes the newline
  p.write_text("train:\n  stpes: 1\n")
  assert "two\\nlines.yml" in expect_error([f"config={p}"], "unknown config key 'train.stpes'")


def test_bad_yaml_file(tmp_path):
  p = tmp_path / "bad.yml"
  p.write_text("model:\n  d_model: [1,\n")
  expect_error([f"config={p}"], "is not valid YAML", "(line 3, column 1)")
  p.write_text("model:\n  d_modle: 3\n")
  expect_error([f"config={p}"], f"config file '{p}'", "did you mean 'model.d_model'")
  p.write_text("train:\n  steps: 5\n  steps: 6\n")
  expect_error([f"config={p}"], "key 'steps' appears twice (line 3")
  p.write_bytes(b"model:\n  name: caf\xe9\n")  # Latin-1, not UTF-8
  expect_error([f"config={p}"], f"config file '{p}' is not UTF-8 text: byte 0xe9 on line 2")
  p.write_text("train:\n  seed: " + "9" * 5000 + "\n")
  expect_error([f"config={p}"], "holds a number too long to read")
  p.write_text("- 1\n- 2\n")
  expect_error([f"config={p}"], "must hold a mapping of keys")
  p.write_text("model: &x\n  d_model: 64\n  sub: *x\n")  # used to recurse without end
  expect_error([f"config={p}"], "the value of 'model.sub' contains itself")


@pytest.mark.parametrize("files,start,message", [
    ({"a.yml": "base: a.yml\n"}, "a.yml", "a.yml -> {d}/a.yml"),
    ({"a.yml": "base: b.yml\n", "b.yml": "base: a.yml\n"}, "a.yml", "a.yml -> {d}/b.yml -> {d}/a.yml"),
    ({"a.yml": "base: [b.yml]\n"}, "a.yml", "'base' must name one YAML file, got ['b.yml']"),
    ({"a.yml": "base: 3\n"}, "a.yml", "'base' must name one YAML file, got 3"),
    ({"a.yml": "base:\n"}, "a.yml", "'base' must name one YAML file, got None"),
    ({"a.yml": "base: nothere.yml\n"}, "a.yml", "base file 'nothere.yml' not found (looked in "),
])
def test_bad_base_includes(tmp_path, files, start, message):
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  expect_error([f"config={tmp_path / start}"], message.format(d=tmp_path))


def test_dotted_keys_in_yaml(tmp_path):
  p = tmp_path / "dotted.yml"
  p.write_text(f"base: {CONFIG_DIR / 'llama8b.yml'}\ntrain.steps: 5\ntrain:\n  log_every: 2\n"
               "model.d_model: 64\nmodel:\n  n_layers: 3\n")  # nested and dotted forms of two sections
  cfg = load_config([f"config={p}"])
  assert (cfg.train.steps, cfg.train.log_every, cfg.model.d_model, cfg.model.n_layers) == (5, 2, 64, 3)
  assert cfg.model.vocab_size == 128256  # the base still applies
  assert load_yaml(p)["train"] == {"steps": 5, "log_every": 2}
  p.write_text("train.steps: 5\ntrain:\n  steps: 6\n")
  expect_error([f"config={p}"], "sets config key 'train.steps' twice")
  p.write_text("train.stpes: 5\n")
  expect_error([f"config={p}"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/abs", "a\\b", "../up", "x\ty"])
def test_run_name_must_be_one_plain_component(name):
  expect_error([f"run_name={name}"], "config key 'run_name'", repr(name))


def test_run_name_symlinked_outside_output_dir(tmp_path):
  out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
  out.mkdir()
  elsewhere.mkdir()
  (out / "link").symlink_to(elsewhere)
  expect_error([f"output_dir={out}", "run_name=link"], "'run_name' 'link' resolves to", "outside output_dir")
  assert load_config([f"output_dir={out}", "run_name=fine"]).run_dir == out / "fine"


def test_empty_yaml_section_is_allowed(tmp_path):
  p = tmp_path / "empty.yml"
  p.write_text("model:\n  # d_model: 64\ntrain:\n  steps: 3\n")
  assert load_config([f"config={p}"]).train.steps == 3


def test_help_lists_every_key_with_type_default_and_help():
  text = help_text()
  for key, f, typ in leaf_keys():
    assert f.metadata.get("help"), f"{key} has no help"
    assert f"  {key}: {typ.__name__} = {f.default!r}" in text, key
    assert f.metadata["help"] in text
  for section in SECTIONS:
    part = help_text(section)
    keys = {k for k, _, _ in leaf_keys() if k.startswith(section + ".")}
    assert all(f"  {k}: " in part for k in keys)
    assert not any(f"  {k}: " in part for k, _, _ in leaf_keys() if k not in keys)
  assert "maxlm_data.json" in help_text("data")  # the arrayrecord meaning of data.tokenizer=""
  assert "bit for bit" in help_text("train") and Config().train.deterministic is False


def test_help_unknown_section():
  with pytest.raises(ConfigError, match="unknown config section 'modle'; sections: " + ", ".join(SECTIONS)):
    help_text("modle")


def test_config_is_frozen_and_round_trips(tmp_path):
  cfg = load_config(["config=llama3.2-1b.yml"])
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.model.d_model = 3
  p = tmp_path / "c.yml"
  p.write_text(dump_yaml(cfg))
  again = load_config([f"config={p}"])
  # a file of one's own that writes every key writes the lever keys too: the planner keeps them all as written
  assert again.plan.levers == "none" and dataclasses.replace(again, plan=cfg.plan) == cfg
  assert load_yaml(p)["model"]["rope_scaling"] == "llama3"


def test_help_is_generated_from_the_dataclasses():
  """--help cannot drift: a section and key that exist only here appear in the text, and every section
  of Config (profile and distributed too) is listed by `python -m maxlm.train --help`."""
  from maxlm.cli.train import main
  from maxlm.config import schema as config_schema

  @dataclasses.dataclass(frozen=True)
  class Extra:
    """A made-up section."""
    knob: int = config_schema.option(7, "turns things", within="[0, 9]")

  @dataclasses.dataclass(frozen=True)
  class Root:
    extra: Extra = Extra()

  text = config_schema.help_text(Root)
  assert "extra: A made-up section." in text and "  extra.knob: int = 7, in [0, 9]\n      turns things" in text
  hints = typing.get_type_hints(Config)
  sections = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])]
  assert {"profile", "distributed"} <= set(sections)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert main(["--help"]) == 0
  for key, _, _ in leaf_keys():
    assert f"  {key}: " in out.getvalue(), key


def test_run_name_defaults_to_the_config_file_name(tmp_path):
  """Runs of different configs never share a run directory by default."""
  assert load_config([]).run_name == "default"
  assert load_config(["config=llama8b.yml"]).run_name == "llama8b"
  assert load_config(["config=llama3.2-1b.yml"]).run_name == "llama3.2-1b"
  assert load_config(["config=llama8b.yml", "run_name=mine"]).run_name == "mine"
  named = tmp_path / "named.yml"
  named.write_text("run_name: kept\n")
  child = tmp_path / "child.yaml"
  child.write_text("base: named.yml\ntrain.steps: 3\n")
  assert load_config([f"config={named}"]).run_name == "kept"
  assert load_config([f"config={child}"]).run_name == "kept"  # set by its base file
  (tmp_path / "plain.yaml").write_text("train.steps: 3\n")
  assert load_config([f"config={tmp_path / 'plain.yaml'}"]).run_name == "plain"


def test_the_replaced_state_dtype_names_the_two_moment_keys(tmp_path, capsys):
  """optim.state_dtype (one dtype for both Adam moments) became optim.mu_dtype and optim.nu_dtype: the old key,
  on the command line or in a file, is one line naming the new ones (exit 2 from the trainer, nothing
  written); MaxText's mu_dtype points at optim.mu_dtype."""
  want = ("config key 'optim.state_dtype' was replaced: the two Adam moments have their own keys, optim.mu_dtype "
          "and optim.nu_dtype (state_dtype=bfloat16 was optim.mu_dtype=bfloat16 optim.nu_dtype=bfloat16)")
  assert expect_error(["optim.state_dtype=bfloat16"]) == want
  f = tmp_path / "old.yml"
  f.write_text("optim:\n  state_dtype: bfloat16\n")
  assert expect_error([f"config={f}"]) == f"config file '{f}': {want}"
  assert expect_error(["mu_dtype=bfloat16"]).endswith("(did you mean 'optim.mu_dtype'?)")
  out = tmp_path / "runs"
  assert train_main([f"output_dir={out}", "optim.state_dtype=float32"]) == 2
  err = capsys.readouterr().err
  assert err == f"maxlm: error: {want}\n" and not out.exists()


def test_an_older_runs_resolved_config_reads_state_dtype_as_both_moments():
  """A run's config.yml or a checkpoint's config item written before the split holds optim.state_dtype:
  from_dict reads it as the same dtype for both moments, rounded to nearest as those runs were."""
  old = to_dict(load_config([]))
  old["optim"] = {k: v for k, v in old["optim"].items() if k not in ("mu_dtype", "nu_dtype", "moment_rounding")}
  old["optim"]["state_dtype"] = "bfloat16"
  o = from_dict(old).optim
  assert (o.mu_dtype, o.nu_dtype, o.moment_rounding) == ("bfloat16", "bfloat16", "nearest")
  assert from_dict(to_dict(load_config(["optim.mu_dtype=bfloat16"]))).optim.moment_rounding == "stochastic"
