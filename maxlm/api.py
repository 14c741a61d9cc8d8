"""`maxlm.Model`: a trained (or imported) model in Python: logits, generation, Hugging Face export.

    from maxlm import Model
    model = Model.from_pretrained("runs/tiny")                 # a run, checkpoints or step directory
    model = Model.from_pretrained("Llama-3.2-1B", dtype="bfloat16")  # an HF directory (safetensors)
    logits = model.logits(tokens)                              # [B, T] int -> [B, T, V] float32
    new_ids = model.generate([[1, 15, 27]], max_new_tokens=20)  # KV-cache decoding (maxlm.generation)
    model.save_pretrained("out/hf")                            # HF safetensors (the source's dtype) + config.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.checkpoint import CheckpointError
from maxlm.checkpoint import load_params as load_orbax_params
from maxlm.checkpoint import paths as checkpoint_paths
from maxlm.config import Config, ConfigError, DataConfig, MeshConfig
from maxlm.data.tokenizer import DEFAULT_TOKENIZER, tokenizer_path
from maxlm.hf import config as hf_config
from maxlm.hf.safetensors_io import INDEX, MAX_SHARD_BYTES, SafetensorsReader
from maxlm.hf.transfer import device_reader, export_hf, load_hf_params, source_dtype
from maxlm.layers import resolve_backend
from maxlm.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.scope import model_scope
from maxlm.sharding import shardings_from_logical, strip_boxes

# Files of an HF directory that travel with the weights (tokenizer and generation defaults).
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "generation_config.json")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # safetensors dtypes an export writes when asked
# Written by `maxlm convert hf-to-maxlm` beside its tree: the HF source and its safetensors dtype, which
# an export of the tree writes back by default (so HF bf16 -> maxlm fp32 -> HF gives the original bits).
HF_SOURCE_FILE = "hf_source.json"
_TMP = ".maxlm-tmp"  # atomic_dir's hidden work directory inside an existing output directory


def is_hf_dir(path: Path) -> bool:
  return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or (path / INDEX).is_file())


def find_step_dir(path: Path) -> Path:
  """The checkpoint step directory of a run directory, checkpoints directory or step directory (the
  newest complete step). CheckpointError when there is none."""
  found = checkpoint_paths.step_dir(path)
  if found is not None:
    return found
  raise CheckpointError(f"{path}: no checkpoint (expected an HF directory with config.json and safetensors, "
                        f"a run directory with checkpoints/, a checkpoints directory or a step directory)")


read_step_config = checkpoint_paths.step_config  # the run config a step (or a converted tree) carries


def checkpoint_source_dtype(step_dir: Path, run: Config) -> str:
  """The dtype an HF export of a checkpoint keeps by default: the HF source's, recorded in HF_SOURCE_FILE
  by `maxlm convert hf-to-maxlm`, else the checkpoint's parameter dtype (a float32 run exports float32)."""
  f = step_dir / HF_SOURCE_FILE
  if not f.is_file():
    return run.model.param_dtype
  try:
    dtype = json.loads(f.read_text())["dtype"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{f}: unreadable ({e!r})") from None
  if dtype not in EXPORT_DTYPES:
    raise CheckpointError(f"{f}: unknown dtype {dtype!r} (expected one of {', '.join(EXPORT_DTYPES)})")
  return dtype


def _abstract_params(cfg: Config, mesh):
  """(ShapeDtypeStructs with shardings, shardings) of the params, without allocating them."""
  model = Transformer(cfg.model)
  with _scope(cfg, mesh):
    abstract = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32)), jax.random.PRNGKey(0))
    shardings = shardings_from_logical(abstract["params"], mesh)
  structs = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   strip_boxes(abstract["params"]), shardings)
  return structs, shardings


def _scope(cfg: Config, mesh):
  """Mesh + logical axis rules + TE's unquantized scope (maxlm/scope.py): entered for init and every trace."""
  return model_scope(cfg.model, resolve_backend(cfg.model.backend), mesh, quantized=False)


class Model:
  """A Llama/Mistral model: its full `config` (a maxlm Config), `params` (on `mesh`) and inference."""

  def __init__(self, config: Config, params, mesh, hf_config_dict: dict | None = None,
               side_files: Sequence[tuple[Path, str]] = (), source_dtype: str = "float32"):
    self.config, self.params, self.mesh = config, params, mesh
    self.source_dtype = source_dtype  # of the loaded weights' files: save_pretrained's default dtype
    self.hf_config = hf_config_dict  # the imported config.json (kept so save_pretrained round-trips it)
    self.side_files = list(side_files)  # (source, file name) of the tokenizer files save_pretrained copies
    self._model = Transformer(config.model)
    self._logits_fn = None

  @classmethod
  def from_pretrained(cls, path: str | Path, backend: str = "auto", dtype: str = "float32",
                      param_dtype: str = "float32", mesh=None) -> "Model":
    """Load an HF directory (config.json + safetensors, sharded or not) or a maxlm run / checkpoints /
    step directory. `dtype` is the compute dtype, `param_dtype` the weights' (float32 holds bf16 files
    exactly); `mesh` defaults to FSDP over every device. `.source_dtype` remembers the files' dtype (an
    HF directory's safetensors dtype, float32 if its tensors mix dtypes; a checkpoint's parameter dtype)
    for save_pretrained. Bad input raises ConfigError (config) or CheckpointError (weights) in one line."""
    path = Path(path)
    if not path.exists():
      raise CheckpointError(f"{path}: no such file or directory")
    over = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, precision="bf16", remat="none")
    mesh = mesh if mesh is not None else make_mesh(MeshConfig())
    if is_hf_dir(path):
      hf = hf_config.read_config_json(path)
      m = dataclasses.replace(hf_config.from_hf(hf, where=str(path / "config.json")), scan_layers=True, **over)
      data = _hf_data_config(path, hf, m.vocab_size)
      cfg = Config(model=m, data=data)
      _, shardings = _abstract_params(cfg, mesh)
      reader = SafetensorsReader(path)
      params = load_hf_params(reader, m, shardings)
      side = [(path / n, n) for n in HF_SIDE_FILES if (path / n).is_file()]
      return cls(cfg, params, mesh, hf_config_dict=hf, side_files=side, source_dtype=source_dtype(reader, m))
    step_dir = find_step_dir(path)
    run = read_step_config(step_dir)
    cfg = dataclasses.replace(run, model=dataclasses.replace(run.model, **over))
    structs, _ = _abstract_params(cfg, mesh)
    params = load_orbax_params(str(step_dir), structs)
    return cls(cfg, params, mesh, side_files=run_tokenizer_files(run.data),
               source_dtype=checkpoint_source_dtype(step_dir, run))

  def logits(self, tokens, segment_ids=None, positions=None) -> np.ndarray:
    """Logits [B, T, V] (float32, on the host) for int tokens [B, T]; packed rows take segment_ids
    (documents 1..k, 0 = padding) and positions (restarting at 0 per document)."""
    tokens = np.asarray(tokens, np.int32)  # [B, T]
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    if self._logits_fn is None:
      def fn(params, tokens, positions, segment_ids):
        return self._model.apply({"params": params}, tokens, positions, segment_ids).astype(jnp.float32)
      self._logits_fn = jax.jit(fn)
    pos = None if positions is None else np.asarray(positions, np.int32)  # [B, T]
    seg = None if segment_ids is None else np.asarray(segment_ids, np.int32)  # [B, T]
    # float32 compute means float32 matmuls: on GPUs XLA's default precision would use TF32 (10-bit mantissa).
    # This covers XLA's dots (the flax backend); TE's own GEMMs run float32 inputs in TF32 on a GPU anyway
    # (seen: 1.7e-3 from transformers' logits on the H200): exact float32 on a GPU needs backend="flax".
    precision = "highest" if self.config.model.dtype == "float32" else "default"
    with _scope(self.config, self.mesh), jax.default_matmul_precision(precision):
      out = self._logits_fn(self.params, tokens, pos, seg)  # [B, T, V]
    return np.asarray(jax.device_get(out))

  def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None):
    """Continue each prompt (token ids) by up to max_new_tokens with a KV cache (`maxlm.generation`);
    returns the new token ids per prompt."""
    from maxlm import generation  # noqa: PLC0415 - lazy: generation is only needed here
    out = generation.generate(self.config.model, self.params, [list(p) for p in prompts], max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              stop_tokens=stop_tokens, mesh=self.mesh)
    return out.tokens

  def save_pretrained(self, out_dir: str | Path, dtype: str | None = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False) -> Path:
    """Write the model in Hugging Face format to `out_dir`: safetensors shards of at most max_shard_bytes
    (with model.safetensors.index.json when there are several), config.json and the tokenizer files.
    `dtype` (float32, bfloat16, float16) defaults to `.source_dtype`, so loading and saving is bit for
    bit. `out_dir` may be missing or an empty directory; a non-empty one is refused unless `overwrite`,
    which replaces the model files and keeps the others (see atomic_dir). Nothing half-written is left."""
    dtype = dtype or self.source_dtype
    if dtype not in EXPORT_DTYPES:
      raise ConfigError(f"save_pretrained: dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out_dir)
    if not overwrite and _entries(out):
      raise ConfigError(f"output directory {out} already exists and is not empty (overwrite=True replaces "
                        f"its model files)")
    m = self.config.model
    cfg = hf_config.to_hf(m, dtype, base=self.hf_config, max_position=self.config.data.seq_len,
                          bos_id=self.config.data.bos_id, eos_id=self.config.data.eos_id)
    def write(tmp: Path) -> None:
      export_hf(device_reader(self.params, m), m, tmp, dtype, max_shard_bytes)
      write_config_json(tmp, cfg)
    return atomic_dir(out, write, self.side_files, overwrite=overwrite)


def _entries(out_dir: Path) -> list[Path]:
  """What an existing directory holds, besides atomic_dir's own leftover work directory; [] if missing."""
  return [p for p in out_dir.iterdir() if p.name != _TMP] if out_dir.is_dir() else []


def atomic_dir(out_dir: Path, write, side_files: Sequence[tuple[Path, str]] = (), overwrite: bool = False) -> Path:
  """Fill `out_dir` whole or not at all: `write(tmp)` and the side files (source, name) go to a hidden
  directory, removed on any error (no half-written output is left). A missing `out_dir` is that
  directory, a sibling renamed at the end (missing parents are made, and removed on an error). An
  existing empty directory gets the finished files moved in from a hidden directory inside it, and is
  left empty on an error. A non-empty one is refused (ConfigError) unless `overwrite`: then the new
  files replace those of the same name, stale HF weights (other *.safetensors, the index) are removed,
  and other files are kept; a failure while moving the finished files in can leave a mix."""
  if out_dir.exists() or out_dir.is_symlink():
    if not out_dir.is_dir():
      raise ConfigError(f"output directory {out_dir} exists and is not a directory")
    return _into_existing(out_dir, write, side_files, overwrite)
  missing = [p for p in out_dir.parents if not p.exists()]  # parents made here, removed again on an error
  if any(p.exists() and not p.is_dir() for p in out_dir.parents):
    raise ConfigError(f"output directory {out_dir}: a parent is not a directory")
  tmp = out_dir.parent / f".{out_dir.name}.tmp-maxlm"
  try:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _fill(tmp, write, side_files)
    tmp.rename(out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if missing:
      shutil.rmtree(missing[-1], ignore_errors=True)
    raise
  return out_dir


def _fill(tmp: Path, write, side_files: Sequence[tuple[Path, str]]) -> None:
  write(tmp)
  for src, name in side_files:
    shutil.copyfile(src, tmp / name)


def _remove(path: Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  else:
    path.unlink(missing_ok=True)


def _into_existing(out_dir: Path, write, side_files: Sequence[tuple[Path, str]], overwrite: bool) -> Path:
  """atomic_dir into an existing directory: written in `out_dir/.maxlm-tmp`, then moved up entry by entry."""
  old = _entries(out_dir)
  if old and not overwrite:
    raise ConfigError(f"output directory {out_dir} already exists and is not empty")
  tmp, moved = out_dir / _TMP, []
  try:
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed earlier attempt
    tmp.mkdir()
    _fill(tmp, write, side_files)
    new = sorted(p.name for p in tmp.iterdir())
    for name in new:
      os.replace(tmp / name, out_dir / name)
      moved.append(name)
    tmp.rmdir()
    for p in old:  # overwrite: weights of the previous model that the new one did not replace
      if p.name not in new and (p.suffix == ".safetensors" or p.name == INDEX):
        _remove(p)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if not old:  # the directory was empty: leave it so
      for name in moved:
        _remove(out_dir / name)
    raise
  return out_dir


def write_config_json(directory: Path, config_json: dict[str, Any]) -> None:
  (directory / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")


def _hf_data_config(path: Path, hf: dict, vocab: int) -> DataConfig:
  """Tokenizer and BOS/EOS of an HF directory as a DataConfig (what `maxlm generate` reads)."""
  tok = str(path) if any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model")) else ""
  ids = {}
  for key in ("bos", "eos"):
    v = hf.get(f"{key}_token_id")
    v = v[0] if isinstance(v, list) and v else v
    if isinstance(v, int) and 0 <= v < vocab:
      ids[f"{key}_id"] = v
  return DataConfig(tokenizer=tok, **ids)


def run_tokenizer_files(data: DataConfig) -> list[tuple[Path, str]]:
  """(source, HF file name) of a run's tokenizer: data.tokenizer (a tokenizer.json, a SentencePiece or
  tiktoken file, which HF names tokenizer.model, or a directory's tokenizer files), or the shipped
  SentencePiece model of the embedded corpus."""
  embedded = data.type == "embedded" or (data.type == "auto" and not data.paths)
  p = tokenizer_path(data.tokenizer) if data.tokenizer else DEFAULT_TOKENIZER if embedded else None
  if p is None:
    return []
  if p.is_dir():
    return [(p / n, n) for n in HF_SIDE_FILES if (p / n).is_file()]
  if not p.is_file():
    return []
  return [(p, "tokenizer.json" if p.read_bytes()[:4096].lstrip().startswith(b"{") else "tokenizer.model")]
