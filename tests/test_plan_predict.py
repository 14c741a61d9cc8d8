"""maxlm/plan/predict.py: the predicted step time from a collectives inventory and the planner's roofline, with
the link times, the overlap, the compute (the pipeline's bubble in it), the memory terms and the tokens/s per
GPU worked out by hand from Llama 3 8B's shape and the H200's datasheet figures (no efficiency factor, no
fitted constant: compute at 57% of the peak, or recomputed FLOPs weighted by 0.42, fails these)."""

import pytest

from maxlm.config import load_config
from maxlm.plan import predict
from maxlm.plan.target import Target

GIB = 2 ** 30
# Llama 3 8B (as tests/test_plan_cost.py): d=4096, ffn=14336, 32 heads / 8 kv heads of 128, vocab 128256, 32 layers
D, F, H, KV, HD, V, L = 4096, 14336, 32, 8, 128, 128256, 32
LAYER = D * (H + 2 * KV) * HD + H * HD * D + 3 * D * F
PARAMS = L * LAYER + (2 * L + 1) * D + 2 * V * D
MATMUL = L * LAYER + D * V  # the MFU convention's N
S = 8192
PEAK, HBM, NVLINK, NET = 989e12, 4.8e12, 450e9, 50e9  # H200: bf16 FLOP/s, HBM, NVLink each way, NIC per GPU


def model_flops(b: int) -> float:
  """6 N tokens + causal attention (6 B S^2 heads head_dim layers), remat none: nothing recomputed."""
  return 6 * MATMUL * b * S + 6 * b * S ** 2 * H * HD * L


def _inventory(gather_ici=0.0, scatter_dcn=0.0, scatter_net=0.0, allreduce_ici=0.0, permute_dcn=0.0, ops=()):
  zero = {"count": 0, "bytes": 0, "wire": 0.0, "ici_wire": 0.0, "dcn_wire": 0.0, "network": 0.0}
  return {"all-gather": {**zero, "ici_wire": gather_ici}, "reduce-scatter": {**zero, "dcn_wire": scatter_dcn,
                                                                             "network": scatter_net},
          "all-reduce": {**zero, "ici_wire": allreduce_ici}, "all-to-all": zero,
          "collective-permute": {**zero, "dcn_wire": permute_dcn}, "exact": True, "ops": list(ops)}


def test_link_times_by_hand():
  # 450 GB within a node: 1 s at NVLink; across nodes 45 GB of wire (0.1 s at NVLink) but 25 GB through each NIC
  # (0.5 s at 50 GB/s): the NIC's 0.5 s
  s = predict.comm_seconds(_inventory(gather_ici=450e9, scatter_dcn=45e9, scatter_net=25e9), NVLINK, NET)
  assert s["all-gather"] == pytest.approx(1.0) and s["reduce-scatter"] == pytest.approx(0.5)
  assert s["all-reduce"] == 0


# the largest gather: 9 GB within the node (0.02 s); the largest scatter across nodes: 2.5 GB through the NIC
# (0.05 s): 0.07 s per micro-batch that cannot hide
OPS = [{"kind": "all-gather", "wire": 9e9, "network": 0.0, "nodes": 1},
       {"kind": "all-gather", "wire": 4.5e9, "network": 0.0, "nodes": 1},
       {"kind": "reduce-scatter", "wire": 1e9, "network": 2.5e9, "nodes": 2}]


@pytest.mark.parametrize("accum", [1, 4])
def test_the_step_is_what_cannot_hide_plus_the_longer_of_compute_and_the_rest_plus_memory(accum):
  cfg = load_config(["config=llama8b.yml", "model.remat=none", "data.global_batch_size=8",
                     f"train.grad_accum={accum}"])
  t = Target(8, 1, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")
  compute = model_flops(8) / (8 * PEAK)
  # fsdp 8: the update reads p, g and writes p (3 x 4 B) and reads and writes both float32 moments (2 x 8 B) of an
  # eighth of the parameters; each extra micro-batch reads the bf16 GEMM weights again 3 times and the fp32
  # gradient sum (an eighth) twice, at HBM bandwidth
  memory = (PARAMS / 8 * (12 + 16) + (accum - 1) * (3 * 2 * MATMUL + 2 * 4 * PARAMS / 8)) / HBM
  exposed = accum * (0.02 + 0.05)
  bound = _inventory(gather_ici=NVLINK * 2 * compute, ops=OPS)  # twice the compute at NVLink: the links bound it
  p = predict.predict(cfg, t, bound)
  assert p["compute_s"] == pytest.approx(compute, rel=1e-12) and p["bubble_s"] == 0
  assert p["memory_s"] == pytest.approx(memory, rel=1e-12)
  assert p["exposed_s"] == pytest.approx(exposed, rel=1e-12)
  assert p["step_s"] == pytest.approx(exposed + (2 * compute - exposed) + memory, rel=1e-12)
  assert p["tokens_per_s_per_gpu"] == pytest.approx(8 * S / p["step_s"] / 8, rel=1e-12)
  hidden = _inventory(gather_ici=NVLINK * 0.5 * compute, ops=OPS)  # half the compute: hidden but for `exposed`
  assert predict.predict(cfg, t, hidden)["step_s"] == pytest.approx(exposed + compute + memory, rel=1e-12)


def test_tensor_parallel_all_reduces_are_exposed():
  t = Target(16, 2, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")
  inv = _inventory(allreduce_ici=NVLINK * 0.01)
  tp = load_config(["config=llama8b.yml", "data.global_batch_size=16", "mesh.tensor=2"])
  assert predict.predict(tp, t, inv)["exposed_s"] == pytest.approx(0.01)  # activations': on the critical path
  dp = load_config(["config=llama8b.yml", "data.global_batch_size=16"])
  assert predict.predict(dp, t, inv)["exposed_s"] == 0  # the gradients' all-reduce alone hides behind compute


def test_pipeline_compute_holds_the_bubble_and_the_hand_offs_are_exposed():
  t = Target(16, 2, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")
  pp = load_config(["config=llama8b.yml", "model.remat=none", "model.scan_layers=true", "data.global_batch_size=16",
                    "mesh.dcn_pipeline=2", "mesh.dcn_data=1", "train.grad_accum=4"])
  # GPipe, 2 stages, 4 micro-batches: 5 ticks; the layers' work at each tick, the LM head once (its length split
  # over the stages)
  head = 6 * D * V * 16 * S
  work = (model_flops(16) - head) * 5 / 4 + head
  bubble = (model_flops(16) - head) * 1 / 4 / (16 * PEAK)  # (S - 1) / M of the layers' work: a fifth of 5/4
  inv = _inventory(allreduce_ici=NVLINK * 0.01, permute_dcn=NVLINK * 0.02, ops=OPS)
  p = predict.predict(pp, t, inv)
  assert p["compute_s"] == pytest.approx(work / (16 * PEAK), rel=1e-12)
  assert p["bubble_s"] == pytest.approx(bubble, rel=1e-12)
  # once per step (a pipeline overlaps its micro-batches): 0.07 s; the stages' sum and hand-offs: 0.03 s
  assert p["exposed_s"] == pytest.approx(0.07 + 0.01 + 0.02, rel=1e-12)
