"""The chunked LM head + loss alone (maxlm.step.chunked_token_losses), forward and backward, in bf16 and in
FP8 (model.fp8_lm_head): does XLA run the three GEMMs in FP8 (cuBLASLt), and what does each cost?

  source .whl/device-setup.sh && python3 benchmarks/fp8_head.py [--iters=10]

Shape of the side-by-side benchmark: 4 x 4096 positions, d_model 4096, vocab 128256, chunk 1024; y in
bf16, the kernel in fp32 (the master weights). For each variant: the FP8 GEMM custom calls XLA left in the
compiled program (`__cublas$lt$matmul$f8`), milliseconds per forward+backward (mean of --iters after one
warm-up), and the compiled temp memory.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

from maxlm import step

# FP8_HEAD_SHAPE=B,T,D,V,CHUNK: another shape (a tiny one runs on CPU, which has no FP8 GEMM: 0 calls there)
B, T, D, V, CHUNK = (int(x) for x in os.environ.get("FP8_HEAD_SHAPE", "4,4096,4096,128256,1024").split(","))


def variant(name: str, fp8: bool, iters: int) -> str:
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  y = jax.random.normal(ks[0], (B, T, D), jnp.bfloat16)  # [B, T, D]
  w = jax.random.normal(ks[1], (D, V), jnp.float32) * 0.02  # [D, V]
  t = jax.random.randint(ks[2], (B, T), 0, V)  # [B, T]
  m = jnp.ones((B, T), jnp.float32)  # [B, T]

  def loss(y, w):
    return step.chunked_token_losses(y, w, t, m, chunk=CHUNK, vocab_axis=1, fp8=fp8)[0]
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  compiled = f.lower(y, w).compile()
  hlo = compiled.as_text()
  f8_calls = hlo.count("__cublas$lt$matmul$f8")
  if os.environ.get("OUT"):  # the optimized HLO, to see what became of the dots
    with open(os.path.join(os.environ["OUT"], f"head_{name}.hlo.txt"), "w") as f:
      f.write(hlo)
  gemms = hlo.count("__cublas$lt$matmul") + hlo.count("__cublas$gemm")
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", 0) / 1e9 if mem is not None else float("nan")
  out = compiled(y, w)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(iters):
    out = compiled(y, w)
  jax.block_until_ready(out)
  ms = (time.perf_counter() - t0) / iters * 1e3
  return (f"{name:<22} fp8 GEMM calls {f8_calls:>2} of {gemms:>2} cuBLAS calls  {ms:7.1f} ms  temp {temp:5.1f} GB  "
          f"loss {float(out[0]) / (B * T):.4f}")


def main(argv):
  iters = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--iters=")), 10))
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; [B, T, D, V] = {[B, T, D, V]}, chunk {CHUNK}")
  for name, fp8 in [("bf16", False), ("fp8", True)]:
    print(variant(name, fp8, iters), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
