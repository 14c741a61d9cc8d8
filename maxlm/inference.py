"""A model loaded for the inference commands (`maxlm generate`, `maxlm eval`): its run config, parameters,
tokenizer, the BOS it prepends and the ids that stop a generation, from a run, checkpoint or step directory or a
Hugging Face directory (through `maxlm.Model.from_pretrained`). The commands share this library module instead of
importing each other."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from maxlm.api import Model, find_step_dir, is_hf_dir, read_step_config
from maxlm.checkpoint import CheckpointError
from maxlm.cli import UsageError
from maxlm.config import Config, DataConfig, load_config
from maxlm.data import DataError, Tokenizer, load_tokenizer
from maxlm.data.sources import train_shards_tokenizer
from maxlm.data.tokenizer import special_ids


@dataclasses.dataclass
class Loaded:
  """A model ready for inference: its run config (model and data sections), parameters, tokenizer."""
  cfg: Config
  params: object
  tokenizer: Tokenizer | None
  bos_id: int | None  # prepended to prompts (None: nothing)
  stop_ids: list[int]  # EOS and the like
  max_length: int | None
  source: str  # "run" or "hf"
  step_dir: Path | None = None
  mesh: object = None  # the parameters' mesh


def _tokenizer(d: DataConfig, vocab_size: int, extra_eos=()) -> tuple[Tokenizer, int | None, list[int]]:
  """The run's tokenizer (data.tokenizer, else the one its shards record, else the shipped one), the BOS
  to prepend (data.add_bos) and the ids that end a generation (data.eos_id / the tokenizer's EOS)."""
  path = d.tokenizer
  if not path and d.type != "synthetic":
    rec = train_shards_tokenizer(d)
    path = str(rec["path"]) if rec else ""
  tok = load_tokenizer(path, d.tokenizer_type)
  if tok.vocab_size > vocab_size:
    raise DataError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than the model's "
                    f"model.vocab_size={vocab_size}")
  bos, _ = special_ids(tok, d.add_bos, False, d.bos_id, d.eos_id)
  eos = [d.eos_id if d.eos_id >= 0 else tok.eos_id, *extra_eos]
  return tok, bos, sorted({int(e) for e in eos if e is not None and 0 <= int(e) < vocab_size})


def _checkpoint_error(e: CheckpointError, checkpoint: str) -> CheckpointError:
  """The error, naming the `checkpoint=` argument once."""
  msg, path = str(e).replace("checkpoint.load_params=", "checkpoint="), str(Path(checkpoint))
  if msg.startswith(f"{path}: "):
    msg = msg[len(path) + 2:]
  return CheckpointError(msg if msg.startswith("checkpoint=") else f"checkpoint={checkpoint}: {msg}")


def load(checkpoint: str, overrides: list[str] | None = None) -> Loaded:
  """Load a run/checkpoint/step directory or a Hugging Face directory (`maxlm.Model.from_pretrained`) with
  its tokenizer, for inference. overrides: dotted config keys over the checkpoint's config; of the model
  only model.backend, model.dtype and model.param_dtype may change (`data.eval_paths=...` etc. freely)."""
  path = Path(checkpoint)
  if not checkpoint or not path.exists():
    raise CheckpointError(f"checkpoint={checkpoint}: no such file or directory")
  overrides = list(overrides or [])
  fixed = [o.split("=", 1)[0] for o in overrides if o.startswith("model.")
           and o.split("=", 1)[0] not in ("model.backend", "model.dtype", "model.param_dtype")]
  load_config(overrides)  # unknown keys and bad values stop here, before any weights are read
  if fixed:
    raise UsageError(f"{fixed[0]} is fixed by the checkpoint; of the model only model.backend, model.dtype "
                     f"and model.param_dtype may be overridden")
  try:
    step = None if is_hf_dir(path) else find_step_dir(path)
    want = load_config(overrides, base=read_step_config(step) if step else None).model
    model = Model.from_pretrained(path, backend=want.backend, dtype=want.dtype, param_dtype=want.param_dtype)
  except CheckpointError as e:
    raise _checkpoint_error(e, checkpoint) from None
  cfg = load_config(overrides, base=model.config)
  hf = model.hf_config or {}
  eos = hf.get("eos_token_id")
  tok, bos, stops = _tokenizer(cfg.data, cfg.model.vocab_size, eos if isinstance(eos, list) else [eos])
  max_length = hf.get("max_position_embeddings") if step is None else cfg.data.seq_len
  return Loaded(cfg, model.params, tok, bos, stops, max_length, "run" if step else "hf", step, model.mesh)
