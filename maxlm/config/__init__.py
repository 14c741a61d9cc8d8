"""Typed, locked run configuration: dataclass defaults <- YAML file <- `key=value` overrides.

Every section is a frozen dataclass; a component receives only its own section. Each key declares
its help and its allowed range or choices next to its definition (`option`, see
`maxlm/config/schema.py`); one validation pass checks them all. Unknown keys, wrongly typed or
out-of-range values and unreadable files raise `ConfigError` with a one-line message naming the
key (and the closest valid key) or the file; `maxlm.train` turns that into exit code 2 before
anything is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from maxlm.config import names as config_names
from maxlm.config import schema
from maxlm.config.files import free_levers, is_shipped, leaf_keys, parse_overrides, resolve_config_path, yaml_layers
from maxlm.config.rules import check_distributed, check_moe, check_run_name
from maxlm.config.schema import ConfigError, option
from maxlm.tables import PRECISIONS, REMATS
from maxlm.config.sections import (  # the process and tool sections, re-exported
    LEVERS, CompileConfig, DistributedConfig, MoEConfig, PlanConfig, ProfileConfig, XlaConfig)

SEED_RANGE = "[0, 2**32-1]"  # jax.random.PRNGKey and Grain take 32-bit seeds


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The decoder: shape, RoPE, precision, layer backend and rematerialization."""
  name: str = option("tiny", "a label for logs")
  vocab_size: int = option(8192, "vocabulary size (embedding rows, LM-head columns); token ids are int32",
                           within="[1, 2**31-1]")
  d_model: int = option(128, "hidden (residual stream) width", within="[1, inf)")
  n_layers: int = option(2, "decoder blocks", within="[1, inf)")
  n_heads: int = option(4, "query heads", within="[1, inf)")
  n_kv_heads: int = option(2, "key/value heads (grouped-query attention); must divide n_heads",
                           within="[1, inf)")
  head_dim: int = option(32, "width of one attention head; even (RoPE rotates pairs)", within="[2, inf)")
  ffn_dim: int = option(384, "SwiGLU MLP hidden width", within="[1, inf)")
  norm_eps: float = option(1e-5, "RMSNorm epsilon", within="(0, inf)")
  rope_theta: float = option(10000.0, "RoPE base: wavelengths grow geometrically from 2*pi to ~2*pi*theta",
                             within="(1, inf)")
  rope_scaling: str = option("none", "RoPE frequency scaling: none, or llama3 (Llama 3.1 long context)",
                             choices=("none", "llama3"))
  rope_factor: float = option(8.0, "llama3 scaling: low frequencies are divided by this", within="(0, inf)")
  rope_low_freq_factor: float = option(1.0, "llama3 scaling: wavelengths above original/low are fully "
                                       "scaled; < rope_high_freq_factor", within="(0, inf)")
  rope_high_freq_factor: float = option(4.0, "llama3 scaling: wavelengths below original/high are kept",
                                        within="(0, inf)")
  rope_original_max_position: int = option(8192, "llama3 scaling: context length before scaling",
                                           within="[1, inf)")
  sliding_window: int = option(0, "0 = full causal attention; W > 0 = Mistral-style window of W tokens",
                               within="[0, inf)")
  tie_embeddings: bool = option(False, "the LM head reuses the token embedding")
  param_dtype: str = option("float32", "master weights (also their gradients; Adam's moments: optim.mu_dtype, "
                            "optim.nu_dtype)", choices=("float32", "bfloat16"))
  dtype: str = option("bfloat16", "compute dtype (model.precision=fp16 computes in float16)",
                      choices=("float32", "bfloat16"))
  backend: str = option("auto", "layer backend; auto = Transformer Engine when installed, else flax",
                        choices=("auto", "te", "flax"))
  precision: str = option("bf16", "matmul precision; fp16 = float16 compute with dynamic loss scaling; FP8 "
                          "needs the te backend (from Hopper), mxfp8 and nvfp4 a Blackwell GPU",
                          choices=tuple(PRECISIONS))
  fp16_initial_scale: float = option(2.0 ** 16, "fp16: the first loss scale (a power of 2 keeps unscaling exact)",
                                     within="[1, 2**24]")
  fp16_growth_interval: int = option(2000, "fp16: double the loss scale after this many steps in a row without "
                                     "overflow", within="[1, inf)")
  fp16_min_scale: float = option(1.0, "fp16: the loss scale never halves below this", within="(0, 2**24]")
  fp8_amax_history_len: int = option(1024, "FP8 delayed scaling: amax history length", within="[1, inf)")
  fp8_lm_head: bool = option(False, "quantize the LM head too (off: it stays in `dtype`); with loss_chunk, "
                             "FP8 GEMMs at current power-of-2 scales (e4m3 forward, e5m2 gradient)")
  loss_chunk: int = option(0, "LM head + cross-entropy over chunks of this many positions, never holding the "
                           "[B, T, V] logits (0 = whole sequence at once)", within="[0, inf)")
  cast_params_once: bool = option(False, "cast the matmul weights to the compute dtype once per step, not at "
                                 "every use (bf16 and fp16 only; holds a compute-dtype copy for the step)")
  scan_layers: bool = option(True, "scan over layers (faster compiles); false: unrolled (faster steps)")
  remat: str = option("full", "rematerialization policy (what the backward pass keeps vs recomputes)",
                      choices=tuple(REMATS))
  init_std: float = option(0.02, "standard deviation of the normal weight initializer", within="(0, inf)")
  moe: MoEConfig = MoEConfig()

  @property
  def te_fp8_lm_head(self) -> bool:
    """The LM head is TE's quantized layer (fp8_lm_head without loss_chunk); chunked, maxlm.step quantizes
    it itself and keeps no FP8 state for it."""
    return self.fp8_lm_head and not self.loss_chunk


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training data, tokenizer and packing; also checked in maxlm.data (DataError). Lists are
  comma-separated strings (paths may be globs or directories)."""
  type: str = option("auto", "auto = the shipped Austen corpus (embedded) without data.paths, else the format "
                     "the file names give (several formats or data.weights: mixture); synthetic = random tokens",
                     choices=("auto", "embedded", "synthetic", "text", "jsonl", "parquet", "arrayrecord",
                              "mixture"))
  seq_len: int = option(128, "tokens per row; positions are int32", within="[1, 2**31-1]")
  global_batch_size: int = option(8, "rows per step over all devices", within="[1, inf)")
  seed: int = option(0, "shuffle seed; per-source seeds add up to 7919 per mixture entry, hence < 2**31",
                     within="[0, 2**31-1]")
  paths: str = option("", "training files; mixture: one source per entry, type from the extension")
  weights: str = option("", "mixture weights, one per path (\"\" = equal)")
  eval_paths: str = option("", "held-out files (text/JSONL/Parquet or a prepared shard directory; format "
                          "from the extension); \"\" = every round(1/eval_fraction)-th training document")
  eval_fraction: float = option(0.02, "0 = no eval split (and no eval unless eval_paths is set); ignored when "
                                "eval_paths is set",
                                within="[0, 0.5]")
  tokenizer: str = option("", "SentencePiece .model, tokenizer.json (or its directory) or tiktoken ranks; "
                          "\"\" = the tokenizer recorded in the shards' maxlm_data.json when every source "
                          "is prepared shards (arrayrecord), else the shipped Austen 8k SentencePiece; "
                          "a bare name of a file in maxlm/assets/ (austen_sp512.model) is that shipped file")
  tokenizer_type: str = option("auto", "auto = detected from the file's content",
                               choices=("auto", "sentencepiece", "hf", "tiktoken"))
  add_bos: bool = option(True, "prepend BOS to every document")
  add_eos: bool = option(True, "append EOS to every document")
  bos_id: int = option(-1, "-1 = the tokenizer's own BOS id", within="[-1, 2**31-1]")
  eos_id: int = option(-1, "-1 = the tokenizer's own EOS id", within="[-1, 2**31-1]")
  text_split: str = option("line", "text files: a document per line, per blank-line separated paragraph, "
                           "or per file", choices=("line", "paragraph", "file"))
  field: str = option("text", "JSONL field / Parquet column holding the document text")
  shuffle: bool = option(True, "shuffle documents (reshuffled every epoch)")
  num_epochs: int = option(0, "0 = repeat forever", within="[0, inf)")
  max_segments_per_row: int = option(64, "cap on documents (chunks) packed into one row", within="[1, inf)")
  packing_bins: int = option(64, "rows each batch row's stream packs together (first-fit); memory and the wait "
                             "for the first batch grow with it x rows per process x seq_len", within="[1, inf)")
  read_threads: int = option(2, "threads reading + tokenizing documents, per batch row (stream) of this "
                             "process", within="[0, inf)")
  worker_count: int = option(0, "Grain worker processes (0 = in this process); each takes whole batch rows, "
                             "so at most the rows of this process are used", within="[0, inf)")
  prefetch: int = option(2, "batches prepared ahead in a background thread (0 = none)", within="[0, inf)")
  skip_bad_records: bool = option(False, "count and report bad records instead of stopping")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW, learning-rate schedule and gradient clipping."""
  learning_rate: float = option(3e-3, "peak learning rate", within="[0, inf)")
  schedule: str = option("cosine", "after warmup: cosine decay, warmup-stable-decay, or constant",
                         choices=("cosine", "wsd", "constant"))
  warmup_steps: int = option(20, "linear warmup from 0 (0 = none)", within="[0, inf)")
  decay_steps: int = option(0, "end of the decay (0 = train.steps)", within="[0, inf)")
  min_lr_ratio: float = option(0.1, "final learning rate / peak", within="[0, 1]")
  wsd_decay_fraction: float = option(0.2, "WSD: fraction of decay_steps spent decaying at the end",
                                     within="(0, 1]")
  b1: float = option(0.9, "Adam first-moment decay", within="[0, 1)")
  b2: float = option(0.95, "Adam second-moment decay", within="[0, 1)")
  eps: float = option(1e-8, "Adam epsilon", within="(0, inf)")
  weight_decay: float = option(0.1, "decoupled weight decay", within="[0, inf)")
  decay_norms_and_embeddings: bool = option(False, "also decay norm scales and embeddings")
  clip_grad_norm: float = option(1.0, "clip the global gradient norm to this; 0 disables clipping",
                                 within="[0, inf)")
  mu_dtype: str = option("float32", "dtype AdamW's first moment is stored in (MaxText's mu_dtype); the update "
                         "is computed in float32 either way", choices=("float32", "bfloat16"))
  nu_dtype: str = option("float32", "dtype AdamW's second moment is stored in; the update is computed in "
                         "float32 either way", choices=("float32", "bfloat16"))
  moment_rounding: str = option("stochastic", "how new moments are rounded to a bfloat16 mu_dtype / nu_dtype: "
                                "stochastic (unbiased; random bits from the step and the parameter, so a resume "
                                "repeats them) or nearest (even); nearest stalls a moment whose decay (1 - b) is "
                                "below half a bfloat16 ulp (docs/configuration.md)",
                                choices=("stochastic", "nearest"))
  offload: str = option("none", "host: the optimizer state lives in pinned host memory; after the backward "
                        "pass the update streams it through the device a few parameters at a time (no moments "
                        "on the GPU during forward and backward; costs host-device transfers each step); "
                        "host_params: the float32 master parameters too (the step brings them to the device "
                        "and holds their compute-dtype copy for forward and backward, float32 under FP8; the "
                        "update streams them with their moments; the same numbers as none)",
                        choices=("none", "host", "host_params"))


_DEGREE = "[1, inf) or -1"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh degrees: intra-node (NVLink) pipeline/data/fsdp/expert/context/tensor and inter-node (InfiniBand)
  dcn_*;
  one degree of each kind may be -1 (filled from the device count)."""
  pipeline: int = option(1, "intra-node pipeline-parallel degree: stages of consecutive layers, fed "
                         "train.grad_accum micro-batches (usually 1: pipeline across nodes with dcn_pipeline)",
                         within=_DEGREE)
  data: int = option(1, "intra-node data-parallel degree", within=_DEGREE)
  fsdp: int = option(-1, "intra-node FSDP degree (parameters sharded on `embed`)", within=_DEGREE)
  expert: int = option(1, "intra-node expert-parallel degree: the experts of every MoE layer split over it "
                       "(model.moe.experts divisible by the total expert degree), tokens exchanged to them by "
                       "all-to-all; the batch is split over data x fsdp x expert", within=_DEGREE)
  context: int = option(1, "intra-node context-parallel degree: the sequence of every activation is split over "
                        "it and attention exchanges keys/values (long sequences; data.seq_len divisible by 2 x "
                        "the total context degree)", within=_DEGREE)
  tensor: int = option(1, "intra-node tensor-parallel degree (heads, MLP, vocabulary)", within=_DEGREE)
  dcn_pipeline: int = option(1, "inter-node pipeline-parallel degree (stages across nodes)", within=_DEGREE)
  dcn_data: int = option(-1, "inter-node data-parallel degree (-1: the process count over the other dcn "
                         "degrees, so a multi-process run needs no mesh keys)", within=_DEGREE)
  dcn_fsdp: int = option(1, "inter-node FSDP degree", within=_DEGREE)
  dcn_expert: int = option(1, "inter-node expert-parallel degree (the all-to-all crosses nodes)", within=_DEGREE)
  dcn_context: int = option(1, "inter-node context-parallel degree", within=_DEGREE)
  dcn_tensor: int = option(1, "inter-node tensor-parallel degree", within=_DEGREE)
  context_strategy: str = option("auto", "how attention exchanges keys/values over the context axis: all_gather "
                                 "(each device gathers the whole K/V), ring (K/V blocks passed around the ring, "
                                 "overlapped with compute), auto (ring for packed rows, a sliding window or "
                                 "32768+ tokens per device, else all_gather)",
                                 choices=("auto", "all_gather", "ring"))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop: steps, micro-batching, seed, logging, evaluation."""
  steps: int = option(600, "optimizer steps", within="[0, inf)")
  grad_accum: int = option(1, "micro-batches per step; divides data.global_batch_size", within="[1, inf)")
  pipeline_schedule: str = option("gpipe", "with pipeline stages: gpipe (each stage one block of L/S layers; "
                                  "bubble (S-1)/(M+S-1)) or circular (each stage pipeline_repeats chunks of "
                                  "layers, every micro-batch loops the stages that many times; bubble "
                                  "(S-1)/(V*M+S-1), n_layers divisible by S*V) or 1f1b (one forward, one "
                                  "backward per tick: GPipe's bubble, at most 2S-1 micro-batches' activations "
                                  "held per stage instead of M)", choices=("gpipe", "circular", "1f1b"))
  pipeline_repeats: int = option(2, "circular pipeline schedule: V, the layer chunks per stage (virtual stages "
                                 "per device); ignored by gpipe", within="[2, inf)")
  pipeline_gather: str = option("tick", "with pipeline stages and FSDP: gather a stage's weights at every tick "
                                "(tick: least memory) or once per step (step: a stage's L/S layers and their "
                                "gradient sum held whole for the step, fsdp-fold fewer gathers)",
                                choices=("tick", "step"))
  seed: int = option(0, "parameter-initialization / RNG seed", within=SEED_RANGE)
  log_every: int = option(50, "steps between progress lines and metrics rows", within="[1, inf)")
  eval_every: int = option(100, "0 = no eval (also none when the data has no eval split)", within="[0, inf)")
  eval_steps: int = option(0, "batches per evaluation; 0 = the whole eval split", within="[0, inf)")
  nonfinite: str = option("skip", "a NaN/Inf loss or gradient: skip the update and count it, or stop",
                          choices=("skip", "stop"))
  deterministic: bool = option(False, "make GPU runs repeat bit for bit: XLA deterministic ops and "
                               "Transformer Engine's deterministic kernels, set before the backend starts "
                               "(costs some speed); the compilation cache keeps every program, so a restart "
                               "runs the same binaries")
  watchdog: str = option("auto", "end a process whose run stops making progress, with exit 76, which "
                         "launch/slurm requeues (maxlm/runtime/watchdog.py); auto = for runs of several processes",
                         choices=("auto", "always", "never"))
  watchdog_factor: float = option(10.0, "watchdog: a phase may take this x its expected time, measured by the run "
                                  "(the median step time x the steps in flight; a save's, an eval batch's, a "
                                  "compile's; a disk probe's bandwidth)", within="[1, inf)")
  watchdog_floor_s: float = option(300.0, "watchdog: the least limit of a step phase, an eval batch or a planner "
                                   "compile once its time is measured (a compile's: from those before it)",
                                   within="(0, inf)")
  watchdog_first_step_s: float = option(1800.0, "watchdog: the least limit of the slow phases (restore, compile, "
                                        "checkpoint saves), of each phase of start-up (the planner's first compile, "
                                        "a wait for process 0, data and state) and of any phase whose time is not "
                                        "measured yet; the run's measurements raise it (maxlm/runtime/watchdog.py)",
                                        within="(0, inf)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints in <run_dir>/checkpoints (see maxlm/checkpoint/). When enabled, a run whose
  directory holds checkpoints resumes from the latest usable one."""
  every: int = option(0, "save every N steps (async); 0 = only at the end (also saved on SIGTERM/SIGINT)",
                      within="[0, inf)")
  enabled: bool = option(True, "write checkpoints (at least the last step's) and resume from them; false: the "
                         "run keeps no weights")
  keep: int = option(3, "keep the last K checkpoints (0 = all)", within="[0, inf)")
  keep_period: int = option(0, "also keep every checkpoint whose step is a multiple of M (0 = none)",
                            within="[0, inf)")
  async_save: bool = option(True, "false: training waits until each checkpoint is on disk")
  load_params: str = option("", "start from these parameters (a step dir, a checkpoints dir, an Orbax tree) "
                            "unless resuming")


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run."""
  output_dir: str = option("runs", "parent of the run directory")
  run_name: str = option("default", "the run directory <output_dir>/<run_name>: one plain name; with config=FILE "
                         "and no run_name the file's name (config=llama8b.yml: llama8b)")
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  distributed: DistributedConfig = DistributedConfig()
  profile: ProfileConfig = ProfileConfig()
  xla: XlaConfig = XlaConfig()
  plan: PlanConfig = PlanConfig()
  compile: CompileConfig = CompileConfig()

  @property
  def run_dir(self) -> Path:
    return Path(self.output_dir) / self.run_name


CHOICES: dict[str, tuple[str, ...]] = schema.choices_of(Config)


def help_text(section: str | None = None) -> str:
  """Every config key (or one section's) with type, default, range or choices, and help."""
  return schema.help_text(Config, section)


def _unknown(key: str) -> ConfigError:
  if key in config_names.REPLACED:
    return ConfigError(f"config key {schema.show(key)} was replaced: {config_names.REPLACED[key]}")
  hint = config_names.hint(key, [k for k, _, _ in schema.leaf_fields(Config)])
  return ConfigError(f"unknown config key {schema.show(key)}{hint}")


def _apply(obj, updates: dict[str, Any], prefix: str = ""):
  hints = schema.hints(type(obj))
  changes = {}
  for name, value in updates.items():
    key = prefix + str(name)
    if name not in hints:
      while isinstance(value, dict) and len(value) == 1:  # name the full dotted key the user typed
        sub, value = next(iter(value.items()))
        key += f".{sub}"
      raise _unknown(key)
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      if value is None:  # an empty section in YAML (`model:` with every key commented out)
        continue
      if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}' is a section; give its fields, e.g. {key}.<field>=...")
      changes[name] = _apply(getattr(obj, name), value, key + ".")
    else:
      changes[name] = schema.coerce(key, value, typ)
  return dataclasses.replace(obj, **changes)


def load_config(args: list[str] | None = None, base: Config | None = None) -> Config:
  """Build the Config from CLI words: `config=FILE` then dotted `key=value` overrides."""
  config_file, overrides = parse_overrides(list(args or []))
  cfg = base or Config()
  written = leaf_keys(overrides)  # the keys the user wrote: on the command line, and in their own files below
  if config_file is not None:
    layers = yaml_layers(resolve_config_path(config_file))
    if base is None and not any("run_name" in data for _, data in layers) and "run_name" not in overrides:
      # Runs of different configs never share a directory by default (maxlm/checkpoint/run_dir.py).
      cfg = dataclasses.replace(cfg, run_name=Path(config_file).name.removesuffix(".yml").removesuffix(".yaml"))
    for path, data in layers:
      try:
        cfg = _apply(cfg, data)
      except ConfigError as e:
        raise ConfigError(f"config file '{path}': {e}") from None
      if not is_shipped(path):  # a shipped config's values count as defaults
        written |= leaf_keys(data)
  cfg = _apply(cfg, overrides)
  if base is None and cfg.plan.levers == "auto" and written & set(LEVERS):  # auto, none written: every lever
    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, levers=free_levers(written)))
  validate(cfg)
  return cfg


def validate(cfg: Config) -> None:
  """Every key's declared range / choices, then the rules that relate several keys."""
  schema.check_fields(cfg)
  m, d, t = cfg.model, cfg.data, cfg.train
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
  if m.head_dim % 2:
    raise ConfigError(f"config key 'model.head_dim' must be even (RoPE rotates pairs), got {m.head_dim}")
  if m.rope_low_freq_factor >= m.rope_high_freq_factor:
    raise ConfigError(f"model.rope_low_freq_factor ({m.rope_low_freq_factor}) must be below "
                      f"model.rope_high_freq_factor ({m.rope_high_freq_factor})")
  if d.global_batch_size % t.grad_accum:
    raise ConfigError(f"data.global_batch_size ({d.global_batch_size}) must be divisible by "
                      f"train.grad_accum ({t.grad_accum})")
  for key, tok in (("data.bos_id", d.bos_id), ("data.eos_id", d.eos_id)):
    if tok >= m.vocab_size:
      raise ConfigError(f"config key '{key}' ({tok}) must be below model.vocab_size ({m.vocab_size})")
  check_moe(m, cfg.mesh)
  check_run_name(cfg.output_dir, cfg.run_name)
  check_distributed(cfg.distributed)
  p = cfg.profile
  if p.start_step and p.start_step + p.num_steps - 1 > t.steps:
    raise ConfigError(f"profile window steps {p.start_step}-{p.start_step + p.num_steps - 1} "
                      f"(profile.start_step={p.start_step}, profile.num_steps={p.num_steps}) ends after "
                      f"train.steps={t.steps}")


def from_dict(data: dict[str, Any]) -> Config:
  """A validated Config from a resolved config dict (a run's config.yml, a checkpoint's config item)."""
  cfg = _apply(Config(), config_names.upgrade(data))
  validate(cfg)
  return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
  return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
  return yaml.safe_dump(to_dict(cfg), sort_keys=False)
