"""Where the state's init spends its time, in parts, for one config (a benchmark, run on the GPU):

  python3 benchmarks/init_profile.py config=llama3.2-3b.yml [key=value ...] [--threefry-kernel] [--step]
      [--checksum] [--no-run] [--option XLA_OPTION=VALUE ...]

Parts, each timed on its own: `eval_shape` (maxlm/build.py's abstract build: one trace of model.init + optimizer.init),
`init_lower` (the jitted init's trace and lowering), `init_compile`, `init_run` (the RNG fills the state
and blocks), and with --step the train step's `step_trace`, `step_lower` and `step_compile` on that state.
It also counts the custom calls left in the compiled init (a forward pass that XLA did not remove would show
up there as GEMM / attention calls) and the init's flops by XLA's cost analysis.

--threefry-kernel: the init traced inside maxlm.train_state.threefry_kernel (JAX's prebuilt threefry kernel, as
the trainer does since 2026-12-04); without it, XLA's default unrolled threefry. --checksum: a hash of every bit
of the initialized state (to compare two variants: they must give the same state). --option: XLA compiler
options for the init's compile alone. --no-run: compile only (a CPU without memory for the state). No
persistent compilation cache is used: run each variant in a fresh process, so that no in-process autotuning
result carries over. Prints one JSON line.

Measured 2026-12-04 on the H200, llama3.2-3b, default threefry: init compile 53.9 s with the model.init batch at
micro-batch x seq_len and 54.4 s at 1 x 128 (no custom call left in either: XLA removes the forward pass), for
0.05 s of running: the RNG's compile is the cost, not the batch."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from maxlm import train_state
from maxlm.build import build_step
from maxlm.config import load_config
from maxlm.parallel.mesh import make_mesh


def main(argv: list[str]) -> None:
  flags = ("--step", "--no-run", "--threefry-kernel", "--checksum")
  step, run, kernel, checksum = ("--step" in argv, "--no-run" not in argv, "--threefry-kernel" in argv,
                                 "--checksum" in argv)
  args = [a for a in argv if a not in flags]
  options = {}  # --option KEY=VALUE: XLA compiler options for the init's compile alone
  while "--option" in args:
    i = args.index("--option")
    key, value = args[i + 1].split("=", 1)
    options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    del args[i:i + 2]
  cfg = load_config(args)
  row = {"config": " ".join(args), "threefry_kernel": kernel, "options": options, "backend": jax.default_backend()}
  micro = cfg.data.global_batch_size // cfg.train.grad_accum
  batch, seq = micro, cfg.data.seq_len
  t = time.perf_counter()
  # the trainer's builder (maxlm/build.py): model, optimizer, abstract state (one trace of model.init +
  # optimizer.init under jax.eval_shape), shardings and the jitted steps
  built = build_step(cfg, make_mesh(cfg.mesh), abstract=True)
  row["eval_shape_s"] = time.perf_counter() - t
  model, optimizer, shardings = built.model, built.optimizer, built.state_shardings
  with built.scope():

    def init(r):
      return nn.unbox(train_state.init_boxed(model, optimizer, r, batch, seq))

    t = time.perf_counter()
    with train_state.threefry_kernel() if kernel else contextlib.nullcontext():
      lowered = jax.jit(init, out_shardings=shardings).lower(jax.random.PRNGKey(cfg.train.seed))
    row["init_lower_s"] = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    row["init_compile_s"] = time.perf_counter() - t
    text = compiled.as_text() or ""
    row["init_custom_calls"] = len(re.findall(r"custom-call\(", text))
    row["init_custom_call_targets"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))[:20]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row["init_gflops"] = round(float((cost or {}).get("flops", 0.0)) / 1e9, 3)
    if not run:  # compile only (a CPU without the memory for the state)
      step = False
    else:
      t = time.perf_counter()
      state = compiled(jax.random.PRNGKey(cfg.train.seed))
      jax.block_until_ready(state)
      row["init_run_s"] = time.perf_counter() - t
      if checksum:
        sums = jax.jit(lambda s: [jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint32) if x.dtype.itemsize == 4
                                          else x.astype(jnp.uint32), dtype=jnp.uint32)
                                  for x in jax.tree_util.tree_leaves(s)])(state)
        row["state_checksum"] = hashlib.sha256(np.asarray(jax.device_get(sums)).tobytes()).hexdigest()[:16]
    if step:  # the trainer's train step on that state
      jitted = built.train_step.jitted
      t = time.perf_counter()
      traced = jitted.trace(state, built.batch_structs())
      row["step_trace_s"] = time.perf_counter() - t
      t = time.perf_counter()
      low = traced.lower()
      row["step_lower_s"] = time.perf_counter() - t
      t = time.perf_counter()
      low.compile()
      row["step_compile_s"] = time.perf_counter() - t
  row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
  print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
