"""Per-device memory of a training run, estimated from the config before anything is built.

`estimate(cfg, n_devices)` gives bytes per device for each part:

* params: the parameters, in `model.param_dtype`; 0 with `optim.offload=host_params`, where they live in host
  memory between steps (see copy).
* optimizer: AdamW's two moments, mu in `optim.mu_dtype` and nu in `optim.nu_dtype` (4 bytes per parameter
  each in float32, 2 in bfloat16: `moment_bytes`); 0 with `optim.offload=host` or `host_params`, where they live
  in host memory (the update streams them through the device a few parameters at a time after the backward
  pass: not counted here).
* host: what is in pinned host memory per device: the optimizer state (`optim.offload=host`), and the
  parameters too (`host_params`), else 0; not part of lower_bound or total, which are device memory.
* copy: with `optim.offload=host_params`, the parameters as the forward and backward passes read them, on the
  device for the step (maxlm/step.py): the matmul weights (embedding and LM head included) in the compute dtype,
  the norms and a tied embedding in `model.param_dtype` (everything in it under an FP8 precision, whose GEMMs
  take the master weights); else 0 (the parameters are counted in params). `copy_embedding` is the untied
  embedding's part of it: read once, by the lookup at the start (its gradient is a scatter that does not read
  it), so not certainly held when the gradients or the head's output are.
* gradients: one gradient per parameter, in the parameter dtype.
* fp8_meta: TE's delayed-scaling state (`fp8_metas`): per quantized GEMM (4 per layer, + the LM head
  with `model.fp8_lm_head` when unchunked), an fp32 amax history and scale for its input, kernel and gradient;
  replicated. Zero for the other precisions (current and block scaling keep no state).
* logits: one micro-batch's logits [B_micro / (data * fsdp), S / context, V / tensor] in fp32 (the loss) plus
  the `model.dtype` copy the LM head produces (none when that is float32); with `model.loss_chunk` = C
  (chunked head and loss, maxlm/step.py) only C positions of them at a time, not S.
* activations (rough): what `model.remat` keeps per layer, plus one layer's internals recomputed in
  the backward pass; attention scores are not counted (fused attention does not store them).
* head: the LM head's output alone, [B_micro / (data * fsdp), S or C, V / tensor] in the compute dtype.
* lower_bound: what the step certainly holds at one moment, a true lower bound of XLA's peak: the state it
  takes as arguments (params, optimizer, fp8_meta: XLA counts arguments whole), plus the larger of the
  gradients (every one is live before the update: the clipping norm and the non-finite check read them all
  first) and the logits in the compute dtype (the LM head's GEMM output; the fp32 copy the loss reads may be
  fused away), or both when accumulating (the gradient sum is the carry of the scan over micro-batches, live
  through every micro-batch's head). Not the two together without accumulation: the logits are gone before
  most gradients exist. With `host_params` the compute copy (less `copy_embedding`) is held with the head's
  output (every layer's weights are read again by the backward pass), and with the gradient sum too when
  accumulating (it is read by every micro-batch). total: params + optimizer + gradients + fp8_meta + logits +
  activations + copy (an estimate).

`estimate(..., state=...)` takes params / optimizer / fp8_meta bytes per device measured elsewhere
(`maxlm.cli.dryrun` reads them off the abstract train state and its shardings) instead of the formulas.

* exchange: with expert parallelism (`mesh.expert` x `mesh.dcn_expert` = ep > 1), the buffers of one MoE layer's
  all-to-all (maxlm/parallel/experts.py), dropless and padded: the send and the receive buffer, each ep slots of
  N k rows of D in the compute dtype, N = the micro-batch's tokens on a device (k = model.moe.top_k); ep x what
  a ragged exchange would hold. 0 without expert parallelism.

Sharding is kept simple: parameter, optimizer and gradient bytes are divided by the fsdp x context x expert x
tensor degree (rounded up; `embed` is split over fsdp, context and expert: maxlm/parallel/sharding.py ZERO; the
experts [E, D, F] over expert on E, E / ep per device, and over fsdp x context on D: the same product), those of
the layer stack also by the pipeline degree (its stages split the layers);
the logits' batch by data x fsdp x expert, their positions by context and their vocabulary by tensor (each rounded
up). A dimension that does not divide its mesh axes is replicated in practice, so `lower_bound` stays a
lower bound. Activations are divided by the batch and context degrees only. With pipeline stages
(maxlm/parallel/pipelining.py) the LM head runs once on the whole batch (its micro-batches are all in flight), its
length split over the stages (`stage_length`), and a
stage keeps its L / stages layers' activations for every micro-batch (GPipe and circular: M in flight); under 1f1b
(maxlm/parallel/onefoneb.py) the inputs of min(M, 2 S - 1) micro-batches and one micro-batch's L / stages layers;
with train.pipeline_gather=step and fsdp, `gathered`: the stage's layers whole over fsdp and their gradient sum
for the step. Degrees are the products of
the intra- and inter-node degrees, -1 filled from the device count as `maxlm.parallel.mesh` does.

`check_fits(cfg, n_devices, bytes_per_device)` raises `ConfigError` when `lower_bound` exceeds the
device memory (no guessed activations). All of it is arithmetic on Python ints: microseconds even
for absurd sizes (no arrays, no loop over layers).
"""

from __future__ import annotations

import math

from maxlm.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig
from maxlm.tables import PRECISIONS, REMATS, human_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def moment_bytes(optim: OptimConfig) -> int:
  """Bytes per parameter of Adam's two moments: mu's in optim.mu_dtype plus nu's in optim.nu_dtype."""
  return DTYPE_BYTES[optim.mu_dtype] + DTYPE_BYTES[optim.nu_dtype]


def _fill(degrees: list[int], total: int) -> list[int]:
  """The -1 entry (at most one) gets total / product(the others); `maxlm.parallel.mesh` checks the rest."""
  known = math.prod(d for d in degrees if d != -1)
  return [max(1, total // known) if d == -1 else d for d in degrees]


def mesh_degrees(mesh: MeshConfig, n_devices: int, n_nodes: int = 1) -> dict[str, int]:
  """Total pipeline / data / fsdp / expert / context / tensor degrees (intra-node x inter-node) on n_devices over
  n_nodes."""
  axes = ("pipeline", "data", "fsdp", "expert", "context", "tensor")  # maxlm.parallel.mesh.AXES (imports JAX)
  dcn = _fill([getattr(mesh, f"dcn_{a}") for a in axes], n_nodes)
  ici = _fill([getattr(mesh, a) for a in axes], max(1, n_devices // n_nodes))
  return {a: i * j for a, i, j in zip(axes, ici, dcn)}


def _activation_elements(cfg: Config, n_layers: int) -> int:
  """Rough activation elements per token: saved by the remat policy over `n_layers` layers + one layer."""
  m = cfg.model
  d, f, qkv, ctx = m.d_model, m.ffn_dim, (m.n_heads + 2 * m.n_kv_heads) * m.head_dim, m.n_heads * m.head_dim
  terms = {"input": d, "qkv": qkv, "context": ctx,
           "dots": 3 * d + qkv + 2 * f,  # the GEMM outputs
           # Everything one block's backward reads without remat: norm inputs/outputs, q/k/v, context,
           # projection outputs, gate/up/product of the MLP.
           "whole": 6 * d + qkv + ctx + 3 * f,
           "norm_act": 2 * d + f}  # the two RMSNorm outputs and the SwiGLU product

  def total(names: tuple[str, ...]) -> int:
    return sum(-terms[n[1:]] if n.startswith("-") else terms[n] for n in names)
  r = REMATS[m.remat]  # what the policy keeps of every layer, + what the backward recomputes of one at a time
  return n_layers * total(r.kept) + total(r.redone)


def fp8_meta_bytes(m: ModelConfig) -> int:
  """Bytes of TE's delayed-scaling state: (history + scale) x 3 tensors x 4 B per quantized GEMM."""
  if not PRECISIONS[m.precision].fp8_state:
    return 0
  gemms = 4 * m.n_layers + (1 if m.te_fp8_lm_head and not m.tie_embeddings else 0)  # qkv, out, MLP in, MLP out
  return gemms * 3 * (m.fp8_amax_history_len + 1) * 4


def _logit_positions(m, seq_len: int) -> int:
  """Positions whose logits exist at once: the loss chunk when the chunked loss runs (as
  maxlm.step.use_chunked_loss decides: whenever model.loss_chunk > 0), else the whole sequence."""
  return min(seq_len, m.loss_chunk) if m.loss_chunk else seq_len


def compute_copy(m: ModelConfig, stages: int, shards: int) -> tuple[int, int]:
  """(bytes per device of the parameters as the step's forward reads them with optim.offload=host_params, the
  untied embedding's part of them): see the module doc, `copy`. One pipeline stage's layers."""
  p_bytes, prec = DTYPE_BYTES[m.param_dtype], PRECISIONS[m.precision]
  w_bytes = p_bytes if prec.quantized else DTYPE_BYTES[prec.compute_dtype or m.dtype]  # matmul weights
  d, v = m.d_model, m.vocab_size
  per_layer = d * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * d + 3 * d * m.ffn_dim
  layers = -(-m.n_layers * (per_layer * w_bytes + 2 * d * p_bytes) // stages)
  head = v * d * (p_bytes if m.tie_embeddings else w_bytes)  # a tied embedding is the head, never cast
  embedding = 0 if m.tie_embeddings else v * d * w_bytes
  return -(-(layers + d * p_bytes + head + embedding) // shards), -(-embedding // shards)


def _gathered(cfg: Config, layer_params: int, stages: int, deg: dict[str, int], p_bytes: int) -> int:
  """train.pipeline_gather=step under FSDP: a stage's L / S layers gathered over fsdp (tensor-parallel shards
  kept) and their gradient sum, in the parameters' dtype, held for the whole step; 0 otherwise (gathered per
  tick: one layer at a time, as without stages)."""
  if stages == 1 or cfg.train.pipeline_gather != "step" or deg["fsdp"] == 1:
    return 0
  return 2 * -(-layer_params // stages) * p_bytes // deg["tensor"]


def estimate(cfg: Config, n_devices: int, n_nodes: int = 1,
             state: dict[str, int] | None = None) -> dict[str, int]:
  """Bytes per device: params, optimizer, gradients, fp8_meta, logits, head, activations, gathered, exchange, copy,
  copy_embedding, lower_bound, total, and host (pinned host memory, not in the totals)."""
  if n_devices < 1 or n_nodes < 1:
    raise ValueError(f"n_devices ({n_devices}) and n_nodes ({n_nodes}) must be >= 1")
  from maxlm.model import count_params  # noqa: PLC0415 - maxlm.model imports jax, the rest here needs none
  from maxlm.parallel.schedules import in_flight  # noqa: PLC0415 - it imports jax too

  m, d = cfg.model, cfg.data
  deg = mesh_degrees(cfg.mesh, n_devices, n_nodes)
  counts, stages = count_params(m), deg["pipeline"]
  n_params = counts["total"] - counts["layers"] + -(-counts["layers"] // stages)  # per pipeline stage
  p_bytes, c_bytes = DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[PRECISIONS[m.precision].compute_dtype or m.dtype]
  shards = deg["fsdp"] * deg["context"] * deg["expert"] * deg["tensor"]  # dense and experts alike (module doc)
  params = -(-n_params * p_bytes // shards)  # ceil
  micro = d.global_batch_size // (1 if stages > 1 else cfg.train.grad_accum)  # pipelined: all micro-batches at once
  rows = -(-micro // (deg["data"] * deg["fsdp"] * deg["expert"]))
  vocab = -(-m.vocab_size // deg["tensor"])
  logit_bytes = 4 + (c_bytes if c_bytes != 4 else 0)
  moments = -(-n_params * moment_bytes(cfg.optim) // shards)
  if state is not None:
    params, moments = state["params"], state["optimizer"]
  host_params = cfg.optim.offload == "host_params"
  host = host_params or cfg.optim.offload == "host"
  copy, copy_embedding = compute_copy(m, stages, shards) if host_params else (0, 0)
  out = {
      "params": 0 if host_params else params,
      "optimizer": 0 if host else moments,
      "host": (moments if host else 0) + (params if host_params else 0),
      "gradients": params,
      "copy": copy,
      "copy_embedding": copy_embedding,
      "fp8_meta": fp8_meta_bytes(m) if state is None else state["fp8_meta"],
      # with stages the length outside them (embedding, head, loss) is split over the pipeline axis
      "logits": rows * -(-_logit_positions(m, d.seq_len) // (deg["context"] * stages)) * vocab * logit_bytes,
      "activations": (rows * (d.seq_len // deg["context"]) * _activation_elements(cfg, m.n_layers // stages)
                      * c_bytes),
      "gathered": _gathered(cfg, counts["layers"], stages, deg, p_bytes),
  }
  if stages > 1 and cfg.train.pipeline_schedule == "1f1b":  # R stage inputs kept, one micro-batch's layers live
    mb_rows = -(-(d.global_batch_size // cfg.train.grad_accum) // (deg["data"] * deg["fsdp"] * deg["expert"]))
    kept = in_flight("1f1b", stages, cfg.train.grad_accum) * m.d_model
    out["activations"] = (mb_rows * (d.seq_len // deg["context"]) * (kept + _activation_elements(
        cfg, m.n_layers // stages)) * c_bytes)
  out["exchange"] = exchange_bytes(m, rows * (d.seq_len // deg["context"]), deg["expert"], c_bytes)
  out["head"] = rows * -(-_logit_positions(m, d.seq_len) // stages) * vocab * c_bytes  # the LM head's output
  held = copy - copy_embedding  # host_params: read again by the backward pass (and by every micro-batch)
  live = (out["gradients"] + out["head"] + held if cfg.train.grad_accum > 1
          else max(out["gradients"], out["head"] + held))
  out["lower_bound"] = out["params"] + out["optimizer"] + out["fp8_meta"] + live + out["gathered"]
  out["total"] = (out["params"] + out["optimizer"] + out["gradients"] + out["fp8_meta"] + out["logits"]
                  + out["activations"] + copy + out["gathered"] + out["exchange"])
  return out


def exchange_bytes(m: ModelConfig, tokens: int, ep: int, c_bytes: int) -> int:
  """One MoE layer's all-to-all buffers on a device holding `tokens` tokens: send and receive, each ep slots of
  tokens x top_k rows of d_model (the module doc's `exchange`); 0 without experts or expert parallelism."""
  if ep == 1 or not m.moe.experts:
    return 0
  return 2 * ep * tokens * m.moe.top_k * m.d_model * c_bytes


def check_fits(cfg: Config, n_devices: int, bytes_per_device: int, n_nodes: int = 1) -> None:
  """ConfigError (one line, with the numbers) if the certain part cannot fit in a device's memory."""
  if bytes_per_device <= 0:
    raise ValueError(f"bytes_per_device must be positive, got {bytes_per_device}")
  est = estimate(cfg, n_devices, n_nodes)
  if est["lower_bound"] <= bytes_per_device:
    return
  deg = mesh_degrees(cfg.mesh, n_devices, n_nodes)
  both = cfg.train.grad_accum > 1
  parts = (f"params {human_bytes(est['params'])}, optimizer {human_bytes(est['optimizer'])}"
           + (f", the params' compute copy {human_bytes(est['copy'] - est['copy_embedding'])}" if est["copy"] else "")
           + (f", fp8 state {human_bytes(est['fp8_meta'])}" if est["fp8_meta"] else "")
           + f", {'the gradient sum' if both else 'gradients'} {human_bytes(est['gradients'])} "
           f"{'and' if both else 'or'} the LM head's output {human_bytes(est['head'])}"
           + ("" if both else ", whichever is larger"))
  pipe = f"pipeline {deg['pipeline']} x " if deg["pipeline"] > 1 else ""
  shown = {a: n for a, n in deg.items() if a != "pipeline" and (a != "expert" or n > 1)}
  raise ConfigError(
      f"model needs at least {human_bytes(est['lower_bound'])} per device ({parts}) on {n_devices} "
      f"device(s) with mesh {pipe}{' x '.join(f'{a} {n}' for a, n in shown.items())}, but a device "
      f"has {human_bytes(bytes_per_device)}; reduce model.n_layers/d_model/vocab_size or "
      "data.global_batch_size/seq_len, or use more devices")
