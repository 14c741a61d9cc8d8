"""A model's files on disk: which directory is a Hugging Face model (`is_hf_dir`), the checkpoint step of a run
(`find_step_dir`, `read_step_config`), the dtype an export keeps, the tokenizer files that travel with the
weights, and `atomic_dir`, which fills an output directory whole or not at all (`Model.save_pretrained` and
`maxlm convert` write through it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from maxlm.checkpoint import CheckpointError
from maxlm.checkpoint import paths as checkpoint_paths
from maxlm.config import Config, ConfigError, DataConfig
from maxlm.data import DataError
from maxlm.data.sources import train_shards_tokenizer
from maxlm.data.tokenizer import DEFAULT_TOKENIZER, tokenizer_path
from maxlm.hf.safetensors_io import INDEX

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
  inside = []  # an output directory (runs/) names the runs it holds
  if path.is_dir():
    inside = sorted(d.name for d in path.iterdir() if d.is_dir() and checkpoint_paths.step_dir(d) is not None)
  hint = (f"; it holds run(s) {', '.join(inside[:5])}{' ...' if len(inside) > 5 else ''}: name one, e.g. "
          f"checkpoint={path / inside[0]}") if inside else ""
  raise CheckpointError(f"{path}: no checkpoint (expected an HF directory with config.json and safetensors, "
                        f"a run directory with checkpoints/, a checkpoints directory or a step directory){hint}")


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


def hf_data_config(path: Path, hf: dict, vocab: int) -> DataConfig:
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
  """(source, HF file name) of the tokenizer a run trained with, found as generation finds it
  (maxlm/inference.py): data.tokenizer (a tokenizer.json, a SentencePiece or tiktoken file, which HF names
  tokenizer.model, or a directory's tokenizer files), else the one its prepared shards record, else the shipped
  SentencePiece model (raw text, or the embedded corpus, without data.tokenizer). None for synthetic tokens, or
  when that file is not here (shards prepared on another machine) or the data cannot be read."""
  if data.tokenizer:
    p = tokenizer_path(data.tokenizer)
  elif data.type == "synthetic":
    return []
  else:
    try:
      rec = train_shards_tokenizer(data)
    except DataError:  # the run's data is not readable here: its shards' record cannot be read either
      return []
    p = Path(rec["path"]) if rec else DEFAULT_TOKENIZER
  if p.is_dir():
    return [(p / n, n) for n in HF_SIDE_FILES if (p / n).is_file()]
  if not p.is_file():
    return []
  return [(p, "tokenizer.json" if p.read_bytes()[:4096].lstrip().startswith(b"{") else "tokenizer.model")]


def dir_entries(out_dir: Path) -> list[Path]:
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
  old = dir_entries(out_dir)
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
