"""maxlm/plan/mesh_search.py: the candidate meshes of N devices over M nodes, and a choice that follows the model:
with made-up estimates, plans and predictions (no compile), the fastest predicted mesh whose levers fit wins."""

import pytest

from maxlm.plan import levers as plan_levers
from maxlm import plan
from maxlm.config import load_config
from maxlm.plan import mesh_search
from maxlm.plan.target import Target

GIB = 2 ** 30
TINY = load_config(["config=tiny.yml"])  # 4 heads, 2 KV heads, 2 layers, seq 128, batch 8
H200 = Target(8, 2, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")


def _degrees(o: dict) -> tuple:
  return tuple(o[f"mesh.{a}"] for a in ("pipeline", "data", "fsdp", "context", "tensor")), \
      tuple(o[f"mesh.dcn_{a}"] for a in ("pipeline", "data", "fsdp", "context", "tensor"))


def test_candidate_meshes_of_8_devices_over_2_nodes():
  got = mesh_search.meshes(TINY, 8, 2)
  # By hand, 4 devices a node, 2 nodes: tensor 1 or 2 (4 would split the 2 KV heads); context 1, 2, 4 with
  # tensor 1 (1, 2 with tensor 2); pipeline 1 or 2 stages across the 2 nodes (2 layers), only without context;
  # the node's rest to fsdp or data, the nodes' rest to fsdp or data (one choice where the rest is 1):
  # tensor 1: context 1: 2 x 2 (pipeline 1) + 2 (pipeline 2); context 2: 2 x 2; context 4: 1 x 2
  # tensor 2: context 1: 2 x 2 + 2; context 2: 1 x 2  ->  6 + 4 + 2 + 6 + 2 = 20
  assert len(got) == 20 and len({_degrees(o) for o in got}) == 20
  for o in got:
    ici, dcn = _degrees(o)
    assert _prod(ici) == 4 and _prod(dcn) == 2
    assert dcn[3] == dcn[4] == 1 and ici[0] == 1  # context and tensor in a node, pipeline across nodes
    assert not (dcn[0] > 1 and ici[3] > 1)  # no pipeline with context
    assert o.get("model.scan_layers", False) == (dcn[0] > 1)
  assert ((1, 1, 2, 1, 2), (1, 1, 2, 1, 1)) in {_degrees(o) for o in got}
  # a batch of 2 rows splits over at most 2 data-parallel devices
  small = load_config(["config=tiny.yml", "data.global_batch_size=2"])
  for o in mesh_search.meshes(small, 8, 2):
    ici, dcn = _degrees(o)
    assert ici[1] * ici[2] * dcn[1] * dcn[2] <= 2


def _prod(xs):
  out = 1
  for x in xs:
    out *= x
  return out


class Fakes:
  """Made-up estimates, plans and predictions by mesh label; records which meshes were compiled."""

  def __init__(self, estimates: dict, predicted: dict, fits: set, levers: dict | None = None):
    self.estimates, self.predicted, self.fits, self.compiled = estimates, predicted, fits, []
    self.levers = levers or {}  # the levers each mesh's made-up plan chooses (default remat=full)

  def estimate(self, cfg, target):
    key = self.key(cfg)
    return (self.estimates[key], {}) if key in self.estimates else None

  def plan(self, cfg):
    key = self.key(cfg)
    self.compiled.append(key)
    levers = self.levers.get(key, {"model.remat": "full"})
    row = plan_levers.Row(levers, "fits", 1, measured=GIB, stats={"mesh": key})
    return plan.Plan(H200, [row], row if key in self.fits else None, plan_levers.apply(cfg, levers))

  def predict(self, cfg, stats):
    return {"step_s": self.predicted[stats["mesh"]], "tokens_per_s_per_gpu": 1.0}

  @staticmethod
  def key(cfg):
    m = cfg.mesh
    return (m.data, m.fsdp, m.context, m.tensor, m.dcn_pipeline, m.dcn_data, m.dcn_fsdp)


A, B, C, D = (1, 4, 1, 1, 1, 1, 2), (1, 2, 1, 2, 1, 1, 2), (4, 1, 1, 1, 1, 2, 1), (1, 4, 1, 1, 2, 1, 1)


def _search(fakes, budget, cfg=TINY):
  return mesh_search.search(cfg, H200, fakes.plan, fakes.predict, budget, fakes.estimate)


def test_the_choice_follows_the_predicted_step_time():
  # estimates order A, B, C, D; predicted: C fastest, then B, then A
  f = Fakes({A: 1.0, B: 2.0, C: 3.0, D: 4.0}, {A: 3.0, B: 2.0, C: 1.0, D: 0.5}, fits={A, B, C, D})
  mp = _search(f, budget=3)
  assert f.compiled == [A, B, C]  # the estimate's order; D beyond the budget (tiny.yml's own mesh, fsdp 4 in a
  # node and data 2 across, has no made-up estimate here: not a candidate to compile)
  assert Fakes.key(plan_levers.apply(TINY, mp.chosen.overrides)) == C and mp.chosen.status == "chosen"
  assert Fakes.key(plan_levers.apply(TINY, mp.runner_up.overrides)) == B and mp.runner_up.status == "runner-up"
  assert D not in f.compiled  # faster as predicted, but not compiled: the estimate ruled it out
  # with the predictions swapped, the choice swaps
  f = Fakes({A: 1.0, B: 2.0, C: 3.0, D: 4.0}, {A: 1.0, B: 2.0, C: 3.0}, fits={A, B, C})
  mp = _search(f, budget=3)
  assert (Fakes.key(plan_levers.apply(TINY, mp.chosen.overrides)), Fakes.key(plan_levers.apply(TINY, mp.runner_up.overrides))) \
      == (A, B)


def test_a_mesh_whose_levers_do_not_fit_is_never_chosen_and_the_budget_counts_fits():
  f = Fakes({A: 1.0, B: 2.0, C: 3.0, D: 4.0}, {A: 0.1, B: 2.0, C: 3.0, D: 4.0}, fits={B, C, D})
  mp = _search(f, budget=2)
  assert f.compiled == [A, B, C]  # A does not fit: the next until two fit
  status = {Fakes.key(plan_levers.apply(TINY, r.overrides)): r.status for r in mp.rows if r.plan is not None}
  assert status == {A: "nothing fits", B: "chosen", C: "runner-up"}
  f = Fakes({A: 1.0, B: 2.0}, {}, fits=set())
  mp = _search(f, budget=2)
  assert mp.chosen is None and mp.runner_up is None


def test_the_config_mesh_is_compiled_beyond_the_budget():
  cfg = load_config(["config=tiny.yml", "mesh.fsdp=2", "mesh.tensor=2", "mesh.dcn_data=1", "mesh.dcn_fsdp=2"])  # B
  f = Fakes({A: 1.0, C: 2.0, B: 3.0}, {A: 2.0, C: 3.0, B: 1.0}, fits={A, B, C})
  mp = _search(f, budget=1, cfg=cfg)
  assert f.compiled == [A, B]  # A by the budget, B as the config's own mesh
  assert Fakes.key(plan_levers.apply(cfg, mp.chosen.overrides)) == B and mp.chosen.written


def test_meshes_the_certain_bytes_rule_out_are_not_estimated():
  small = Target(8, 2, "NVIDIA H200", 2 ** 20, 0.95, True, gpu_target="h200")  # 1 MiB a device: nothing fits
  f = Fakes({A: 1.0}, {A: 1.0}, fits={A})
  mp = mesh_search.search(TINY, small, f.plan, f.predict, 3, f.estimate)
  assert {r.status for r in mp.rows} == {"certain bytes too big"} and f.compiled == [] and mp.chosen is None


def test_within_two_percent_the_config_mesh_and_float32_moments_win():
  w = (1, 4, 1, 1, 1, 2, 1)  # tiny.yml's own mesh: fsdp 4 in a node, data 2 across
  f = Fakes({A: 1.0, w: 2.0, B: 3.0}, {A: 0.99, w: 1.0, B: 0.5}, fits={A, w, B})
  assert Fakes.key(plan_levers.apply(TINY, _search(f, budget=3).chosen.overrides)) == B  # 50% faster: not a tie
  f = Fakes({A: 1.0, w: 2.0}, {A: 0.99, w: 1.0}, fits={A, w})  # A 1% faster: a tie, the config's mesh stays
  mp = _search(f, budget=3)
  assert Fakes.key(plan_levers.apply(TINY, mp.chosen.overrides)) == w and mp.chosen.written
  assert Fakes.key(plan_levers.apply(TINY, mp.runner_up.overrides)) == A
  f = Fakes({A: 1.0, w: 2.0}, {A: 0.97, w: 1.0}, fits={A, w})  # 3% faster: A
  assert Fakes.key(plan_levers.apply(TINY, _search(f, budget=3).chosen.overrides)) == A


def test_within_two_percent_the_fewer_bfloat16_moments_win():
  # neither is the config's own mesh (tiny.yml's: fsdp 4 in a node, data 2 across); A keeps both moments in
  # bfloat16 and is 1% faster than C with float32 ones (a tie), 3% faster than B with a bfloat16 mu (not a tie)
  bf16 = {"optim.mu_dtype": "bfloat16", "optim.nu_dtype": "bfloat16"}
  f32 = {"optim.mu_dtype": "float32", "optim.nu_dtype": "float32"}
  f = Fakes({A: 1.0, C: 2.0}, {A: 0.99, C: 1.0}, fits={A, C}, levers={A: bf16, C: f32})
  mp = _search(f, budget=3)
  assert Fakes.key(plan_levers.apply(TINY, mp.chosen.overrides)) == C and not mp.chosen.written
  assert mp.chosen.plan.cfg.optim.mu_dtype == "float32"
  mu = {"optim.mu_dtype": "bfloat16", "optim.nu_dtype": "float32"}
  f = Fakes({A: 1.0, B: 2.0}, {A: 0.97, B: 1.0}, fits={A, B}, levers={A: bf16, B: mu})
  assert Fakes.key(plan_levers.apply(TINY, _search(f, budget=3).chosen.overrides)) == A
  f = Fakes({A: 1.0, B: 2.0}, {A: 0.99, B: 1.0}, fits={A, B}, levers={A: bf16, B: mu})  # a tie: one bf16 < two
  assert Fakes.key(plan_levers.apply(TINY, _search(f, budget=3).chosen.overrides)) == B


def test_extra_seconds_are_the_tensor_parallel_all_reduces_only():
  t = Target(8, 1, "NVIDIA H200", 140 * GIB, 0.95, True, gpu_target="h200")
  tp = load_config(["config=llama8b.yml", "mesh.tensor=2"])  # fsdp 4 x tensor 2: 8 rows over 4, 2 each
  # by hand: 4 all-reduces per layer of [2 rows, 8192, 4096] in bf16 (2 B), a ring moving 2 (2 - 1) / 2 of each,
  # 32 layers, at 450 GB/s (NVLink 4 each way)
  want = 4 * 32 * (2 * 8192 * 4096 * 2) * 2 * (2 - 1) / 2 / 450e9
  assert mesh_search.extra_seconds(tp, t) == pytest.approx(want, rel=1e-12)
  # the context axis's exchange and the pipeline's bubble are cost.step_time's (tests/test_plan_cost.py): not again
  cp = load_config(["config=llama8b.yml", "mesh.context=2"])
  assert mesh_search.extra_seconds(cp, t) == 0
  pp = load_config(["config=llama8b.yml", "mesh.pipeline=2", "model.scan_layers=true", "train.grad_accum=2"])
  assert mesh_search.extra_seconds(pp, t) == 0


def test_the_search_says_each_mesh_as_it_begins_and_ends():
  f = Fakes({A: 1.0, B: 2.0}, {A: 0.5, B: 2.0}, fits={A})
  lines = []
  mesh_search.search(TINY, H200, f.plan, f.predict, 1, f.estimate, report=lines.append)
  a, b = (mesh_search.label(r.overrides) for r in sorted(
      (r for r in mesh_search.search(TINY, H200, f.plan, f.predict, 1, f.estimate).rows if r.estimate_s),
      key=lambda r: r.estimate_s))
  assert lines[0].startswith("plan: 20 meshes estimated (") and lines[0].endswith(
      "s); the lever search on the fastest until 1 fit, and on the config's own")
  assert lines[1] == f"plan: mesh {a} (estimated 1 s a step; 0 of 1 meshes fit so far): its levers"
  assert lines[2].startswith(f"plan: mesh {a}: remat=full fits, predicted 0.5 s a step (")
  assert len(lines) == 3  # B: beyond the budget, not the config's own mesh
  f = Fakes({A: 1.0}, {}, fits=set())
  lines.clear()
  mesh_search.search(TINY, H200, f.plan, f.predict, 1, f.estimate, report=lines.append)
  assert lines[2].startswith(f"plan: mesh {a}: nothing fits (") and b
