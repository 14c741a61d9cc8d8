"""Convert weights between Hugging Face (safetensors) and maxlm (Orbax), streaming tensor by tensor.

    maxlm convert hf-to-maxlm <hf_dir> <out> [--dtype float32|bfloat16]
    maxlm convert maxlm-to-hf <run_or_checkpoint> <out_dir> [--dtype float32|bfloat16|float16]
                              [--max-shard-size 5GB]

hf-to-maxlm writes `<out>/params` (an Orbax parameter tree: `checkpoint.load_params=<out>` fine-tunes
from it), `<out>/model.yml` (the model keys: `config=<out>/model.yml`), `<out>/hf_source.json` (the HF
files' dtype), the source config.json and its tokenizer files. maxlm-to-hf takes a run, checkpoints or
step directory and writes safetensors shards of at most --max-shard-size (an index when there are
several), config.json and the run's tokenizer. Both are lossless by default: hf-to-maxlm stores float32
(bf16 and fp16 files convert exactly); maxlm-to-hf writes the checkpoint's parameter dtype (float32 for
a float32 run), or for a tree made by hf-to-maxlm the HF source's dtype (its original bits); --dtype
converts. Host memory holds one layer of one parameter at a time (and, hf-to-maxlm, one HF tensor),
never the model. The output directory may be missing or empty; the files appear only when complete.

Exit codes: 0 done, 2 bad arguments, an unsupported config.json or a non-empty output directory, 3 a
missing/damaged checkpoint, safetensors file or tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import yaml

from maxlm.api import (EXPORT_DTYPES, HF_SIDE_FILES, HF_SOURCE_FILE, atomic_dir, checkpoint_source_dtype, find_step_dir,
                       is_hf_dir, read_step_config, run_tokenizer_files, write_config_json)
from maxlm.checkpoint import CheckpointError
from maxlm.checkpoint.paths import step_arrays
from maxlm.config import ConfigError
from maxlm.errors import MaxlmError, report
from maxlm.hf import config as hf_config
from maxlm.hf.safetensors_io import MAX_SHARD_BYTES, SafetensorsReader
from maxlm.hf.transfer import export_hf, hf_to_orbax, orbax_reader, source_dtype
from maxlm.sizing import human_bytes

EXIT_BAD_INPUT = 2
EXIT_CHECKPOINT = 3
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, not argparse's usage block
    raise ConfigError(f"convert: {message} (see maxlm convert --help)")


def shard_size(text: str) -> int:
  """'5GB', '500MB', '2GiB' or a byte count."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
  if not m or float(m.group(1)) <= 0:
    raise ConfigError(f"--max-shard-size: expected a size like 5GB, 500MB or 1000000, got {text!r}")
  return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog="maxlm convert", description=__doc__.splitlines()[0],
              formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]))
  sub = p.add_subparsers(dest="direction", required=True, parser_class=_Parser)
  a = sub.add_parser("hf-to-maxlm", help="HF directory -> Orbax parameter tree")
  a.add_argument("src", help="HF model directory (config.json + *.safetensors)")
  a.add_argument("out", help="output directory (missing or empty)")
  a.add_argument("--dtype", default="float32", choices=EXPORT_DTYPES[:2],
                 help="stored dtype (default float32: maxlm's master weights; bf16 files convert exactly)")
  a.add_argument("--unrolled", action="store_true", help="layers_<i> subtrees (model.scan_layers=false)")
  b = sub.add_parser("maxlm-to-hf", help="maxlm run / checkpoint -> HF directory")
  b.add_argument("src", help="run directory, checkpoints directory or checkpoint step directory")
  b.add_argument("out", help="output directory (missing or empty)")
  b.add_argument("--dtype", default=None, choices=EXPORT_DTYPES,
                 help="safetensors dtype (default: the checkpoint's parameter dtype, or the HF source's for a "
                      "tree made by hf-to-maxlm: lossless)")
  b.add_argument("--max-shard-size", default=str(MAX_SHARD_BYTES), type=str,
                 help="largest safetensors file, e.g. 5GB (default), 500MB")
  return p


def hf_to_maxlm(src: Path, out: Path, dtype: str, scan: bool = True) -> str:
  hf = hf_config.read_config_json(src)
  m = dataclasses.replace(hf_config.from_hf(hf, where=str(src / "config.json")), scan_layers=scan)
  if not is_hf_dir(src):
    raise CheckpointError(f"{src}: no *.safetensors files")
  side = [(src / n, n) for n in HF_SIDE_FILES + ("config.json",) if (src / n).is_file()]
  keys = {f: getattr(m, f) for f in hf_config.ARCH_FIELDS + ("scan_layers",)}  # every architecture key
  model_yml = {"model": keys}
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
  atomic_dir(out, write, run_tokenizer_files(run.data))
  return f"{cfg['architectures'][0]} from {step_dir}, {human_bytes(written['bytes'])} in {dtype}"


def _fail(msg: str, code: int) -> int:
  print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)
  return code


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  t0 = time.perf_counter()
  try:
    try:
      args = _parser().parse_args(argv)
    except SystemExit as e:  # --help
      return int(e.code or 0)
    src, out = Path(args.src), Path(args.out)
    if not src.exists():
      raise CheckpointError(f"{src}: no such file or directory")
    if args.direction == "hf-to-maxlm":
      what = hf_to_maxlm(src, out, args.dtype, scan=not args.unrolled)
    else:
      what = maxlm_to_hf(src, out, args.dtype, shard_size(args.max_shard_size))
  except MaxlmError as e:
    return report(e)
  print(f"maxlm: wrote {out} ({what}; {time.perf_counter() - t0:.1f} s)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
