"""maxlm/plan/predict.py: the predicted step time from a collectives inventory and the compute estimate, with
the link times, the overlap, the pipeline bubble and the tokens/s per GPU worked out by hand."""

import pytest

from maxlm.config import load_config
from maxlm.plan import predict
from maxlm.plan.cost import step_time
from maxlm.plan.measure import Target

GIB = 2 ** 30


def _inventory(gather_ici=0.0, scatter_dcn=0.0, scatter_net=0.0, allreduce_ici=0.0, ops=()):
  zero = {"count": 0, "bytes": 0, "wire": 0.0, "ici_wire": 0.0, "dcn_wire": 0.0, "network": 0.0}
  return {"all-gather": {**zero, "ici_wire": gather_ici}, "reduce-scatter": {**zero, "dcn_wire": scatter_dcn,
                                                                             "network": scatter_net},
          "all-reduce": {**zero, "ici_wire": allreduce_ici}, "all-to-all": zero, "collective-permute": zero,
          "exact": True, "ops": list(ops)}


def test_link_times_by_hand():
  hw = predict.roofline("NVIDIA H200 141GB HBM3e")
  assert (hw.bf16, hw.nvlink, hw.network) == (989e12, 450e9, 50e9)
  assert predict.roofline("NVIDIA B200").nvlink == 900e9
  # 450 GB within a node: 1 s at NVLink; across nodes 45 GB of wire (0.1 s at NVLink) but 25 GB through each NIC
  # (0.5 s at 50 GB/s): the NIC's 0.5 s
  s = predict.comm_seconds(_inventory(gather_ici=450e9, scatter_dcn=45e9, scatter_net=25e9), hw)
  assert s["all-gather"] == pytest.approx(1.0) and s["reduce-scatter"] == pytest.approx(0.5)
  assert s["all-reduce"] == 0


def test_the_step_is_what_cannot_hide_plus_the_longer_of_compute_and_the_rest():
  cfg = load_config(["config=llama8b.yml", "model.n_layers=4", "data.global_batch_size=8"])
  t = Target(8, 1, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")
  compute = step_time(cfg, t)["compute_s"]
  # the largest gather: 9 GB within the node (0.02 s); the largest scatter across nodes: 2.5 GB through the NIC
  # (0.05 s); both once per micro-batch (1): 0.07 s that cannot hide
  ops = [{"kind": "all-gather", "wire": 9e9, "network": 0.0, "nodes": 1},
         {"kind": "all-gather", "wire": 4.5e9, "network": 0.0, "nodes": 1},
         {"kind": "reduce-scatter", "wire": 1e9, "network": 2.5e9, "nodes": 2}]
  inv = _inventory(gather_ici=450e9 * 2 * compute, ops=ops)  # twice the compute at NVLink: bound by the links
  p = predict.predict(cfg, t, inv)
  assert p["compute_s"] == compute and p["exposed_s"] == pytest.approx(0.02 + 0.05)
  assert p["step_s"] == pytest.approx(0.07 + (2 * compute - 0.07))
  assert p["tokens_per_s_per_gpu"] == pytest.approx(8 * 8192 / p["step_s"] / 8)
  inv = _inventory(gather_ici=450e9 * 0.5 * compute, ops=ops)  # half the compute: hidden but for 0.07 s
  assert predict.predict(cfg, t, inv)["step_s"] == pytest.approx(0.07 + compute)


def test_tensor_parallel_all_reduces_and_the_pipeline_bubble():
  t = Target(16, 2, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")
  tp = load_config(["config=llama8b.yml", "model.n_layers=4", "data.global_batch_size=16", "mesh.tensor=2"])
  p = predict.predict(tp, t, _inventory(allreduce_ici=450e9 * 0.01))
  assert p["exposed_s"] == pytest.approx(0.01)  # activations' all-reduces: on the critical path
  pp = load_config(["config=llama8b.yml", "model.n_layers=4", "model.scan_layers=true", "data.global_batch_size=16",
                    "mesh.dcn_pipeline=2", "mesh.dcn_data=1", "train.grad_accum=4"])
  p = predict.predict(pp, t, _inventory())
  # GPipe with 2 stages over 4 micro-batches: a stage waits (2 - 1) / (4 + 2 - 1) = 1/5 of the step
  assert p["bubble"] == pytest.approx(0.2)
  assert p["compute_s"] == pytest.approx(step_time(pp, t)["compute_s"] / 0.8)
