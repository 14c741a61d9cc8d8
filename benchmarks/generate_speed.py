"""Decode speed of `maxlm.generation` on one GPU: an 8B-shaped Llama (random weights) in bf16.

    python benchmarks/generate_speed.py                         # 32 layers, batch 1 and 8, prompt 512, 256 new
    python benchmarks/generate_speed.py --layers 4 --batch 1,16 --prompt 2048 --new 128 --backend flax

Prints one JSON line per batch size: compile_s (first call of the bucket), prefill_s and decode_s of a
second call (compiled), new tokens/s over all rows, and ms per decode step. At batch 1 a decode step
reads every weight once, so its floor is (parameter bytes) / (HBM bandwidth): 16 GB / 4.8 TB/s = 3.3 ms
on an H200 for the 32-layer 8B shape in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from maxlm import generation
from maxlm.config import load_config
from maxlm.layers import precision_scope, resolve_backend
from maxlm.model import Transformer


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="llama8b.yml")
  ap.add_argument("--layers", type=int, default=32)
  ap.add_argument("--batch", default="1,8")
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--new", type=int, default=256)
  ap.add_argument("--backend", default="auto")
  args = ap.parse_args()
  m = load_config([f"config={args.config}"]).model
  m = dataclasses.replace(m, n_layers=args.layers, backend=resolve_backend(args.backend), param_dtype="bfloat16",
                          dtype="bfloat16", remat="none", precision="bf16")
  model = Transformer(m)
  with precision_scope("bf16", m.backend):
    init = jax.jit(lambda r: nn.unbox(model.init(r, jnp.zeros((1, 8), jnp.int32)))["params"])
    params = init(jax.random.PRNGKey(0))
  n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  rng = np.random.default_rng(0)
  for b in (int(x) for x in args.batch.split(",")):
    prompts = [rng.integers(0, m.vocab_size, size=args.prompt).tolist() for _ in range(b)]
    first = generation.generate(m, params, prompts, args.new)
    out = generation.generate(m, params, prompts, args.new)
    new = sum(len(t) for t in out.tokens)
    steps = max(len(t) for t in out.tokens) - 1  # the first token comes from the prefill's logits
    print(json.dumps({"model": m.name, "layers": m.n_layers, "backend": m.backend, "param_gb": n_bytes / 1e9,
                      "batch": b, "prompt": args.prompt, "new_tokens": args.new,
                      "compile_s": round(first.timing["compile_s"], 2),
                      "prefill_s": round(out.timing["prefill_s"], 4), "decode_s": round(out.timing["decode_s"], 4),
                      "tokens_per_s": round(new / out.timing["decode_s"], 1),
                      "ms_per_step": round(1e3 * out.timing["decode_s"] / max(steps, 1), 3),
                      "traces": generation.trace_counts()}), flush=True)


if __name__ == "__main__":
  main()
