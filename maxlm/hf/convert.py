"""Weights between Hugging Face (safetensors) and maxlm (Orbax), streamed tensor by tensor: what `maxlm convert`
runs. Host memory holds one layer of one parameter at a time (and, hf-to-maxlm, one HF tensor), never the
model; the output directory gets its files only when they are complete (`atomic_dir`).

`hf_to_maxlm` writes `<out>/params` (an Orbax parameter tree), `<out>/model.yml` (the model keys),
`<out>/hf_source.json` (the HF files' dtype), the source config.json and its tokenizer files. `maxlm_to_hf`
writes safetensors shards, config.json and the run's tokenizer. Each returns a one-line summary of what it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import yaml

from maxlm.checkpoint import CheckpointError
from maxlm.checkpoint.paths import step_arrays
from maxlm.config import ConfigError
from maxlm.hf import config as hf_config
from maxlm.hf.files import (HF_SIDE_FILES, HF_SOURCE_FILE, atomic_dir, checkpoint_source_dtype, find_step_dir, is_hf_dir,
                            read_step_config, run_tokenizer_files, write_config_json)
from maxlm.hf.safetensors_io import SafetensorsReader
from maxlm.hf.transfer import export_hf, hf_to_orbax, orbax_reader, source_dtype
from maxlm.tables import human_bytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_size(text: str) -> int:
  """Bytes of '5GB', '500MB', '2GiB' or a byte count (`max_shard_size=`)."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
  if not m or float(m.group(1)) <= 0:
    raise ConfigError(f"max_shard_size: expected a size like 5GB, 500MB or 1000000, got {text!r}")
  return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def hf_to_maxlm(src: Path, out: Path, dtype: str, scan: bool = True) -> str:
  hf = hf_config.read_config_json(src)
  m = dataclasses.replace(hf_config.from_hf(hf, where=str(src / "config.json")), scan_layers=scan)
  if not is_hf_dir(src):
    raise CheckpointError(f"{src}: no *.safetensors files")
  side = [(src / n, n) for n in HF_SIDE_FILES + ("config.json",) if (src / n).is_file()]
  keys = {f: getattr(m, f) for f in hf_config.ARCH_FIELDS + ("scan_layers",)}  # every architecture key
  keys["moe"] = dataclasses.asdict(m.moe)  # (a subsection)
  # Fine-tunes of different converted models get their own run directories (runs/<out's name>-finetune), not
  # one shared by the config file's name, model.yml (nor <out> itself, were it converted into runs/).
  model_yml = {"run_name": f"{out.absolute().name}-finetune", "model": keys}
  data = {}
  if any(n in ("tokenizer.json", "tokenizer.model") for _, n in side):
    data["tokenizer"] = str(out.absolute())
  for key in ("bos", "eos"):
    v = hf.get(f"{key}_token_id")
    if isinstance(v, int) and 0 <= v < m.vocab_size:
      data[f"{key}_id"] = v
  if data:
    model_yml["data"] = data
  written = {}

  def write(tmp: Path) -> None:
    reader = SafetensorsReader(src)
    written["bytes"] = hf_to_orbax(reader, tmp / "params", m, dtype, scan=scan)
    source = {"source": str(src.absolute()), "dtype": source_dtype(reader, m)}
    (tmp / HF_SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    (tmp / "model.yml").write_text(f"# maxlm model keys of {src} (maxlm convert hf-to-maxlm)\n"
                                   + yaml.safe_dump(model_yml, sort_keys=False))
  atomic_dir(out, write, side)
  return (f"{m.n_layers} layers, {human_bytes(written['bytes'])} in {dtype}; fine-tune with: python -m maxlm.train "
          f"config={out / 'model.yml'} checkpoint.load_params={out} data.paths=...")


def maxlm_to_hf(src: Path, out: Path, dtype: str | None, max_shard_bytes: int) -> str:
  step_dir = find_step_dir(src)
  run = read_step_config(step_dir)
  m = run.model
  dtype = dtype or checkpoint_source_dtype(step_dir, run)
  arrays = step_arrays(step_dir)
  cfg = hf_config.to_hf(m, dtype, max_position=run.data.seq_len, bos_id=run.data.bos_id, eos_id=run.data.eos_id)
  written = {}

  def write(tmp: Path) -> None:
    written["bytes"] = export_hf(orbax_reader(step_dir / "params", m, arrays), m, tmp, dtype, max_shard_bytes)
    write_config_json(tmp, cfg)
  side = run_tokenizer_files(run.data)
  atomic_dir(out, write, side)
  tok = (f"; tokenizer {', '.join(name for _, name in side)} from {side[0][0].parent if len(side) > 1 else side[0][0]}"
         if side else "; no tokenizer file (synthetic tokens, or the run's tokenizer or data is not on this machine)")
  return f"{cfg['architectures'][0]} from {step_dir}, {human_bytes(written['bytes'])} in {dtype}{tok}"
