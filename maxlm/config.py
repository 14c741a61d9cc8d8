"""Typed, locked run configuration: dataclass defaults <- YAML file <- `key=value` overrides.

Every section is a frozen dataclass; a component receives only its own section. Unknown keys
and wrongly typed values raise `ConfigError` with a one-line message naming the key (and the
closest valid key); `maxlm.train` turns that into exit code 2 before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
  """A bad configuration key, value or file; the message is one line."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str = "tiny"
  vocab_size: int = 8192
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  ffn_dim: int = 384
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  # Llama-3.1 frequency scaling ("none" or "llama3").
  rope_scaling: str = "none"
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  sliding_window: int = 0  # 0 = full causal attention; W > 0 = Mistral-style window of W tokens
  tie_embeddings: bool = False
  param_dtype: str = "float32"  # master weights
  dtype: str = "bfloat16"  # compute dtype
  backend: str = "auto"  # auto | te | flax
  precision: str = "bf16"  # bf16 | fp8_delayed | fp8_current
  fp8_amax_history_len: int = 1024
  fp8_lm_head: bool = False  # quantize the LM head too (off: it stays in `dtype`)
  scan_layers: bool = True
  remat: str = "full"  # none | full | save_dots | save_attn | save_qkv_attn
  init_std: float = 0.02


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # Checked in maxlm.data (DataError). Lists are comma-separated strings (paths may be globs/dirs).
  type: str = "embedded"  # embedded (Austen) | synthetic | text | jsonl | parquet | arrayrecord | mixture
  seq_len: int = 128
  global_batch_size: int = 8
  seed: int = 0
  paths: str = ""  # training files; mixture: one source per entry, type from the extension
  weights: str = ""  # mixture weights, one per path ("" = equal)
  eval_paths: str = ""  # held-out files; "" = every round(1/eval_fraction)-th training document
  eval_fraction: float = 0.02  # 0 = no eval split (and no eval unless eval_paths is set)
  tokenizer: str = ""  # .model / tokenizer.json / tiktoken ranks; "" = shipped Austen 8k SentencePiece
  tokenizer_type: str = "auto"  # auto | sentencepiece | hf | tiktoken
  add_bos: bool = True
  add_eos: bool = True
  bos_id: int = -1  # -1 = the tokenizer's own BOS/EOS id
  eos_id: int = -1
  text_split: str = "line"  # text files: line | paragraph (blank-line separated) | file
  field: str = "text"  # JSONL field / Parquet column holding the document text
  shuffle: bool = True
  num_epochs: int = 0  # 0 = repeat forever
  max_segments_per_row: int = 64  # cap on documents (chunks) packed into one row
  packing_bins: int = 64  # rows packed together (first-fit); >= the per-process batch
  read_threads: int = 2  # threads reading + tokenizing documents (per process)
  worker_count: int = 0  # Grain worker processes (0 = in this process)
  prefetch: int = 2  # batches prepared ahead in a background thread
  skip_bad_records: bool = False  # count and report bad records instead of stopping


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 3e-3
  schedule: str = "cosine"  # cosine | wsd | constant
  warmup_steps: int = 20
  decay_steps: int = 0  # 0 = train.steps
  min_lr_ratio: float = 0.1
  wsd_decay_fraction: float = 0.2  # WSD: fraction of decay_steps spent decaying at the end
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_norms_and_embeddings: bool = False
  clip_grad_norm: float = 1.0  # 0 disables clipping


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  # Intra-node (NVLink) degrees; one of all six may be -1 (filled from the device count).
  data: int = 1
  fsdp: int = -1
  tensor: int = 1
  # Inter-node (InfiniBand) degrees.
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 600
  grad_accum: int = 1
  seed: int = 0
  log_every: int = 50
  eval_every: int = 100  # 0 = no eval (also none when the data has no eval split)
  eval_steps: int = 0  # batches per evaluation; 0 = the whole eval split
  nonfinite: str = "skip"  # skip | stop


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  # Orbax checkpoints in <run_dir>/checkpoints (see maxlm/checkpoint.py). When enabled, a run whose
  # directory holds checkpoints resumes from the latest usable one.
  every: int = 0  # save every N steps (async); 0 = only at the end. Also saved at the end and on SIGTERM/SIGINT
  enabled: bool = False
  keep: int = 3  # keep the last K checkpoints (0 = all)
  keep_period: int = 0  # also keep every checkpoint whose step is a multiple of M (0 = none)
  async_save: bool = True  # false: training waits until each checkpoint is on disk
  load_params: str = ""  # start from these parameters (a step dir, a checkpoints dir, an Orbax tree) unless resuming

  def __post_init__(self):
    for key in ("every", "keep", "keep_period"):
      if getattr(self, key) < 0:
        raise ConfigError(f"config key 'checkpoint.{key}' must be >= 0, got {getattr(self, key)}")


@dataclasses.dataclass(frozen=True)
class Config:
  output_dir: str = "runs"
  run_name: str = "default"
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()

  @property
  def run_dir(self) -> Path:
    return Path(self.output_dir) / self.run_name


CHOICES = {
    "model.backend": ("auto", "te", "flax"),
    "model.precision": ("bf16", "fp8_delayed", "fp8_current"),
    "model.remat": ("none", "full", "save_dots", "save_attn", "save_qkv_attn"),
    "model.rope_scaling": ("none", "llama3"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.dtype": ("float32", "bfloat16"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "train.nonfinite": ("skip", "stop"),
}


def _keys(cls, prefix="") -> list[str]:
  out = []
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else _hints(cls)[f.name]):
      out += _keys(_hints(cls)[f.name], prefix + f.name + ".")
    else:
      out.append(prefix + f.name)
  return out


def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _unknown(key: str, cls) -> ConfigError:
  close = difflib.get_close_matches(key, _keys(Config), n=1, cutoff=0.5)
  hint = f" (did you mean '{close[0]}'?)" if close else ""
  return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value: Any, typ: Any) -> Any:
  if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
    typ = next(t for t in typing.get_args(typ) if t is not type(None))
  if typ is bool:
    if isinstance(value, bool):
      return value
  elif typ is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(value, float) and value.is_integer():
      return int(value)
  elif typ is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
      try:
        return float(value)
      except ValueError:
        pass
  elif typ is str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
  else:
    return value
  raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {value!r}")


def _apply(obj, updates: dict[str, Any], prefix: str = ""):
  hints = _hints(type(obj))
  changes = {}
  for name, value in updates.items():
    key = prefix + name
    if name not in hints:
      while isinstance(value, dict) and len(value) == 1:  # name the full dotted key the user typed
        sub, value = next(iter(value.items()))
        key += "." + sub
      raise _unknown(key, type(obj))
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}' is a section; give its fields, e.g. {key}.<field>=...")
      changes[name] = _apply(getattr(obj, name), value, key + ".")
    else:
      value = _coerce(key, value, typ)
      if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config key '{key}' must be one of {', '.join(CHOICES[key])}; got {value!r}")
      changes[name] = value
  return dataclasses.replace(obj, **changes)


def _nest(key: str, value: Any) -> dict[str, Any]:
  out: dict[str, Any] = value
  for part in reversed(key.split(".")):
    out = {part: out}
  return out


def _merge(a: dict, b: dict) -> dict:
  out = dict(a)
  for k, v in b.items():
    out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def resolve_config_path(name: str) -> Path:
  p = Path(name)
  for cand in (p, CONFIG_DIR / name, CONFIG_DIR / f"{name}.yml"):
    if cand.is_file():
      return cand
  raise ConfigError(f"config file '{name}' not found (looked in . and {CONFIG_DIR})")


def load_yaml(path: Path) -> dict[str, Any]:
  """Read a config YAML; `base: other.yml` includes another file first (relative to this one)."""
  try:
    data = yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
  base = data.pop("base", None)
  if base:
    data = _merge(load_yaml(resolve_config_path(str(path.parent / base))), data)
  return data


def parse_overrides(args: list[str]) -> tuple[str | None, dict[str, Any]]:
  """Split CLI words into the `config=` file and a nested dict of `key=value` overrides."""
  config_file, updates = None, {}
  for arg in args:
    if "=" not in arg:
      raise ConfigError(f"argument '{arg}' is not key=value (e.g. train.steps=100)")
    key, raw = arg.split("=", 1)
    key = key.strip().lstrip("-")
    if key == "config":
      config_file = raw
      continue
    try:
      value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
      value = raw
    if isinstance(value, (dict, list)):
      value = raw
    updates = _merge(updates, _nest(key, value))
  return config_file, updates


def load_config(args: list[str] | None = None, base: Config | None = None) -> Config:
  """Build the Config from CLI words: `config=FILE` then dotted `key=value` overrides."""
  config_file, overrides = parse_overrides(list(args or []))
  cfg = base or Config()
  if config_file:
    cfg = _apply(cfg, load_yaml(resolve_config_path(config_file)))
  cfg = _apply(cfg, overrides)
  validate(cfg)
  return cfg


def validate(cfg: Config) -> None:
  m, d, t = cfg.model, cfg.data, cfg.train
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
  for key, val in (("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model),
                   ("model.n_layers", m.n_layers), ("model.head_dim", m.head_dim),
                   ("model.ffn_dim", m.ffn_dim), ("data.seq_len", d.seq_len),
                   ("data.global_batch_size", d.global_batch_size), ("train.grad_accum", t.grad_accum),
                   ("train.log_every", t.log_every)):
    if val <= 0:
      raise ConfigError(f"config key '{key}' must be positive, got {val}")
  if t.steps < 0:
    raise ConfigError(f"config key 'train.steps' must be >= 0, got {t.steps}")
  if d.global_batch_size % t.grad_accum:
    raise ConfigError(f"data.global_batch_size ({d.global_batch_size}) must be divisible by "
                      f"train.grad_accum ({t.grad_accum})")
  if not cfg.run_name or "/" in cfg.run_name:
    raise ConfigError(f"config key 'run_name' must be a plain directory name, got {cfg.run_name!r}")


def to_dict(cfg: Config) -> dict[str, Any]:
  return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
  return yaml.safe_dump(to_dict(cfg), sort_keys=False)
