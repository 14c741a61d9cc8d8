"""The planner's step-time estimate for simulated targets: a roofline, labelled "estimated" wherever it shows.

On the GPUs at hand the planner times its candidates instead (maxlm/plan/timing.py); this estimate orders them
and is all there is for devices that are not here. Every constant is a documented hardware figure, none is
fitted to a run:

* compute: the step's FLOPs (maxlm.model.flops_per_step) plus every FLOP the remat policy recomputes, at the
  device's dense bf16 peak (maxlm.metrics.PEAK_BF16_FLOPS, from the vendors' datasheets: H100/H200 989
  TFLOP/s, B200 2,250);
* FSDP gathers and scatters, the data-parallel all-reduce and context parallelism's exchange of keys and
  values at the link's bandwidth (NVLink within a node, the network across nodes), overlapped with compute;
* with expert parallelism, the MoE layers' all-to-all (`expert_exchange_bytes`), on the critical path: the
  experts wait for their rows and the next layer for their outputs;
* per extra micro-batch, the weights read again and the gradient sum read and written, at HBM bandwidth;
* the optimizer update's memory traffic (read parameter, gradient, moments; write parameter, moments) at HBM
  bandwidth, the moments in their dtypes; with `optim.offload=host` the moments' trip to the host and back at
  the host link's bandwidth instead; with `host_params` also the parameters' three crossings (in for the forward
  and backward passes, in and out again for the update: maxlm/step.py, maxlm/optim.py), in `model.param_dtype`.

A roofline is a bound: real steps are slower (the 8B on one H200 ran at 57% of the compute term) and by
different factors for different settings; the times are for ordering, and the GPUs at hand measure.

With pipeline stages (maxlm/parallel/pipelining.py; V = 1 for GPipe, train.pipeline_repeats for circular): every stage
computes 1/V of its layers at each of the V M + S - 1 ticks, V M of them useful (the bubble, `bubble_s`); the LM
head runs once for the whole batch, its length split over the stages; a stage's FSDP gathers the layers of each tick
(train.pipeline_gather=tick) or its own layers once (step); 1f1b (maxlm/parallel/onefoneb.py) has GPipe's
bubble, (S - 1) / (M + S - 1), and computes a stage's forward once more per micro-batch (its backward phase
recomputes it from the kept input); and each tick hands one micro-batch's activations to
the next stage and sums the last stage's output over the pipeline axis, forward and backward (`pipeline_s`, at
network bandwidth when the stages span nodes), on the critical path between ticks.
"""

from __future__ import annotations

from maxlm.config import Config
from maxlm.parallel.context import resolve_strategy
from maxlm.parallel.mesh import AXES, mesh_shape
from maxlm.model import count_params, flops_per_step
from maxlm.plan import memory
from maxlm.parallel.pipelining import repeats as pipeline_repeats
from maxlm.plan.target import Target
from maxlm.tables import DEFAULT_GPU, REMATS, gpu, gpu_named

# The estimate is a bound that real steps miss by factors that differ between settings (datasheet peaks, no
# efficiency), so it does not resolve 2%: settings within TIE of each other are a tie, which the planner breaks
# for the more exact moments and the mesh search for the config's own mesh (a judgement, not a measured figure;
# llama70b on 64 H200s: fsdp 4 x context 2 in a node was predicted 0.5% faster than its own pure FSDP, with
# bfloat16 moments instead of float32).
TIE = 0.02



def degrees(cfg: Config, target: Target) -> dict:
  """Total degrees of the mesh's axes (maxlm.parallel.mesh.AXES) on the target's devices (intra x inter node)."""
  ici, dcn = mesh_shape(cfg.mesh, target.n_devices, target.n_nodes)
  return dict(zip(AXES, (i * j for i, j in zip(ici, dcn))))


def hardware(kind: str) -> tuple[float, float, float, float, float]:
  """(peak bf16 FLOP/s, HBM, link, host link, network bytes/s) of the GPU's row in maxlm/tables.py; the default
  GPU's (an H200's) figures where the kind or its links are unknown (the estimate then only orders the
  candidates)."""
  row, default = gpu(kind), gpu_named(DEFAULT_GPU)
  peak = (row and row.bf16_flops) or default.bf16_flops
  links = row if row is not None and row.hbm is not None else default
  return peak, links.hbm, links.nvlink, links.host_link, links.network


def _recompute_flops(cfg: Config) -> float:
  """FLOPs the backward pass redoes under the remat policy (forward GEMMs and attention of every layer)."""
  m, d = cfg.model, cfg.data
  s = d.seq_len
  w = m.sliding_window if m.sliding_window and m.sliding_window < s else s
  per_token = {"qkv": 2 * m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim,
               "out": 2 * m.n_heads * m.head_dim * m.d_model, "mlp": 6 * m.d_model * m.ffn_dim,
               "attn": 4 * (s * w - w * w / 2) / s * m.n_heads * m.head_dim}
  parts = REMATS[m.remat].recomputed  # forward parts of a layer (TE backend: fused attention outputs kept)
  return d.global_batch_size * s * m.n_layers * sum(per_token[p] for p in parts)


def step_time(cfg: Config, target: Target) -> dict:
  """Estimated seconds per step, the roofline of the module doc: compute (bubble_s of it the pipeline's
  bubble), communication, accumulation, pipeline hand-offs, optimizer, offload and their total."""
  peak, hbm, link, host, net = hardware(target.kind)
  m, d, n = cfg.model, cfg.data, target.n_devices
  deg = degrees(cfg, target)
  params = count_params(m)
  work = flops_per_step(m, d.global_batch_size, d.seq_len) + _recompute_flops(cfg)
  zero = deg["fsdp"] * deg["context"] * deg["expert"]  # the parameters' embed split (maxlm/parallel/sharding.py ZERO)
  shards = zero * deg["tensor"]  # the experts: E / expert each, D over fsdp x context: the same split
  a, stages = cfg.train.grad_accum, deg["pipeline"]
  # per stage and device: the parameters a micro-batch (a tick) passes through, and those kept (all of them
  # without a pipeline; the stage's layers and the embedding, head and final norm with one)
  layers, other = params["layers"] / stages, params["total"] - params["layers"]
  held = layers + other
  passes, bubble, handoff = a, 0.0, 0.0
  if stages > 1:
    head = 6.0 * m.d_model * m.vocab_size * d.global_batch_size * d.seq_len  # in flops_per_step's matmuls
    v = pipeline_repeats(cfg.train)
    if cfg.train.pipeline_schedule == "1f1b":  # its backward phase recomputes the stage's forward (onefoneb.py)
      work += (flops_per_step(m, d.global_batch_size, d.seq_len) - head) / 3
    ticks = v * a + stages - 1  # each running 1/V of a stage's layers on one micro-batch (1f1b: F and B phases)
    passes = ticks / v  # the stage's layers run this often; the head once, its length split over the stages
    bubble = (work - head) * (stages - 1) / (v * a) / (n * peak)
    work = (work - head) * passes / a + head
    rows = d.global_batch_size / a / (deg["data"] * deg["fsdp"] * deg["expert"])  # a micro-batch's rows per device
    act = rows * (d.seq_len // deg["context"]) * m.d_model * (4 if m.dtype == "float32" else 2)  # [B/M, T/cp, D]
    across = mesh_shape(cfg.mesh, target.n_devices, target.n_nodes)[1][AXES.index("pipeline")] > 1
    # per tick, forward and backward: the hand-off (a collective-permute) and the last stage's output summed
    # over the stages (an all-reduce: 2 (S - 1) / S of it through each device)
    handoff = ticks * 2 * act * (1 + 2 * (stages - 1) / stages) / (net if across else link)
  compute = work / (n * peak)
  once = stages > 1 and cfg.train.pipeline_gather == "step"
  gathered = (layers * (1 if once else passes) + other * (1 if stages > 1 else a)) / deg["tensor"]  # per device
  # 2 gathers (bf16) + scatter, over fsdp x context x expert; with expert parallelism a device gathers only its
  # E / expert experts, over fsdp x context (their D split), in float32 (maxlm/layers/moe.py casts them after the
  # exchange's entry: 2 x 4 B gathered, 4 B scattered)
  experts = expert_params(m) / stages * (1 if once else passes) / deg["tensor"]
  group, ep = zero // deg["expert"], deg["expert"]
  fsdp = (3 * (gathered - experts) * 2 * (zero - 1) / zero
          + ((2 * 4 + 4) * experts / ep * (group - 1) / group if ep > 1 else 3 * experts * 2 * (zero - 1) / zero)) / link
  bw = net if target.n_nodes > 1 else link
  data = 2 * 4 * held / shards * (deg["data"] - 1) / deg["data"] / bw  # fp32 all-reduce
  if stages > 1:  # the stage's weights read again and its gradients summed at every tick
    accum = (passes - 1) * (3 * 2 * params["layers"] / stages / deg["tensor"] + 2 * 4 * layers / shards) / hbm
  else:
    accum = (a - 1) * (3 * 2 * params["matmul"] / deg["tensor"] + 2 * 4 * params["total"] / shards) / hbm
  per_device = held / shards  # parameters per device
  p_bytes = memory.DTYPE_BYTES[m.param_dtype]
  moment_bytes = memory.moment_bytes(cfg.optim)  # mu's and nu's, per parameter
  host_trip = cfg.optim.offload in ("host", "host_params")
  optimizer = per_device * (3 * p_bytes + (0 if host_trip else 2 * moment_bytes)) / hbm  # read p, g; write p (+ moments)
  # over the host link: the moments in and out; host_params: the parameters in (forward), in and out (update)
  crossings = 2 * moment_bytes + (3 * p_bytes if cfg.optim.offload == "host_params" else 0)
  offload = per_device * crossings / host if host_trip else 0.0
  context = context_exchange_bytes(cfg, deg) / (net if cfg.mesh.dcn_context != 1 else link)
  expert = expert_exchange_bytes(cfg, deg) / (net if cfg.mesh.dcn_expert != 1 else link)
  total = max(compute, fsdp + data + context) + expert + accum + handoff + optimizer + offload
  return {"compute_s": compute, "bubble_s": bubble, "comm_s": fsdp + data + context, "context_s": context,
          "expert_s": expert,
          "accum_s": accum, "pipeline_s": handoff, "optimizer_s": optimizer,
          "offload_s": offload, "total_s": total}


def context_exchange_bytes(cfg: Config, deg: dict) -> float:
  """Bytes one device receives per step for context-parallel attention (maxlm/parallel/context.py): per layer
  and micro-batch, the K and V blocks [rows, T / cp, KV, Dh] of the other cp - 1 devices, gathered or passed
  around the ring in the compute dtype, twice (the forward, and again in the backward, which recomputes it), and
  their gradients going back once: in the compute dtype around the ring, reduce-scattered in float32 by the
  all-gather (`gather_kv`'s transpose). Overlapped with compute like the other traffic. With pipeline stages a
  device runs its L / stages layers at each of the M + stages - 1 ticks (maxlm/parallel/pipelining.py)."""
  cp = deg["context"]
  if cp == 1:
    return 0.0
  m, d = cfg.model, cfg.data
  stages = deg["pipeline"]
  passes = cfg.train.grad_accum + stages - 1
  rows = -(-(d.global_batch_size // cfg.train.grad_accum) // (deg["data"] * deg["fsdp"] * deg.get("expert", 1)))
  c = 4 if m.dtype == "float32" else 2
  block = rows * (d.seq_len // cp) * m.n_kv_heads * m.head_dim  # elements
  packed = d.type != "synthetic" or bool(m.sliding_window)  # as maxlm/build.py and the attention layers see rows
  grads = c if resolve_strategy(cfg.mesh.context_strategy, cp, d.seq_len, packed) == "ring" else 4
  return passes * (m.n_layers // stages) * 2 * block * (2 * c + grads) * (cp - 1)


def moe_blocks(m) -> int:
  """How many blocks are MoE (N-1, 2N-1, ...: maxlm.model.moe_layers), counted, not listed (an absurd
  n_layers stays arithmetic)."""
  return m.n_layers // m.moe.every if m.moe.experts else 0


def expert_params(m) -> int:
  """The experts' weights of every MoE layer: E x 3 x D x F each (w1, w3, w2)."""
  return moe_blocks(m) * m.moe.experts * 3 * m.d_model * m.ffn_dim


def expert_exchange_bytes(cfg: Config, deg: dict) -> float:
  """Bytes one device sends to the others per step for expert parallelism (maxlm/parallel/experts.py): per MoE
  layer and micro-batch 4 all-to-alls (dispatch and combine forward, their transposes backward), each of ep slots
  of N k rows of D in the compute dtype (dropless, padded: N the micro-batch's tokens on the device), (ep - 1) / ep
  of it leaving the device. The per-expert counts (ep x E / ep int32) are left out. A remat policy that recomputes
  the MoE layer in the backward pass runs the forward pair again: not counted."""
  ep = deg["expert"]
  m, d = cfg.model, cfg.data
  if ep == 1 or not m.moe.experts:
    return 0.0
  a = cfg.train.grad_accum
  tokens = d.global_batch_size // a // (deg["data"] * deg["fsdp"] * ep) * (d.seq_len // deg["context"])
  c = 4 if m.dtype == "float32" else 2
  return a * moe_blocks(m) * 4 * ep * tokens * m.moe.top_k * m.d_model * c * (ep - 1) / ep
