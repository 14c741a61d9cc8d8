"""The planner's roofline step-time estimate (maxlm/plan/cost.py) against the roofline written out here from the
8B's shape and the H200's datasheet figures: no efficiency factor and no fitted constant anywhere (a recomputed
FLOP weighted by a fitted 0.42, or 5.0, or compute at 57% of the peak, fails every test here)."""

import pytest

from maxlm.config import load_config
from maxlm.plan.cost import step_time
from maxlm.plan.measure import Target

# Llama 3 8B: d=4096, ffn=14336, 32 heads / 8 kv heads of 128, vocab 128256, 32 layers, untied.
D, F, H, KV, HD, V, L = 4096, 14336, 32, 8, 128, 128256, 32
LAYER = D * (H + 2 * KV) * HD + H * HD * D + 3 * D * F
PARAMS = L * LAYER + (2 * L + 1) * D + 2 * V * D  # + norms + embedding + head: 8030261248
MATMUL = L * LAYER + D * V  # the MFU convention's N: every GEMM weight, the LM head too, not the embedding lookup
B, S = 8, 8192  # llama8b.yml's batch
PEAK, HBM, HOST = 989e12, 4.8e12, 55e9  # H200: dense bf16 FLOP/s, HBM bytes/s, PCIe Gen5 x16 in practice
H200 = Target(1, 1, "NVIDIA H200", 141 * 10**9, 0.95, True)


def cfg(*extra):
  return load_config(["config=llama8b.yml", *extra])


def model_flops() -> float:
  """6 N tokens + causal attention (6 B S^2 heads head_dim layers: half of the 12 of full attention)."""
  return 6 * MATMUL * B * S + 6 * B * S**2 * H * HD * L


def recomputed(parts) -> float:
  """The forward FLOPs of `parts` of every layer, redone in the backward pass."""
  per_token = {"qkv": 2 * D * (H + 2 * KV) * HD, "out": 2 * H * HD * D, "mlp": 2 * 3 * D * F,
               "attn": 2 * S * H * HD}  # causal: 4 x S/2 pairs x H x HD per token
  return B * S * L * sum(per_token[p] for p in parts)


@pytest.mark.parametrize("remat,parts", [("none", ()), ("save_dots", ("attn",)), ("save_qkv_attn", ("out", "mlp")),
                                         ("save_attn", ("qkv", "out", "mlp")),
                                         ("full", ("qkv", "out", "mlp", "attn"))])
def test_compute_is_the_flops_and_every_recomputed_flop_at_the_peak(remat, parts):
  assert PARAMS == 8030261248
  t = step_time(cfg(f"model.remat={remat}"), H200)
  assert t["compute_s"] == pytest.approx((model_flops() + recomputed(parts)) / PEAK, rel=1e-12)
  assert t["comm_s"] == 0 and t["accum_s"] == 0 and t["offload_s"] == 0  # one device, one micro-batch


@pytest.mark.parametrize("mu,nu,moment_bytes", [("float32", "float32", 8), ("bfloat16", "float32", 6),
                                                ("bfloat16", "bfloat16", 4)])
def test_optimizer_traffic_at_hbm_bandwidth_and_host_trips_at_the_host_link(mu, nu, moment_bytes):
  """The update reads parameter and gradient and writes the parameter (3 x 4 B) and reads and writes the moments
  (2 x their bytes) at HBM bandwidth; offloaded, the moments cross the host link in and out instead."""
  base = cfg("model.remat=save_attn", f"optim.mu_dtype={mu}", f"optim.nu_dtype={nu}")
  t = step_time(base, H200)
  assert t["optimizer_s"] == pytest.approx(PARAMS * (12 + 2 * moment_bytes) / HBM, rel=1e-12)
  assert t["total_s"] == pytest.approx(t["compute_s"] + t["optimizer_s"], rel=1e-12)
  off = step_time(cfg("model.remat=save_attn", f"optim.mu_dtype={mu}", f"optim.nu_dtype={nu}",
                      "optim.offload=host"), H200)
  assert off["optimizer_s"] == pytest.approx(PARAMS * 12 / HBM, rel=1e-12)
  assert off["offload_s"] == pytest.approx(2 * PARAMS * moment_bytes / HOST, rel=1e-12)


def test_accumulation_reads_the_weights_again_and_the_gradient_sum():
  """Per extra micro-batch: the bf16 weights of every GEMM read again for forward, recompute and backward
  (3 x 2 B x N) and the fp32 gradient sum read and written (2 x 4 B per parameter), at HBM bandwidth."""
  one, four = step_time(cfg("train.grad_accum=1"), H200), step_time(cfg("train.grad_accum=4"), H200)
  assert four["accum_s"] == pytest.approx(3 * (3 * 2 * MATMUL + 2 * 4 * PARAMS) / HBM, rel=1e-12)
  assert four["compute_s"] == one["compute_s"]
