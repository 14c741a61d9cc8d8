"""maxlm/plan/collectives.py: the collectives of a compiled step read from its HLO text, with counts and bytes
worked out by hand here (a written HLO module and a small program with known collectives, compiled by XLA:CPU
on 8 simulated devices and, where JAX's CUDA plugin is installed, by XLA:GPU for 8 compile-only GPUs)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxlm.config import load_config
from maxlm.plan import collectives
from maxlm.plan import xla_gpu as target

# Written in XLA's text form: a while loop (5 trips) holding an asynchronous all-gather and a reduce-scatter
# wrapped in an async computation (groups of 4 within a node of 4 devices); a conditional whose branch
# all-reduces over pairs {i, i + 4} (across nodes); an all-reduce in the mesh spelling over axis x (pairs
# {i, i + 4}); a collective-permute with one pair across nodes; a loop of unknown trip count with an
# all-gather in groups [4,2]<=[2,4]T(1,0) = {0,4},{1,5},{2,6},{3,7}.
HLO = textwrap.dedent("""\
    HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[16,8]{1,0}, f32[32]{0}, pred[])->f32[32]{0}}

    %add (a: bf16[], b: bf16[]) -> bf16[] {
      %a = bf16[] parameter(0)
      %b = bf16[] parameter(1)
      ROOT %sum = bf16[] add(%a, %b)
    }

    %scatter_wrapped (p: bf16[64,8]) -> bf16[16,8] {
      %p = bf16[64,8]{1,0} parameter(0)
      ROOT %rs = bf16[16,8]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
    }

    %body (carry: (s32[], bf16[16,8])) -> (s32[], bf16[16,8]) {
      %carry = (s32[], bf16[16,8]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%carry), index=0
      %x = bf16[16,8]{1,0} get-tuple-element(%carry), index=1
      %ag-start = ((bf16[16,8]{1,0}), bf16[64,8]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
      %ag-done = bf16[64,8]{1,0} all-gather-done(%ag-start), metadata={op_name="jit(step)/while/body/calls=%nothing"}
      %rs-start = ((bf16[64,8]{1,0}), bf16[16,8]{1,0}, s32[]) async-start(%ag-done), calls=%scatter_wrapped
      %rs-done = bf16[16,8]{1,0} async-done(%rs-start)
      ROOT %t = (s32[], bf16[16,8]{1,0}) tuple(%i, %rs-done)
    }

    %cond (carry: (s32[], bf16[16,8])) -> pred[] {
      %carry = (s32[], bf16[16,8]{1,0}) parameter(0)
      ROOT %p = pred[] constant(true)
    }

    %sum32 (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(%a, %b)
    }

    %then (y: f32[32]) -> f32[32] {
      %y = f32[32]{0} parameter(0)
      ROOT %ar = f32[32]{0} all-reduce(%y), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%sum32
    }

    %else (y: f32[32]) -> f32[32] {
      ROOT %y = f32[32]{0} parameter(0)
    }

    %loose_body (c: f32[8]) -> f32[8] {
      %c = f32[8]{0} parameter(0)
      %g = f32[16]{0} all-gather(%c), channel_id=6, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
      ROOT %s = f32[8]{0} slice(%g), slice={[0:8]}
    }

    %loose_cond (c: f32[8]) -> pred[] {
      %c = f32[8]{0} parameter(0)
      ROOT %p = pred[] constant(true)
    }

    ENTRY %main (x: bf16[16,8], y: f32[32], q: pred[]) -> f32[32] {
      %x = bf16[16,8]{1,0} parameter(0)
      %y = f32[32]{0} parameter(1)
      %q = pred[] parameter(2)
      %zero = s32[] constant(0)
      %init = (s32[], bf16[16,8]{1,0}) tuple(%zero, %x)
      %loop = (s32[], bf16[16,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
      %branch = f32[32]{0} conditional(%q, %y, %y), true_computation=%then, false_computation=%else
      %mesh_ar = f32[32]{0} all-reduce(%branch), channel_id=5, replica_groups=mesh['x'=2,'y'=4] {'x'}, to_apply=%sum32
      %perm = f32[32]{0} collective-permute(%mesh_ar), channel_id=7, source_target_pairs={{0,1},{1,2},{3,4}}
      %c0 = f32[8]{0} slice(%perm), slice={[0:8]}
      %loose = f32[8]{0} while(%c0), condition=%loose_cond, body=%loose_body
      ROOT %out = f32[32]{0} add(%perm, %perm)
    }
    """)


def test_parse_counts_bytes_and_links_of_a_written_module():
  ops = {c.name: c for c in collectives.parse(HLO, devices_per_node=4, n_devices=8)}
  assert set(ops) == {"ag-done", "rs", "ar", "mesh_ar", "perm", "g"}
  # all-gather: the gathered bf16[64,8] = 1024 B, 5 trips, groups {0..3} {4..7} inside a node; a ring sends 3/4
  assert (ops["ag-done"].bytes, ops["ag-done"].group, ops["ag-done"].times, ops["ag-done"].dcn) == (1024, 4, 5, False)
  assert ops["ag-done"].wire == 768
  # reduce-scatter (in the async wrapper): the full operand = the bf16[16,8] result (256 B) x 4
  assert (ops["rs"].bytes, ops["rs"].group, ops["rs"].times, ops["rs"].dcn) == (1024, 4, 5, False)
  # all-reduce f32[32] = 128 B over pairs across nodes (4 devices a node); a ring moves 2 (n - 1) / n = 1x
  assert (ops["ar"].bytes, ops["ar"].group, ops["ar"].times, ops["ar"].dcn, ops["ar"].wire) == (128, 2, 1, True, 128)
  assert (ops["mesh_ar"].group, ops["mesh_ar"].dcn) == (2, True)  # axis x of [2, 4]: {0,4}, {1,5}, ...
  assert (ops["perm"].bytes, ops["perm"].dcn, ops["perm"].wire) == (128, True, 128)  # {3,4} crosses nodes
  # the loop without a known trip count: counted once, and said so; groups {0,4},{1,5},... cross nodes
  assert (ops["g"].bytes, ops["g"].group, ops["g"].times, ops["g"].exact, ops["g"].dcn) == (64, 2, 1, False, True)
  inv = collectives.inventory(HLO, devices_per_node=4, n_devices=8)
  # through each GPU's NIC: a pair across 2 nodes (one device a node) takes in the half on the other node, 32 B
  # of the 64 B gather; an all-reduce twice that (2 x 64 B of each 128 B one); the permute its 128 B
  assert inv["all-gather"] == {"count": 6, "bytes": 5 * 1024 + 64, "wire": 5 * 768 + 32, "ici_wire": 5 * 768,
                               "dcn_wire": 32, "network": 32}
  assert inv["reduce-scatter"]["count"] == 5 and inv["reduce-scatter"]["bytes"] == 5 * 1024
  assert inv["all-reduce"] == {"count": 2, "bytes": 256, "wire": 256, "ici_wire": 0, "dcn_wire": 256, "network": 256}
  assert inv["collective-permute"]["network"] == 128
  assert inv["exact"] is False
  # one node of 8: nothing crosses nodes
  assert collectives.inventory(HLO, devices_per_node=8, n_devices=8)["all-reduce"]["dcn_wire"] == 0


def test_network_share_of_a_gather_over_nodes():
  # 64 devices, 8 a node, one group of all: a node takes in the 7/8 of the buffer on other nodes over its 8 NICs
  c = collectives.Collective("all-gather", "g", 8 * 2 ** 20, 64, 1, True, True, 8)
  assert c.network == 8 * 2 ** 20 * 7 / 8 / 8 and c.wire == 8 * 2 ** 20 * 63 / 64
  assert collectives.Collective("all-to-all", "a", 1024, 16, 1, True, True, 2).network == 512
  assert collectives.Collective("all-reduce", "r", 1024, 8, 1, False, True, 1).network == 0


def test_fsdp_expectation_by_hand():
  m = load_config(["config=tiny.yml"]).model  # d 128, 2 layers, 4 heads, 2 kv heads of 32, ffn 384, vocab 8192
  layer = 128 * (4 + 2 * 2) * 32 + 4 * 32 * 128 + 3 * 128 * 384  # qkv, out, mlp: 196,608 weights
  head = 128 * 8192
  weights = (2 * layer + head) * 2  # bf16
  assert collectives.fsdp_expectation(m, 1, {"fsdp": 8, "tensor": 1}) == {"all-gather": 2 * weights,
                                                                          "reduce-scatter": weights}
  assert collectives.fsdp_expectation(m, 4, {"fsdp": 8, "tensor": 2}) == {"all-gather": 4 * weights,
                                                                          "reduce-scatter": 2 * weights}
  assert collectives.fsdp_expectation(m, 2, {"fsdp": 2, "pipeline": 2}) == {
      "all-gather": 4 * (layer + head) * 2, "reduce-scatter": 2 * (layer + head) * 2}
  assert collectives.fsdp_expectation(m, 1, {"fsdp": 1, "data": 8}) == {"all-gather": 0, "reduce-scatter": 0}
  # context alone splits the parameters too (maxlm/parallel/sharding.py ZERO): gathered as over fsdp
  assert collectives.fsdp_expectation(m, 1, {"fsdp": 1, "context": 2}) == {"all-gather": 2 * weights,
                                                                           "reduce-scatter": weights}


# A loop without known_trip_count, as XLA:GPU leaves jax's scan over micro-batches (its first trip peeled): the
# condition is a fusion comparing the induction variable (tuple index 0, initially 1) with 4: 3 trips
DERIVED = textwrap.dedent("""\
    HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

    %sum (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %body (c: (s32[], f32[8])) -> (s32[], f32[8]) {
      %c = (s32[], f32[8]{0}) parameter(0)
      %i = s32[] get-tuple-element(%c), index=0
      %x = f32[8]{0} get-tuple-element(%c), index=1
      %r = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%sum
      ROOT %t = (s32[], f32[8]{0}) tuple(%i, %r)
    }

    %fused_compare (p: s32[]) -> pred[] {
      %p = s32[] parameter(0)
      %four = s32[] constant(4)
      ROOT %lt = pred[] compare(%p, %four), direction=LT
    }

    %cond (c: (s32[], f32[8])) -> pred[] {
      %c = (s32[], f32[8]{0}) parameter(0)
      %i = s32[] get-tuple-element(%c), index=0
      ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
    }

    ENTRY %main (x: f32[8]) -> f32[8] {
      %x = f32[8]{0} parameter(0)
      %one = s32[] constant(1)
      %init = (s32[], f32[8]{0}) tuple(%one, %x)
      %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
      ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
    }
    """)


def test_a_loop_trip_count_read_off_its_condition():
  (op,) = collectives.parse(DERIVED, devices_per_node=8, n_devices=8)
  assert (op.kind, op.times, op.exact, op.bytes, op.group) == ("all-reduce", 3, True, 32, 8)
  # the bound on the left (4 > i) counts the same; an initial value that is not a constant is not guessed
  flipped = DERIVED.replace("compare(%p, %four), direction=LT", "compare(%four, %p), direction=GT")
  assert collectives.parse(flipped, 8, 8)[0].times == 3
  unknown = DERIVED.replace("tuple(%one, %x)", "tuple(%x2, %x)").replace("%one = s32[] constant(1)",
                                                                        "%x2 = s32[] parameter(1)")
  assert (collectives.parse(unknown, 8, 8)[0].times, collectives.parse(unknown, 8, 8)[0].exact) == (1, False)


def test_mesh_groups_with_a_device_order_and_unread_spellings():
  line = "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, dimensions={0}"
  # devices [0..7] as [4, 2], transposed, flattened: 0 2 4 6 1 3 5 7; as a [2, 4] mesh: [[0 2 4 6] [1 3 5 7]];
  # varying a: {0,1} {2,3} {4,5} {6,7} (without the device order it would be {0,4} {1,5} ...)
  assert collectives._groups(line, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert collectives._groups("replica_groups=mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'b'}", 8) == [
      [7, 6, 5, 4], [3, 2, 1, 0]]
  assert collectives._groups("replica_groups={}, dimensions={0}", 4) == [[0, 1, 2, 3]]  # all devices
  with pytest.raises(ValueError, match="unread replica_groups"):
    collectives._groups("replica_groups=somethingnew[2]", 8)


def test_array_bytes_of_shapes_and_tuples():
  assert collectives.array_bytes("bf16[64,8]{1,0}") == 1024
  assert collectives.array_bytes("(s32[], f32[2,3]{1,0}, pred[5])") == 4 + 24 + 5
  assert collectives.array_bytes("f32[]") == 4
  with pytest.raises(ValueError, match="unknown HLO element type 'q7'"):
    collectives.array_bytes("q7[4]")


def _program(mesh):
  """In a loop of 3 trips: all-gather a [4, 16] f32 shard over the 4 devices of axis b (a [16, 16] result,
  1024 B), reduce-scatter it back (operand 1024 B); after it, all-reduce an f32[8] over axis a (pairs)."""
  def body(x, y):
    def step(i, c):
      g = jax.lax.all_gather(c, "b", tiled=True)  # [16, 16]
      return jax.lax.psum_scatter(g * 2.0, "b", scatter_dimension=0, tiled=True)  # [4, 16]
    return jax.lax.fori_loop(0, 3, step, x), jax.lax.psum(y, "a")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")), P("a")), out_specs=(P(("a", "b")), P("a"))))
  x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
  y = jax.ShapeDtypeStruct((16,), jnp.float32)
  return f.lower(x, y).compile().as_text()


# What _program moves per step, worked out by hand (4 devices a node: axis b inside a node, axis a across)
EXPECTED = {"all-gather": {"count": 3, "bytes": 3 * 1024, "wire": 3 * 768, "ici_wire": 3 * 768, "dcn_wire": 0,
                           "network": 0},
            "reduce-scatter": {"count": 3, "bytes": 3 * 1024, "wire": 3 * 768, "ici_wire": 3 * 768, "dcn_wire": 0,
                               "network": 0},
            "all-reduce": {"count": 1, "bytes": 32, "wire": 32, "ici_wire": 0, "dcn_wire": 32, "network": 32}}


def test_inventory_of_a_program_compiled_by_xla_cpu():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  inv = collectives.inventory(_program(mesh), devices_per_node=4, n_devices=8)
  assert {k: inv[k] for k in EXPECTED} == EXPECTED
  assert inv["exact"] is True


GPU_CHILD = """
import json, sys
import numpy as np
from jax.sharding import Mesh
from maxlm.plan import collectives
from maxlm.plan import xla_gpu as target
from tests.test_plan_collectives import _program
devices = target.compile_only_devices(target.KINDS["h200"], 8, 2)
mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
text = _program(mesh)
print(json.dumps({"inventory": collectives.inventory(text, devices_per_node=4, n_devices=8),
                  "async": "all-gather-start" in text or "async-start" in text}))
"""


def test_inventory_of_the_program_compiled_by_xla_gpu():
  plugin, why = target.find_plugin()
  if plugin is None:
    pytest.skip(why)
  env = target.compiler_env(plugin, "none", target.KINDS["h200"])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), os.getcwd()) if p)
  r = subprocess.run([sys.executable, "-c", GPU_CHILD], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.splitlines()[-1])
  assert {k: out["inventory"][k] for k in EXPECTED} == EXPECTED
  assert out["async"]  # XLA:GPU's asynchronous forms were parsed, not only XLA:CPU's synchronous ones
