"""The planner's step-time estimate for simulated targets: a roofline, labelled "estimated" wherever it shows.

On the GPUs at hand the planner times its candidates instead (maxlm/plan/timing.py); this estimate orders them
and is all there is for devices that are not here. Every constant is a documented hardware figure, none is
fitted to a run:

* compute: the step's FLOPs (maxlm.model.flops_per_step) plus every FLOP the remat policy recomputes, at the
  device's dense bf16 peak (maxlm.metrics.PEAK_BF16_FLOPS, from the vendors' datasheets: H100/H200 989
  TFLOP/s, B200 2,250);
* FSDP gathers and scatters and the data-parallel all-reduce at the link's bandwidth (NVLink within a node,
  the network across nodes), overlapped with compute;
* per extra micro-batch, the weights read again and the gradient sum read and written, at HBM bandwidth;
* the optimizer update's memory traffic (read parameter, gradient, moments; write parameter, moments) at HBM
  bandwidth, the moments in their dtypes; with `optim.offload=host` the moments' trip to the host and back at
  the host link's bandwidth instead.

A roofline is a bound: real steps are slower (the 8B on one H200 ran at 57% of the compute term) and by
different factors for different settings; the times are for ordering, and the GPUs at hand measure.
"""

from __future__ import annotations

from maxlm.config import Config
from maxlm.mesh import mesh_shape
from maxlm.metrics import device_peak_flops
from maxlm.model import count_params, flops_per_step
from maxlm.plan import sizing
from maxlm.plan.measure import Target

# bytes/s from the datasheets: HBM, NVLink per direction, host link (PCIe Gen5 x16: 64 GB/s per direction, 55
# in practice; Grace's NVLink-C2C for GH/GB), network per GPU (400 Gb/s InfiniBand: 50 GB/s; 800 Gb/s: 100)
# (matched in this order: GH200 before H200, GB200 before B200)
_BANDWIDTH = {"GH200": (4.0e12, 450e9, 450e9, 50e9), "GB200": (8e12, 900e9, 450e9, 100e9),
              "H200": (4.8e12, 450e9, 55e9, 50e9), "H100": (3.35e12, 450e9, 55e9, 50e9),
              "B200": (8e12, 900e9, 55e9, 100e9)}
# forward parts of a layer that each remat policy recomputes (TE backend: fused attention outputs kept)
_RECOMPUTED = {"none": (), "recompute_norm_act": (), "save_dots_attn": (), "save_dots": ("attn",),
               "save_qkv_attn": ("out", "mlp"), "save_attn": ("qkv", "out", "mlp"),
               "full": ("qkv", "out", "mlp", "attn")}


def degrees(cfg: Config, target: Target) -> dict:
  """Total data / fsdp / tensor degrees of the mesh on the target's devices (intra x inter node)."""
  ici, dcn = mesh_shape(cfg.mesh, target.n_devices, target.n_nodes)
  return dict(zip(("data", "fsdp", "tensor"), (i * j for i, j in zip(ici, dcn))))


def _hardware(kind: str) -> tuple[float, float, float, float, float]:
  """(peak bf16 FLOP/s, HBM, link, host link, network bytes/s); H200 figures where the kind is unknown."""
  peak = device_peak_flops(kind) or 989e12
  for name, bw in _BANDWIDTH.items():
    if name.lower() in kind.lower():
      return (peak, *bw)
  return (peak, *_BANDWIDTH["H200"])


def _recompute_flops(cfg: Config) -> float:
  """FLOPs the backward pass redoes under the remat policy (forward GEMMs and attention of every layer)."""
  m, d = cfg.model, cfg.data
  s = d.seq_len
  w = m.sliding_window if m.sliding_window and m.sliding_window < s else s
  per_token = {"qkv": 2 * m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim,
               "out": 2 * m.n_heads * m.head_dim * m.d_model, "mlp": 6 * m.d_model * m.ffn_dim,
               "attn": 4 * (s * w - w * w / 2) / s * m.n_heads * m.head_dim}
  parts = _RECOMPUTED[m.remat]
  return d.global_batch_size * s * m.n_layers * sum(per_token[p] for p in parts)


def step_time(cfg: Config, target: Target) -> dict:
  """Estimated seconds per step, the roofline of the module doc: compute, communication, accumulation,
  optimizer, offload and their total."""
  peak, hbm, link, host, net = _hardware(target.kind)
  m, n = cfg.model, target.n_devices
  deg = degrees(cfg, target)
  params = count_params(m)
  compute = (flops_per_step(m, cfg.data.global_batch_size, cfg.data.seq_len) + _recompute_flops(cfg)) / (n * peak)
  shards = deg["fsdp"] * deg["tensor"]
  a = cfg.train.grad_accum
  gathered = params["total"] / deg["tensor"]  # what FSDP gathers, per device, per micro-batch
  fsdp = a * 3 * gathered * 2 * (deg["fsdp"] - 1) / deg["fsdp"] / link  # 2 gathers (bf16) + scatter
  bw = net if target.n_nodes > 1 else link
  data = 2 * 4 * params["total"] / shards * (deg["data"] - 1) / deg["data"] / bw  # fp32 all-reduce
  accum = (a - 1) * (3 * 2 * params["matmul"] / deg["tensor"] + 2 * 4 * params["total"] / shards) / hbm
  held = params["total"] / shards  # parameters per device
  p_bytes = sizing.DTYPE_BYTES[m.param_dtype]
  moment_bytes = sizing.moment_bytes(cfg.optim)  # mu's and nu's, per parameter
  host_trip = cfg.optim.offload == "host"
  optimizer = held * (3 * p_bytes + (0 if host_trip else 2 * moment_bytes)) / hbm  # read p, g; write p (+ moments)
  offload = 2 * held * moment_bytes / host if host_trip else 0.0  # the moments in and out over the host link
  total = max(compute, fsdp + data) + accum + optimizer + offload
  return {"compute_s": compute, "comm_s": fsdp + data, "accum_s": accum, "optimizer_s": optimizer,
          "offload_s": offload, "total_s": total}
