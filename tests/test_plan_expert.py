"""The planner with expert parallelism (maxlm/plan/memory.py, cost.py): Mixtral 8 x 7B's memory per device and its
all-to-all traffic per step against numbers written out here from its published shape and the H200's datasheet; the
collectives inventory of a compiled exchange."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm.cli.train import main
from maxlm.config import load_config
from maxlm.parallel import experts
from maxlm.plan import collectives, memory
from maxlm.plan.cost import expert_exchange_bytes, step_time
from maxlm.plan.target import Target

# Mixtral 8 x 7B (mistralai/Mixtral-8x7B-v0.1's config.json): d 4096, 8 experts of width 14336, top 2, 32 blocks;
# 46,702,792,704 parameters. mistral7b.yml's batch: 8 rows of 8192 tokens (one micro-batch).
D, F, E, K, L, TOTAL = 4096, 14336, 8, 2, 32, 46_702_792_704
B, S = 8, 8192
NVLINK = 450e9  # H200: NVLink bytes/s one way, as maxlm/tables.py has it (datasheet 900 GB/s both ways)
H200x8 = Target(8, 1, "NVIDIA H200", 141 * 10**9, 0.95, True)


def mixtral(*extra):
  return load_config(["config=mixtral8x7b.yml", "model.loss_chunk=0", *extra])


@pytest.mark.parametrize("mesh", [["mesh.expert=8", "mesh.fsdp=1"], ["mesh.expert=2", "mesh.fsdp=4"],
                                  ["mesh.expert=1", "mesh.fsdp=8"]])
def test_memory_of_mixtral_on_8_devices(mesh):
  """Each device holds E / ep experts with their D over fsdp, and a fsdp x expert-th of the dense weights (ZeRO
  over the expert group too): an 8th of the 46.7B float32 parameters whatever the split, its gradients, and Adam's
  two float32 moments. The exchange: send and receive buffers of ep slots of N k rows of D in bf16, N = 8 x 8192
  / 8 tokens per device."""
  est = memory.estimate(mixtral(*mesh), 8)
  ep = int(mesh[0].split("=")[1])
  assert est["params"] == est["gradients"] == TOTAL * 4 // 8
  assert est["optimizer"] == TOTAL * 8 // 8
  n = B * S // 8
  assert est["exchange"] == (2 * ep * n * K * D * 2 if ep > 1 else 0)  # ep 8: 2 x 8 x 8192 x 2 x 4096 x 2 = 2 GiB
  assert est["total"] - est["exchange"] == memory.estimate(mixtral("mesh.expert=1", "mesh.fsdp=8"), 8)["total"]


def test_all_to_all_bytes_and_time_of_mixtral_on_8_devices():
  """4 all-to-alls per MoE layer (2 forward, 2 backward), each of ep slots of N k rows of D in bf16, 7/8 of it
  leaving the device: 32 x 4 x 8 x 8192 x 2 x 4096 x 2 x 7 / 8 bytes, at NVLink bandwidth, on the critical path."""
  cfg = mixtral("mesh.expert=8", "mesh.fsdp=1")
  n = B * S // 8
  want = L * 4 * 8 * n * K * D * 2 * 7 / 8  # 120.3 GB: 0.267 s at 450 GB/s
  assert expert_exchange_bytes(cfg, {"data": 1, "fsdp": 1, "expert": 8, "context": 1}) == want
  t = step_time(cfg, H200x8)
  assert t["expert_s"] == pytest.approx(want / NVLINK, rel=1e-12)
  dense = step_time(mixtral("mesh.expert=1", "mesh.fsdp=8"), H200x8)
  assert dense["expert_s"] == 0
  # twice the batch in two micro-batches: twice the exchanges, each of the same rows
  acc = mixtral("mesh.expert=8", "mesh.fsdp=1", "data.global_batch_size=16", "train.grad_accum=2")
  assert expert_exchange_bytes(acc, {"data": 1, "fsdp": 1, "expert": 8, "context": 1}) == 2 * want


def test_expert_parallel_fsdp_traffic_gathers_only_the_local_experts():
  """expert 8: every dense weight's D is split over the 8 devices of the expert axis (gathered, 3 x 2 B x 7/8 per
  weight), the experts not at all (each device holds its one expert whole): against expert 1 x fsdp 8, where
  every device gathers all 8 experts."""
  blocks = L * (D * (32 + 2 * 8) * 128 + 32 * 128 * D + D * E)  # attention and router weights
  other = TOTAL - L * E * 3 * D * F - blocks  # norms, embedding, head
  t = step_time(mixtral("mesh.expert=8", "mesh.fsdp=1"), H200x8)
  want = 3 * 2 * (blocks + other) * 7 / 8 / NVLINK
  data = 0.0  # data 1: no all-reduce
  assert t["comm_s"] == pytest.approx(want + data, rel=1e-9)


def test_the_collectives_inventory_reads_the_exchange_compiled_by_xla_cpu():
  """The gradient of a loss through the exchange on 4 devices of an expert axis, compiled by XLA:CPU: 4 all-to-alls
  of ep slots of N k rows of D (N = 32 / 4 = 8 tokens a device, k = 2, D = 8, float32: 4 x 16 x 8 x 4 = 2048 B
  each; dispatch and combine forward, their transposes backward) and one of the counts per (device, local
  expert) (4 x 2 int32 = 32 B); (ep - 1) / ep of each leaves the device."""
  n, d, e, k, ep = 32, 8, 8, 2, 4
  mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))  # axis types Auto, as maxlm's meshes
  rows = lambda rows, p, sizes: jax.lax.ragged_dot(rows, p, sizes)  # one linear expert each: [L, D, D]

  def loss(x, w, weights, chosen):
    return jnp.sum(experts.apply(rows, x, weights, chosen, w, n_experts=e, name="expert", ep=ep) ** 2)

  with jax.set_mesh(mesh), nn.logical_axis_rules([("activation_batch", "expert"), ("expert", "expert")]):
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((e, d, d), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32))
    shardings = tuple(NamedSharding(mesh, P("expert")) for _ in args)
    text = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=shardings).lower(*args).compile().as_text()
  inv = collectives.inventory(text, devices_per_node=ep, n_devices=ep)["all-to-all"]
  slots = ep * (n // ep) * k * d * 4
  assert inv["count"] == 5 and inv["bytes"] == 4 * slots + ep * (e // ep) * 4
  assert inv["wire"] == pytest.approx((4 * slots + 32) * (ep - 1) / ep) and inv["dcn_wire"] == 0


def test_the_dry_run_reports_the_expert_split_and_the_exchange(capsys):
  """`--dry-run` of Mixtral on 8 devices at expert 8: the mesh line names expert 8, the parameters an 8th each
  (46,702,792,704 x 4 B / 8 = 21.7 GiB), the exchange's 2 x 8 x 8192 x 2 x 4096 x 2 B = 2.0 GiB."""
  code = main(["--dry-run", "config=mixtral8x7b.yml", "mesh.expert=8", "mesh.fsdp=1", "--devices", "8",
               "--device-memory-gb", "141"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "pipeline 1 x data 1 x fsdp 1 x expert 8 x context 1 x tensor 1" in out
  assert "params         21.7 GiB   float32, sharded over fsdp x context x expert x tensor" in out
  assert "exchange        2.0 GiB   one MoE layer's all-to-all buffers over expert 8" in out
  dense = main(["--dry-run", "config=llama8b.yml", "--devices", "8", "--device-memory-gb", "141"])
  text = capsys.readouterr().out
  assert dense == 0 and "exchange" not in text and "x expert" not in text


def test_fsdp_traffic_of_the_experts_at_expert_2():
  """expert 2 x fsdp 4: the dense weights gathered over all 8 (3 x 2 B x 7/8 per weight); each device's 4 experts
  of every layer over its fsdp group of 4, in float32 (2 gathers x 4 B + a 4 B scatter, x 3/4); expert 1 x fsdp 8:
  every expert gathered in bf16 over 8 (3 x 2 B x 7/8), as the dense weights."""
  experts_all = L * E * 3 * D * F
  dense = TOTAL - experts_all
  t = step_time(mixtral("mesh.expert=2", "mesh.fsdp=4"), H200x8)
  assert t["comm_s"] == pytest.approx((3 * 2 * dense * 7 / 8 + 12 * experts_all / 2 * 3 / 4) / NVLINK, rel=1e-9)
  flat = step_time(mixtral("mesh.expert=1", "mesh.fsdp=8"), H200x8)
  assert flat["comm_s"] == pytest.approx(3 * 2 * TOTAL * 7 / 8 / NVLINK, rel=1e-9)
