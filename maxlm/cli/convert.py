"""Convert weights between Hugging Face (safetensors) and maxlm (Orbax), streaming tensor by tensor.

    maxlm convert hf-to-maxlm src=HF_DIR out=DIR [dtype=float32|bfloat16] [--unrolled]
    maxlm convert maxlm-to-hf src=RUN_OR_CHECKPOINT out=DIR [dtype=float32|bfloat16|float16] [max_shard_size=5GB]

hf-to-maxlm writes `<out>/params` (an Orbax parameter tree: `checkpoint.load_params=<out>` fine-tunes
from it), `<out>/model.yml` (the model keys: `config=<out>/model.yml`), `<out>/hf_source.json` (the HF
files' dtype), the source config.json and its tokenizer files; --unrolled stores layers_<i> subtrees
(model.scan_layers=false). maxlm-to-hf takes a run, checkpoints or step directory and writes safetensors
shards of at most max_shard_size (5GB, 500MB, 2GiB or bytes; an index when there are several),
config.json and the run's tokenizer. Both are lossless by default: hf-to-maxlm stores float32 (bf16 and
fp16 files convert exactly); maxlm-to-hf writes the checkpoint's parameter dtype (float32 for a float32
run), or for a tree made by hf-to-maxlm the HF source's dtype (its original bits); dtype= converts. Host
memory holds one layer of one parameter at a time (and, hf-to-maxlm, one HF tensor), never the model.
The output directory may be missing or empty; the files appear only when complete.

Exit codes: 0 done, 2 bad arguments, an unsupported config.json or a non-empty output directory, 3 a
missing/damaged checkpoint, safetensors file or tensor.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from maxlm.checkpoint import CheckpointError
from maxlm.cli.grammar import UsageError, command_main, parse_args
from maxlm.hf.convert import hf_to_maxlm, maxlm_to_hf, shard_size
from maxlm.checkpoint.paths import step_dir
from maxlm.hf.files import EXPORT_DTYPES, is_hf_dir
from maxlm.hf.safetensors_io import MAX_SHARD_BYTES

# subcommand -> (its key=value arguments, its --flags, the dtypes it writes)
SUBCOMMANDS = {
  "hf-to-maxlm": ({"src": str, "out": str, "dtype": str}, {"--unrolled"}, EXPORT_DTYPES[:2]),
  "maxlm-to-hf": ({"src": str, "out": str, "dtype": str, "max_shard_size": str}, set(), EXPORT_DTYPES),
}


_KINDS = {"hf": "a Hugging Face model", "maxlm": "a maxlm run or checkpoint"}


def _kind(src: Path) -> str | None:
  """'hf', 'maxlm' or None: what `src` holds, for the hint when the direction does not match it."""
  if is_hf_dir(src):
    return "hf"
  return "maxlm" if step_dir(src) is not None else None


def _check_direction(direction: str, src: Path, out: Path) -> None:
  want = {"hf-to-maxlm": "hf", "maxlm-to-hf": "maxlm"}[direction]
  kind = _kind(src)
  if kind is not None and kind != want:
    other = next(d for d in SUBCOMMANDS if d != direction)
    raise UsageError(f"convert {direction}: src={src} is {_KINDS[kind]}, not {_KINDS[want]}; the other "
                     f"direction: maxlm convert {other} src={src} out={out}")


def _arguments(argv: list[str]) -> tuple[str, dict, set[str]]:
  """(subcommand, its settings, its flags), or a UsageError naming the culprit."""
  if not argv or argv[0] not in SUBCOMMANDS:
    got = f"unknown subcommand {argv[0]!r}" if argv else "no subcommand given"
    src = next((w.split("=", 1)[1] for w in argv if w.startswith("src=")), "")
    kind = _kind(Path(src)) if src else None
    guess = {"hf": "hf-to-maxlm", "maxlm": "maxlm-to-hf"}.get(kind)
    hint = f"; src is {_KINDS[kind]}: maxlm convert {guess} {' '.join(argv)}" if guess and "=" in argv[0] else ""
    raise UsageError(f"convert: {got} (subcommands: {', '.join(SUBCOMMANDS)}; see maxlm convert --help){hint}")
  direction, rest = argv[0], argv[1:]
  keys, known_flags, dtypes = SUBCOMMANDS[direction]
  for word in rest:
    old = word[2:].replace("-", "_")  # `--dtype bfloat16`, `--max-shard-size 5GB`: the spelling before
    if word.startswith("--") and old in keys:
      raise UsageError(f"convert {direction}: {word} is now {old}=VALUE (see maxlm convert --help)")
    if "=" not in word and not word.startswith("--"):
      raise UsageError(f"convert: argument {word!r} is not key=value: name the directories src=... out=... "
                       f"(see maxlm convert --help)")
  own, overrides, flags = parse_args(rest, keys)
  if overrides:
    raise UsageError(f"convert: {overrides[0].split('=', 1)[0]} is a config key; convert takes none")
  if flags - known_flags:
    raise UsageError(f"convert {direction}: unknown option {sorted(flags - known_flags)[0]} "
                     f"(options: {', '.join(sorted(known_flags | {'--help'}))})")
  missing = [k for k in ("src", "out") if not own.get(k)]
  if missing:
    raise UsageError(f"convert {direction}: {missing[0]}=<directory> is required")
  if own.get("dtype", dtypes[0]) not in dtypes:
    raise UsageError(f"convert {direction}: dtype={own['dtype']!r} is not one of {', '.join(dtypes)}")
  return direction, own, flags


def run(argv: list[str]) -> int:
  t0 = time.perf_counter()
  direction, own, flags = _arguments(argv)
  src, out = Path(own["src"]), Path(own["out"])
  max_shard_bytes = shard_size(own.get("max_shard_size", str(MAX_SHARD_BYTES)))
  if not src.exists():
    raise CheckpointError(f"{src}: no such file or directory")
  _check_direction(direction, src, out)
  if direction == "hf-to-maxlm":
    what = hf_to_maxlm(src, out, own.get("dtype", "float32"), scan="--unrolled" not in flags)
  else:
    what = maxlm_to_hf(src, out, own.get("dtype"), max_shard_bytes)
  print(f"maxlm: wrote {out} ({what}; {time.perf_counter() - t0:.1f} s)", flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  return command_main(__doc__, run, argv)


if __name__ == "__main__":
  sys.exit(main())
