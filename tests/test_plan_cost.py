"""The planner's step-time estimate with pipeline stages (maxlm/plan/cost.py): the bubble, the head on every
stage, the hand-offs between stages, checked against arithmetic written out here; and the planner offers no
fewer micro-batches than stages."""

import pytest

from maxlm import plan
from maxlm.config import load_config
from maxlm.model import flops_per_step
from maxlm.plan.cost import MFU, step_time
from maxlm.plan.measure import Target

H200 = Target(64, 8, "NVIDIA H200", 141 * 10**9, None, True)  # 8 nodes of 8
PEAK, NVLINK, NET = 989e12, 450e9, 50e9  # H200 bf16 FLOP/s, NVLink and network bytes/s (maxlm/plan/cost.py)
# Llama 3 70B (llama70b.yml) at batch 256 x 8192, no recomputation (remat none), scanned
BASE = ["config=llama70b", "data.global_batch_size=256", "model.remat=none", "model.scan_layers=true"]
D, V, L, TOKENS = 8192, 128256, 80, 256 * 8192


@pytest.mark.parametrize("micro", [4, 16])
def test_four_stages_across_nodes_cost_the_bubble_the_head_and_the_hand_offs(micro):
  cfg = load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", "mesh.dcn_fsdp=-1", f"train.grad_accum={micro}"])
  t = step_time(cfg, H200)
  flops = flops_per_step(cfg.model, 256, 8192)
  head = 6 * D * V * TOKENS  # the LM head's GEMMs, forward and backward
  ticks = micro + 3
  # every stage computes at every tick; the head once per stage, on the whole batch
  assert t["compute_s"] == pytest.approx(((flops - head) * ticks / micro + 4 * head) / (64 * PEAK * MFU), rel=1e-12)
  assert t["bubble_s"] == pytest.approx((flops - head) * 3 / micro / (64 * PEAK * MFU), rel=1e-12)
  # per tick, forward and backward: [256 / M / 16 rows, 8192, 8192] in bf16 handed on, and summed over 4 stages
  # (an all-reduce: 2 x 3 / 4 of it through each device), over the network (the stages are on different nodes)
  act = 256 / micro / 16 * 8192 * D * 2
  assert t["pipeline_s"] == pytest.approx(ticks * 2 * act * (1 + 1.5) / NET, rel=1e-12)
  assert t["total_s"] >= t["compute_s"] + t["pipeline_s"]


def test_more_micro_batches_shrink_the_bubble_and_no_pipeline_has_none():
  piped = [step_time(load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", f"train.grad_accum={m}"]), H200)
           for m in (4, 8, 16)]
  assert piped[0]["bubble_s"] > piped[1]["bubble_s"] > piped[2]["bubble_s"] > 0
  # the bubble's share of the layers' compute: (S - 1) / (M + S - 1)
  for m, t in zip((4, 8, 16), piped):
    head = 6 * D * V * TOKENS / (64 * PEAK * MFU) * 4
    assert t["bubble_s"] / (t["compute_s"] - head) == pytest.approx(3 / (m + 3), rel=1e-12)
  flat = step_time(load_config([*BASE, "train.grad_accum=4"]), H200)
  assert flat["bubble_s"] == flat["pipeline_s"] == 0


def test_the_planner_offers_no_fewer_micro_batches_than_stages():
  cfg = load_config([*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", "train.grad_accum=4",
                     "plan.levers=train.grad_accum"])
  values = plan.lever_values(cfg, H200, "te")["train.grad_accum"]
  assert values == (4, 8, 16)  # 256 rows over fsdp 16: up to 16 micro-batches; a pipeline of 4 needs 4 at least
