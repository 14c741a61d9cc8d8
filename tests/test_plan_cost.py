"""The planner's roofline step-time estimate (maxlm/plan/cost.py) against the roofline written out here from the
8B's shape and the H200's datasheet figures: no efficiency factor and no fitted constant anywhere (a recomputed
FLOP weighted by a fitted 0.42, or 5.0, or compute at 57% of the peak, fails every test here); and, with pipeline
stages, the bubble, the head once (its length split over the stages) and the hand-offs between stages, with
arithmetic written out here.
The planner offers no fewer micro-batches than stages."""

import dataclasses

import pytest

from maxlm.plan import levers as plan_levers

from maxlm.config import load_config
from maxlm.model import count_params, flops_per_step
from maxlm.plan.cost import context_exchange_bytes as cost_context_exchange, step_time
from maxlm.plan.target import Target

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
  (2 x their bytes) at HBM bandwidth; offloaded, the moments cross the host link in and out instead (and with
  host_params the parameters three times)."""
  base = cfg("model.remat=save_attn", f"optim.mu_dtype={mu}", f"optim.nu_dtype={nu}")
  t = step_time(base, H200)
  assert t["optimizer_s"] == pytest.approx(PARAMS * (12 + 2 * moment_bytes) / HBM, rel=1e-12)
  assert t["total_s"] == pytest.approx(t["compute_s"] + t["optimizer_s"], rel=1e-12)
  off = step_time(cfg("model.remat=save_attn", f"optim.mu_dtype={mu}", f"optim.nu_dtype={nu}",
                      "optim.offload=host"), H200)
  assert off["optimizer_s"] == pytest.approx(PARAMS * 12 / HBM, rel=1e-12)
  assert off["offload_s"] == pytest.approx(2 * PARAMS * moment_bytes / HOST, rel=1e-12)
  # host_params: the float32 parameters cross too, in for the forward and backward passes, in and out for the
  # update (3 x 4 B), beside the moments; the update's HBM traffic is the same as host's
  both = step_time(cfg("model.remat=save_attn", f"optim.mu_dtype={mu}", f"optim.nu_dtype={nu}",
                       "optim.offload=host_params"), H200)
  assert both["optimizer_s"] == pytest.approx(PARAMS * 12 / HBM, rel=1e-12)
  assert both["offload_s"] == pytest.approx(PARAMS * (2 * moment_bytes + 12) / HOST, rel=1e-12)
  assert both["total_s"] == pytest.approx(both["compute_s"] + both["optimizer_s"] + both["offload_s"], rel=1e-12)


def test_accumulation_reads_the_weights_again_and_the_gradient_sum():
  """Per extra micro-batch: the bf16 weights of every GEMM read again for forward, recompute and backward
  (3 x 2 B x N) and the fp32 gradient sum read and written (2 x 4 B per parameter), at HBM bandwidth."""
  one, four = step_time(cfg("train.grad_accum=1"), H200), step_time(cfg("train.grad_accum=4"), H200)
  assert four["accum_s"] == pytest.approx(3 * (3 * 2 * MATMUL + 2 * 4 * PARAMS) / HBM, rel=1e-12)
  assert four["compute_s"] == one["compute_s"]


# ---- pipeline stages (maxlm/parallel/pipelining.py): Llama 3 70B on 64 H200s, 8 nodes of 8 ----
H200_64 = Target(64, 8, "NVIDIA H200", 141 * 10**9, None, True)
NVLINK, NET = 450e9, 50e9  # H200 NVLink and network bytes/s (maxlm/plan/cost.py)
# Llama 3 70B (llama70b.yml) at batch 256 x 8192, no recomputation (remat none), scanned
BASE = ["config=llama70b", "data.global_batch_size=256", "model.remat=none", "model.scan_layers=true"]
D70, V70, L70, TOKENS = 8192, 128256, 80, 256 * 8192


@pytest.mark.parametrize("micro", [4, 16])
def test_four_stages_across_nodes_cost_the_bubble_the_head_and_the_hand_offs(micro):
  cfg = load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", "mesh.dcn_fsdp=-1", f"train.grad_accum={micro}"])
  t = step_time(cfg, H200_64)
  flops = flops_per_step(cfg.model, 256, 8192)
  head = 6 * D70 * V70 * TOKENS  # the LM head's GEMMs, forward and backward
  ticks = micro + 3
  # every stage computes at every tick; the head once, on the whole batch, its length split over the 4 stages
  assert t["compute_s"] == pytest.approx(((flops - head) * ticks / micro + head) / (64 * PEAK), rel=1e-12)
  assert t["bubble_s"] == pytest.approx((flops - head) * 3 / micro / (64 * PEAK), rel=1e-12)
  # per tick, forward and backward: [256 / M / 16 rows, 8192, 8192] in bf16 handed on, and summed over 4 stages
  # (an all-reduce: 2 x 3 / 4 of it through each device), over the network (the stages are on different nodes)
  act = 256 / micro / 16 * 8192 * D70 * 2
  assert t["pipeline_s"] == pytest.approx(ticks * 2 * act * (1 + 1.5) / NET, rel=1e-12)
  assert t["total_s"] >= t["compute_s"] + t["pipeline_s"]


def test_more_micro_batches_shrink_the_bubble_and_no_pipeline_has_none():
  piped = [step_time(load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", f"train.grad_accum={m}"]), H200_64)
           for m in (4, 8, 16)]
  assert piped[0]["bubble_s"] > piped[1]["bubble_s"] > piped[2]["bubble_s"] > 0
  # the bubble's share of the layers' compute: (S - 1) / (M + S - 1)
  for m, t in zip((4, 8, 16), piped):
    head = 6 * D70 * V70 * TOKENS / (64 * PEAK)
    assert t["bubble_s"] / (t["compute_s"] - head) == pytest.approx(3 / (m + 3), rel=1e-12)
  flat = step_time(load_config([*BASE, "train.grad_accum=4"]), H200_64)
  assert flat["bubble_s"] == flat["pipeline_s"] == 0


def test_the_planner_offers_no_fewer_micro_batches_than_stages():
  cfg = load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", "train.grad_accum=4",
                     "plan.levers=train.grad_accum"])
  values = plan_levers.lever_values(cfg, H200_64, "te")["train.grad_accum"]
  assert values == (4, 8, 16)  # 256 rows over fsdp 16: up to 16 micro-batches; a pipeline of 4 needs 4 at least


def test_a_circular_schedule_cuts_the_bubble_and_a_gather_once_the_fsdp_traffic():
  """Circular, V = 2 repeats over M = 4: 2 x 4 + 3 = 11 ticks, each running half a stage's layers (so the
  layers' compute is 11/8 of the useful, the bubble 3/8 of it where GPipe's is 3/4); the hand-offs per tick as
  GPipe's, 11 of them. train.pipeline_gather=step: the stage's layers gathered once, not at each tick."""
  cfg = load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", "mesh.dcn_fsdp=-1", "train.grad_accum=4",
                     "train.pipeline_schedule=circular", "train.pipeline_repeats=2"])
  t = step_time(cfg, H200_64)
  flops = flops_per_step(cfg.model, 256, 8192)
  head = 6 * D70 * V70 * TOKENS
  assert t["compute_s"] == pytest.approx(((flops - head) * 11 / 8 + head) / (64 * PEAK), rel=1e-12)
  assert t["bubble_s"] == pytest.approx((flops - head) * 3 / 8 / (64 * PEAK), rel=1e-12)
  act = 256 / 4 / 16 * 8192 * D70 * 2
  assert t["pipeline_s"] == pytest.approx(11 * 2 * act * (1 + 1.5) / NET, rel=1e-12)
  # FSDP over 16 (no data, context or tensor traffic): 2 bf16 gathers and a scatter of what a device passes
  # through, 2 (16 - 1) / 16 of it over NVLink; per tick (11 ticks of half the stage's 20 layers: 5.5 passes)
  # or once; the embedding, head and final norm once
  counts = count_params(cfg.model)
  layers, other = counts["layers"] / 4, counts["total"] - counts["layers"]
  for gather, passes in (("tick", 11 / 2), ("step", 1)):
    c = step_time(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pipeline_gather=gather)), H200_64)
    assert c["comm_s"] == pytest.approx(3 * (layers * passes + other) * 2 * 15 / 16 / NVLINK, rel=1e-12), gather


@pytest.mark.parametrize("strategy,grad_bytes", [("all_gather", 4), ("ring", 2)])
def test_context_exchange_bytes_by_hand(strategy, grad_bytes):
  """The 8B at 131,072 tokens on context 8, one row: per layer each device receives the other 7 devices' K and V
  blocks [1, 16384, 8 KV heads, 128] twice in bf16 (the forward and the backward's recomputation), and their
  gradients once: bf16 around the ring, float32 through the all-gather's reduce-scatter."""
  cfg = load_config(["config=llama8b.yml", "data.seq_len=131072", "data.global_batch_size=1", "mesh.context=8",
                     "mesh.fsdp=1", f"mesh.context_strategy={strategy}"])
  block = 16384 * 8 * 128  # elements of one device's K (or V) block
  per_layer = 2 * 7 * block * (2 * 2 + grad_bytes)  # K and V, 7 other devices
  assert cost_context_exchange(cfg, {"context": 8, "pipeline": 1, "data": 1, "fsdp": 1}) == 32 * per_layer
  one = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, context=1))
  assert cost_context_exchange(one, {"context": 1, "pipeline": 1, "data": 1, "fsdp": 1}) == 0
