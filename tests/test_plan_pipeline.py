"""The planner's model of the pipeline schedules (maxlm/plan/memory.py, cost.py, mesh_search.py) against hand
numbers: the activations each schedule keeps in flight, the stage weights gathered once per step, the bubble and
1f1b's recomputation, and the meshes whose layers do not split into S x V chunks left out."""

import pytest
from test_plan_cost import BASE, D70, H200_64, PEAK, TOKENS, V70
from test_plan_mesh_search import _degrees
from test_plan_memory import L8_LAYER

from maxlm.config import load_config
from maxlm.model import flops_per_step
from maxlm.plan import mesh_search
from maxlm.plan.cost import step_time
from maxlm.plan.memory import estimate

# Llama 3 8B (d 4096, ffn 14336, 32 heads, 8 KV heads of 128), 8192 tokens a row in bf16, remat full: each layer
# keeps its input (4096 per token), and one layer's backward everything it reads: 6 d + qkv (48 x 128) + context
# (32 x 128) + 3 ffn = 77824 per token.
L8 = ["config=llama8b", "model.loss_chunk=0", "model.scan_layers=true", "model.remat=full",
      "data.global_batch_size=32", "train.grad_accum=16", "mesh.pipeline=4", "mesh.fsdp=2"]
ONE_LAYER, INPUT = 6 * 4096 + 48 * 128 + 32 * 128 + 3 * 14336, 4096


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_the_activations_in_flight_per_schedule(schedule):
  """4 stages of 8 layers, 16 micro-batches of 2 rows (1 per fsdp device). GPipe and circular: every micro-batch
  in flight, 16 rows per device, each keeping its 8 layers' inputs plus one layer's backward. 1f1b: the inputs
  of min(M, 2 S - 1) = 7 micro-batches of 1 row, and one micro-batch's 8 layers (recomputed in its backward)."""
  est = estimate(load_config([*L8, f"train.pipeline_schedule={schedule}"]), 8)
  if schedule == "1f1b":
    want = 1 * 8192 * (7 * 4096 + 8 * INPUT + ONE_LAYER) * 2
  else:
    want = 16 * 8192 * (8 * INPUT + ONE_LAYER) * 2
  assert est["activations"] == want
  assert est["gathered"] == 0  # train.pipeline_gather=tick


def test_the_stage_weights_gathered_once_per_step():
  """train.pipeline_gather=step under fsdp 2: a stage's 8 layers (each L8_LAYER weights and 2 norms of 4096) whole,
  and their gradient sum, in float32, for the step: in the total and the certain part; nothing without fsdp."""
  tick, step = (estimate(load_config([*L8, f"train.pipeline_gather={g}"]), 8) for g in ("tick", "step"))
  assert step["gathered"] == 2 * 8 * (L8_LAYER + 2 * 4096) * 4
  assert step["total"] - tick["total"] == step["lower_bound"] - tick["lower_bound"] == step["gathered"]
  no_fsdp = estimate(load_config([*L8, "train.pipeline_gather=step", "mesh.fsdp=1", "mesh.data=2"]), 8)
  assert no_fsdp["gathered"] == 0


@pytest.mark.parametrize("micro", [4, 16])
def test_1f1b_costs_the_bubble_of_gpipe_and_one_more_forward(micro):
  """Llama 3 70B in 4 stages across nodes (test_plan_cost's setting): 1f1b's bubble is GPipe's (S - 1) / M of the
  layers' work, on a work that includes the layers' forward once more (a third of their 6 N tokens FLOPs: the
  backward phase recomputes it); the head (outside the recomputation) unchanged."""
  args = [*BASE, "mesh.dcn_pipeline=4", "mesh.dcn_data=1", "mesh.dcn_fsdp=-1", f"train.grad_accum={micro}"]
  t = step_time(load_config([*args, "train.pipeline_schedule=1f1b"]), H200_64)
  gpipe = step_time(load_config(args), H200_64)
  flops, head = flops_per_step(load_config(args).model, 256, 8192), 6 * D70 * V70 * TOKENS
  layers = (flops - head) * 4 / 3
  assert t["bubble_s"] == pytest.approx(layers * 3 / micro / (64 * PEAK), rel=1e-12)
  assert t["compute_s"] == pytest.approx((layers * (micro + 3) / micro + head) / (64 * PEAK), rel=1e-12)  # head once
  assert t["pipeline_s"] == gpipe["pipeline_s"] and t["bubble_s"] > gpipe["bubble_s"]


def test_meshes_whose_layers_do_not_split_into_stages_times_repeats_are_left_out():
  """The tiny model's 2 layers: 2 stages of 1 layer under GPipe, but not 2 stages x 2 circular repeats (4
  chunks); with 4 layers both."""
  def stages(args):
    return {_degrees(o)[1][0] for o in mesh_search.meshes(load_config(["config=tiny.yml", *args]), 8, 2)}
  circular = ["train.pipeline_schedule=circular", "train.pipeline_repeats=2"]
  assert stages([]) == {1, 2} and stages(circular) == {1}
  assert stages([*circular, "model.n_layers=4"]) == {1, 2}
