"""The planner's step-time estimate (it orders the candidates of maxlm/plan/__init__.py; never measured here).

The step's FLOPs (maxlm.model.flops_per_step) plus what the remat policy recomputes (x RECOMPUTE_COST), at the
device's bf16 peak x 0.57 (the MFU maxlm measured for the 8B shape on one H200: 563.5 of 989 TFLOP/s); FSDP and
data-parallel traffic at link bandwidth, overlapped with compute; plus, per extra micro-batch, the weights
read again from HBM and the gradient sum, plus the optimizer state's trip to the host and back at PCIe
bandwidth for `optim.offload=host`.
"""

from __future__ import annotations

from maxlm.config import Config
from maxlm.mesh import AXES, mesh_shape
from maxlm.metrics import device_peak_flops
from maxlm.model import count_params, flops_per_step
from maxlm.plan import sizing
from maxlm.plan.measure import Target

MFU = 0.57  # measured on one H200 for the 8B shape (benchmarks/README.md)
# What a recomputed FLOP costs against the step's average one, measured on one H200 for llama8b.yml (seq 8192,
# batch 8; benchmarks/results/2026-12-04-llama8b_h200.json): recompute_norm_act + 4 micro-batches + moments on
# the host took 7.40 s (bf16 moments) and 8.50 s (float32), which this model reproduces with 6.17 s of compute
# (1.03x its FLOP estimate) and the host trips at 55 GB/s; save_attn with bf16 moments on the device took
# 6.85 s, 0.68 s over that compute for 1.62 s of recomputed FLOPs at the step's MFU: 0.42. Recomputed GEMMs
# run at near-peak efficiency (no attention or memory-bound parts), and XLA overlaps some of them. Counted at
# full cost, save_attn (6.85 s measured) ranked behind the offloaded setting (7.40 s measured) and was not tried.
RECOMPUTE_COST = 0.42
# bytes/s: HBM, NVLink per direction, host link (PCIe Gen5 x16 in practice; Grace's C2C for GH/GB), network
# (matched in this order: GH200 before H200, GB200 before B200)
_BANDWIDTH = {"GH200": (4.0e12, 450e9, 450e9, 50e9), "GB200": (8e12, 900e9, 450e9, 100e9),
              "H200": (4.8e12, 450e9, 55e9, 50e9), "H100": (3.35e12, 450e9, 55e9, 50e9),
              "B200": (8e12, 900e9, 55e9, 100e9)}
# forward parts of a layer that each remat policy recomputes (TE backend: fused attention outputs kept)
_RECOMPUTED = {"none": (), "recompute_norm_act": (), "save_dots_attn": (), "save_dots": ("attn",),
               "save_qkv_attn": ("out", "mlp"), "save_attn": ("qkv", "out", "mlp"),
               "full": ("qkv", "out", "mlp", "attn")}


def degrees(cfg: Config, target: Target) -> dict:
  """Total degrees of the mesh's axes (maxlm.mesh.AXES) on the target's devices (intra x inter node)."""
  ici, dcn = mesh_shape(cfg.mesh, target.n_devices, target.n_nodes)
  return dict(zip(AXES, (i * j for i, j in zip(ici, dcn))))


def _hardware(kind: str) -> tuple[float, float, float, float, float]:
  """(peak bf16 FLOP/s, HBM, link, host link, network bytes/s); H200 figures where the kind is unknown
  (the estimate then only orders the candidates)."""
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
  """Estimated seconds per step (see the module doc): compute, communication, accumulation, offload."""
  peak, hbm, link, host, net = _hardware(target.kind)
  m, n = cfg.model, target.n_devices
  deg = degrees(cfg, target)
  params = count_params(m)
  compute = (flops_per_step(m, cfg.data.global_batch_size, cfg.data.seq_len) + RECOMPUTE_COST * _recompute_flops(cfg)
             ) / (n * peak * MFU)
  shards = deg["fsdp"] * deg["tensor"]
  a = cfg.train.grad_accum
  gathered = params["total"] / deg["tensor"]  # what FSDP gathers, per device, per micro-batch
  fsdp = a * 3 * gathered * 2 * (deg["fsdp"] - 1) / deg["fsdp"] / link  # 2 gathers (bf16) + scatter
  bw = net if target.n_nodes > 1 else link
  data = 2 * 4 * params["total"] / shards * (deg["data"] - 1) / deg["data"] / bw  # fp32 all-reduce
  accum = (a - 1) * (3 * 2 * params["matmul"] / deg["tensor"] + 2 * 4 * params["total"] / shards) / hbm
  state_bytes = sizing.DTYPE_BYTES[cfg.optim.state_dtype]
  offload = 2 * 2 * params["total"] / shards * state_bytes / host if cfg.optim.offload == "host" else 0.0
  total = max(compute, fsdp + data) + accum + offload
  return {"compute_s": compute, "comm_s": fsdp + data, "accum_s": accum, "offload_s": offload, "total_s": total}
