"""The planner's shallow probes (maxlm/plan/probe.py): the line through two shallow compiles' peaks, extended to the
model's depth (hand numbers), where it applies, and the search's use of it on the devices at hand: a candidate whose
line is over the usable memory is pruned after its two shallow compiles and never compiled whole; one that fits
is compiled whole and measured; XLA out of memory on a probe prunes too. The premise, peaks linear in the depth
of unrolled layers, checked on XLA:CPU here (XLA:GPU's figures: benchmarks/results/2026-12-06-depth_probe.jsonl)."""

import pytest

from maxlm.plan import levers as plan_levers
from maxlm.plan import target as plan_target
from maxlm.cli.plan import render
from maxlm.config import load_config
from maxlm.plan import measure as plan_measure
from maxlm.plan import probe
from maxlm.plan.target import Target
from maxlm.tables import human_bytes

MIB = 2**20
DEEP = ["model.backend=flax", "model.scan_layers=false", "model.n_layers=16", "data.type=synthetic",
        "data.seq_len=256", "data.global_batch_size=16", "checkpoint.enabled=false",
        "plan.levers=model.remat", "plan.timed=0"]


def test_extend_is_the_line_through_the_two_probes():
  # by hand: 100 at 4 layers, 140 at 8: 10 a layer, so 140 + 24 x 10 = 380 at 32; and 70 at 1 layer
  assert probe.extend((4, 100), (8, 140), 32) == 380
  assert probe.extend((4, 100), (8, 140), 1) == 70
  assert probe.extend((8, 2 * 10**9), (16, 3 * 10**9), 64) == 9 * 10**9  # 8 and 16: 1/8 GB a layer
  assert probe.extend((4, 100), (8, 100), 32) == 100  # nothing grows with depth


def test_probes_apply_to_deep_unrolled_stacks_only():
  cfg = load_config(DEEP)
  assert probe.depths(cfg, 1) == (4, 8)
  assert probe.depths(cfg, 2) is None  # 8 layers a stage: the probes would cost what the model does
  assert probe.depths(probe.shallow(cfg, 32), 2) == (8, 16)  # whole stages: 4 and 8 layers each
  assert probe.depths(probe.shallow(cfg, 15), 1) is None
  assert probe.depths(load_config([*DEEP, "model.scan_layers=true"]), 1) is None  # compiled once at any depth


def test_too_big_gives_the_line_ten_percent_of_slack():
  assert not probe.too_big(1100, 1000) and probe.too_big(1101, 1000)


# Made-up XLA: per candidate, its certain bytes (which grow with the depth: parameters, moments, gradients) plus a
# some MiB per layer by remat policy (more than the analytic model's rough activations take as plausible, so that
# it prunes none of them); the line through any two depths is then exact.
PER_LAYER = {"none": 30, "recompute_norm_act": 28, "save_dots_attn": 25, "save_dots": 20, "save_qkv_attn": 12,
             "save_attn": 10, "full": 5}


def made_up_peak(c, target) -> int:
  return plan_levers.certain_bytes(c, target)["certain"] + PER_LAYER[c.model.remat] * MIB * c.model.n_layers


def at_hand(usable: int) -> Target:
  """One GPU 'at hand' (not simulated) with `usable` bytes usable."""
  return Target(1, 1, "NVIDIA H200", int(usable / 0.95 / (1 - plan_target.MARGIN)) + 1, 0.95, False)


def test_the_search_prunes_by_the_probes_and_compiles_whole_only_what_fits():
  cfg = load_config(DEEP)
  t = at_hand(2**40)
  # usable: save_qkv_attn at 16 layers by hand (certain + 12 MiB x 16) less 1 MiB, so everything faster than
  # save_attn is over by 1 MiB or more; save_qkv_attn itself by 1 MiB, inside the 10% slack: compiled whole
  qkv = plan_levers.apply(cfg, {"model.remat": "save_qkv_attn"})
  usable = plan_levers.certain_bytes(qkv, t)["certain"] + 192 * MIB - MIB
  target = at_hand(usable)
  assert abs(target.usable - usable) < 16  # the made-up GPU's memory rounds to its usable bytes
  seen = []

  def measure(c):
    seen.append((c.model.remat, c.model.n_layers))
    return {"device": made_up_peak(c, target), "how": "measured"}
  p = plan_levers.search(cfg, target, measure, "flax")
  rows = {r.overrides["model.remat"]: r for r in p.rows}
  slack = target.usable * probe.SLACK
  over = {k: made_up_peak(plan_levers.apply(cfg, {"model.remat": k}), target) - target.usable for k in PER_LAYER}
  pruned = [k for k in ("none", "save_dots_attn", "save_dots") if over[k] > slack]
  assert pruned == ["none", "save_dots_attn", "save_dots"]  # the made-up numbers do what the test says
  for k in pruned:
    r = rows[k]
    assert r.status == "pruned" and r.how == "probed" and r.measured is None
    assert r.plausible == made_up_peak(plan_levers.apply(cfg, {"model.remat": k}), target)  # the line, exact here
    assert r.note.startswith("4 and 8 layers compiled (") and r.note.endswith(" at 16")
  # save_qkv_attn: over by 1 MiB, within the slack: compiled whole, measured too big; save_attn fits
  assert 0 < over["save_qkv_attn"] <= slack and rows["save_qkv_attn"].status == "too big"
  assert p.chosen is rows["save_attn"] and rows["save_attn"].measured == made_up_peak(
      plan_levers.apply(cfg, {"model.remat": "save_attn"}), target)
  assert seen == [("none", 4), ("none", 8), ("save_dots_attn", 4), ("save_dots_attn", 8), ("save_dots", 4),
                  ("save_dots", 8), ("save_qkv_attn", 4), ("save_qkv_attn", 8), ("save_qkv_attn", 16),
                  ("save_attn", 4), ("save_attn", 8), ("save_attn", 16)]
  line = p.line()
  assert "; 2 compiled, 3 pruned by shallow compiles, 1 not" in line, line
  # `maxlm plan`'s table shows the probed rows with their line (~), and does not count them as pruned unseen
  table = render(p, cfg).splitlines()
  probed = [t for t in table if "4 and 8 layers compiled" in t]
  assert len(probed) == 3 and all(f"~{human_bytes(rows[k].plausible)}" in t for k, t in zip(pruned, probed))
  assert any(t.strip().startswith("not shown: 0 pruned by the analytic model") for t in table), table


def test_an_out_of_memory_probe_prunes_and_simulated_or_scanned_steps_are_not_probed():
  cfg = load_config(DEEP)
  target = at_hand(2**40)
  seen = []

  def measure(c):
    seen.append((c.model.remat, c.model.n_layers))
    if c.model.remat == "none" and c.model.n_layers == 8:
      return {"oom": "RESOURCE_EXHAUSTED: out of memory"}
    return {"device": made_up_peak(c, target), "how": "measured"}
  p = plan_levers.search(cfg, target, measure, "flax")
  first = p.rows[0]
  assert first.overrides["model.remat"] == "none" and first.status == "pruned"
  assert first.note == "XLA ran out of memory compiling 8 layers: RESOURCE_EXHAUSTED: out of memory"
  assert seen == [("none", 4), ("none", 8), ("save_dots_attn", 4), ("save_dots_attn", 8), ("save_dots_attn", 16)]
  assert p.chosen.overrides["model.remat"] == "save_dots_attn"
  for c, t in ((load_config([*DEEP, "model.scan_layers=true"]), target),  # a scanned stack
               (cfg, Target(1, 1, "NVIDIA H200", target.device_bytes, 0.95, True))):  # simulated devices
    seen.clear()
    assert plan_levers.search(c, t, measure, "flax").chosen is not None
    assert all(n == 16 for _, n in seen), seen


@pytest.mark.parametrize("remat", ["none", "full"])
def test_xla_cpu_peaks_grow_linearly_with_unrolled_depth(remat):
  """The premise on a compiler at hand: XLA:CPU's peak at 16 unrolled layers is the line through 4 and 8 (exactly,
  here; the planner allows probe.SLACK)."""
  cfg = load_config([*DEEP, f"model.remat={remat}", "data.seq_len=512"])
  peaks = {n: plan_measure.measure(probe.shallow(cfg, n))["device"] for n in (4, 8, 16)}
  assert peaks[8] > peaks[4]
  assert abs(probe.extend((4, peaks[4]), (8, peaks[8]), 16) - peaks[16]) <= probe.SLACK * peaks[16]


def test_a_probe_calibrates_its_policys_share_like_a_measurement():
  """After the probes of none / offload=none put its line at certain + 1.5 x the rough activations, the share of
  none is 1 (the least seen, at most 1), so none / offload=host, whose certain + 1.0 x activations is over the
  usable memory, is pruned by the analytic model without probes; with the starting share (1/2) it would be probed."""
  cfg = load_config([*DEEP[:-2], "plan.levers=model.remat,optim.offload", "plan.timed=0"])
  roomy = at_hand(2**40)

  def peak(c, target):
    need = plan_levers.certain_bytes(c, target)
    return need["certain"] + int(1.5 * need["activations"])
  on_device = plan_levers.certain_bytes(plan_levers.apply(cfg, {"model.remat": "none"}), roomy)
  host = plan_levers.certain_bytes(plan_levers.apply(cfg, {"model.remat": "none", "optim.offload": "host"}), roomy)
  usable = on_device["certain"] + on_device["activations"] // 2 + MIB  # none / none passes the analytic model
  target = at_hand(usable)
  assert host["certain"] + host["activations"] // 2 < target.usable < host["certain"] + host["activations"]
  seen = []

  def measure(c):
    seen.append((c.model.remat, c.optim.offload, c.model.n_layers))
    return {"device": peak(c, target), "how": "measured"}
  p = plan_levers.search(cfg, target, measure, "flax", everything=True)  # on past the choice, to none / host
  rows = {(r.overrides["model.remat"], r.overrides["optim.offload"]): r for r in p.rows}
  assert rows["none", "none"].how == "probed" and ("none", "none", 8) in seen
  r = rows["none", "host"]
  assert r.status == "pruned" and r.how != "probed" and r.note.startswith("certain + 1.00 x activations"), r
  assert not any(s[:2] == ("none", "host") for s in seen)


class MadeUpXla:
  """A made-up compile-only XLA:GPU for Target: `made_up_peak` per config, each compile recorded (offload, layers)."""
  label = "made-up compile-only GPUs"

  def __init__(self):
    self.seen = []
    self.target = None

  def measure(self, c):
    self.seen.append((c.optim.offload, c.model.n_layers))
    return {"device": made_up_peak(c, self.target), "how": "measured"}


def _compile_only(usable: int) -> tuple[Target, MadeUpXla]:
  xla = MadeUpXla()
  t = Target(1, 1, "NVIDIA H200", int(usable / 0.95 / (1 - plan_target.MARGIN)) + 1, 0.95, True, gpu_target="h200",
             _sim=xla)
  xla.target = t
  return t, xla


def test_on_compile_only_gpus_a_deep_offloaded_candidate_is_probed_before_its_long_compile():
  cfg = plan_levers.apply(load_config(DEEP), {"optim.offload": "host"})
  whole = made_up_peak(cfg, _compile_only(2**40)[0])
  # the line over the usable memory by more than 10%: two shallow compiles, never the whole one; its line measured
  t, xla = _compile_only(int(whole / 1.2))
  said = []
  out = probe.measuring(t, said.append)(cfg)
  assert xla.seen == [("host", 4), ("host", 8)]
  assert out["device"] == whole and out["how"].startswith("probed: 4 and 8 layers compiled (")  # exact line here
  assert "not compiled whole" in out["how"] and len(said) == 1 and said[0].startswith("plan: probed 4 and 8 layers")
  # within the slack: compiled whole after its probes, the whole compile's measurement
  t, xla = _compile_only(int(whole / 1.05))
  out = probe.measuring(t)(cfg)
  assert xla.seen == [("host", 4), ("host", 8), ("host", 16)] and out == {"device": whole, "how": "measured"}
  # offload=none (one scanned program there, as fast at any depth) and scanned stacks: compiled whole at once
  for c in (load_config(DEEP), plan_levers.apply(load_config([*DEEP, "model.scan_layers=true"]), {"optim.offload": "host"})):
    t, xla = _compile_only(int(whole / 1.2))
    probe.measuring(t)(c)
    assert xla.seen == [(c.optim.offload, 16)]
  # other targets: their own measure (the devices at hand probe in the search itself, levers.py)
  hand = at_hand(2**40)
  assert probe.measuring(hand) == hand.measure
