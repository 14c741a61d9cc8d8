"""Time and peak host memory of `maxlm convert` in both directions on a synthetic Llama-3-8B-shaped model.

    python benchmarks/convert_memory.py --workdir /tmp/convert_bench        # the full 8B shape (~64 GB disk)
    python benchmarks/convert_memory.py --workdir /tmp/cb --layers 2        # a quick look, 8B-wide

1. writes random bfloat16 safetensors with Llama 3 8B's shapes (128256 x 4096 embedding, 32 layers of
   GQA 32/8 heads and a 14336 MLP, untied head), 5 GB shards and an index, tensor by tensor;
2. `maxlm convert hf-to-maxlm` -> float32 Orbax tree (maxlm's master weights), then deletes the source;
3. `maxlm convert maxlm-to-hf` -> bfloat16 safetensors.
Each conversion runs in its own process; its peak RSS is that child's ru_maxrss (getrusage of the
children, read after it exits). Prints one JSON line per step and a summary with the ratio of each
peak to the model's size in the conversion's target dtype (the issue's bound: <= ~1.2).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from maxlm.config import ModelConfig
from maxlm.hf.config import to_hf
from maxlm.hf.safetensors_io import ShardedWriter
from maxlm.hf.weights import hf_tensor_list

LLAMA3_8B = dict(name="llama3-8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 head_dim=128, ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0, rope_scaling="llama3")


def make_hf(out: Path, m: ModelConfig, seed: int = 0) -> int:
  """Random finite bf16 tensors of `m`'s HF shapes (bits drawn directly: |x| in [2^-7, 2^-5), random
  sign), written as 5 GB shards one tensor at a time. Returns the bytes of tensor data."""
  out.mkdir(parents=True)
  rng = np.random.default_rng(seed)
  tensors = hf_tensor_list(m)
  bf16 = np.dtype(ml_dtypes.bfloat16)
  writer = ShardedWriter(out, tensors, bf16)
  for name, shape in tensors:
    n = int(np.prod(shape))
    b = rng.integers(0x3C00, 0x3D00, size=n, dtype=np.uint16) | (rng.integers(0, 2, size=n, dtype=np.uint16) << 15)
    writer.write(name, b.view(bf16).reshape(shape))
    del b
  writer.close()
  (out / "config.json").write_text(json.dumps(to_hf(m, "bfloat16", max_position=8192), indent=2))
  return writer.total


_CHILD = ("import resource, sys\n"
          "from maxlm.cli.convert import main\n"
          "rc = main(sys.argv[1:])\n"
          "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
          "sys.exit(rc)\n")


def run_child(argv: list[str]) -> dict:
  """Run `maxlm convert ...` in a fresh child process; its wall time and peak RSS (ru_maxrss, GiB)."""
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f"convert failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
  lines = proc.stdout.strip().splitlines()
  peak_kib = int(lines[-1].split()[1])
  return {"wall_s": round(wall, 1), "peak_rss_gib": round(peak_kib / 2**20, 2), "stdout": lines[0]}


def _du(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True, help="scratch directory (must not exist); removed at the end")
  ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = the real 8B shape)")
  ap.add_argument("--keep", action="store_true", help="keep the files")
  args = ap.parse_args()
  work = Path(args.workdir)
  work.mkdir(parents=True, exist_ok=False)
  m = ModelConfig(**{**LLAMA3_8B, "n_layers": args.layers})
  n_params = sum(int(np.prod(s)) for _, s in hf_tensor_list(m))
  try:
    t0 = time.perf_counter()
    data = make_hf(work / "hf", m)
    print(json.dumps({"step": "make synthetic HF", "params": n_params, "bf16_gib": round(data / 2**30, 2),
                      "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
    to_maxlm = run_child(["hf-to-maxlm", f"src={work / 'hf'}", f"out={work / 'maxlm'}", "dtype=float32"])
    to_maxlm.update(step="hf-to-maxlm (bf16 -> fp32 Orbax)", target_gib=round(4 * n_params / 2**30, 2),
                    orbax_on_disk_gib=round(_du(work / "maxlm") / 2**30, 2))
    print(json.dumps(to_maxlm), flush=True)
    shutil.rmtree(work / "hf")  # disk: the 8B source is no longer needed
    to_hf_ = run_child(["maxlm-to-hf", f"src={work / 'maxlm'}", f"out={work / 'hf_out'}", "dtype=bfloat16"])
    to_hf_.update(step="maxlm-to-hf (fp32 Orbax -> bf16)", target_gib=round(2 * n_params / 2**30, 2),
                  shards=len(list((work / "hf_out").glob("*.safetensors"))))
    print(json.dumps(to_hf_), flush=True)
    print(json.dumps({"summary": {
        "params": n_params,
        "hf_to_maxlm": {"wall_s": to_maxlm["wall_s"], "peak_rss_gib": to_maxlm["peak_rss_gib"],
                        "ratio_to_fp32_model": round(to_maxlm["peak_rss_gib"] / to_maxlm["target_gib"], 3)},
        "maxlm_to_hf": {"wall_s": to_hf_["wall_s"], "peak_rss_gib": to_hf_["peak_rss_gib"],
                        "ratio_to_bf16_model": round(to_hf_["peak_rss_gib"] / to_hf_["target_gib"], 3)}}}),
          flush=True)
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
