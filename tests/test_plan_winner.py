"""The planner on the GPUs at hand with a deep unrolled model (maxlm/plan/winner.py): each candidate's memory and step
time extended from its 4- and 8-layer programs, the winner chosen from those estimates with a margin, and only the
winner compiled whole, nothing timed whole; the plan line says what each part cost; the start-up estimate against
numbers computed by hand. Made-up XLA and step times (linear in the depth, so the lines are exact)."""

import pytest

from maxlm.config import load_config
from maxlm.plan import fit as plan_fit
from maxlm.plan import levers as plan_levers
from maxlm.plan import target as plan_target
from maxlm.plan import timing as plan_timing
from maxlm.plan import winner
from maxlm.plan.levers import Row
from maxlm.plan.target import Target

MIB = 2**20
DEEP = ["model.backend=flax", "model.scan_layers=false", "model.n_layers=16", "data.type=synthetic",
        "data.seq_len=256", "data.global_batch_size=16", "checkpoint.enabled=false", "plan.levers=model.remat",
        "plan.timed=3", "plan.budget_s=0"]
PER_LAYER = {"none": 30, "save_dots_attn": 25, "save_dots": 20, "save_qkv_attn": 12, "save_attn": 10, "full": 5}
SECONDS = {"none": 0.010, "save_dots_attn": 0.012, "save_dots": 0.013, "save_qkv_attn": 0.016, "save_attn": 0.018,
           "full": 0.025}  # a step's seconds per layer, on top of 0.1 s


def made_up_peak(c, target) -> int:
  return plan_levers.certain_bytes(c, target)["certain"] + PER_LAYER[c.model.remat] * MIB * c.model.n_layers


def made_up_seconds(c) -> float:
  return 0.1 + SECONDS[c.model.remat] * c.model.n_layers


def at_hand(usable: int) -> Target:
  """One GPU 'at hand' (not simulated) with `usable` bytes usable."""
  return Target(1, 1, "NVIDIA H200", int(usable / 0.95 / (1 - plan_target.MARGIN)) + 1, 0.95, False)


@pytest.fixture
def gpu(monkeypatch):
  """A made-up GPU at hand whose usable memory holds save_dots at 16 layers (its line) and 1 MiB more: none and
  save_dots_attn are over by more than probe.SLACK. Records each compile (remat, layers) and each timing."""
  cfg = load_config(DEEP)
  roomy = at_hand(2**40)
  target = at_hand(made_up_peak(plan_levers.apply(cfg, {"model.remat": "save_dots"}), roomy) + MIB)
  seen = {"compiled": [], "timed": [], "extra": {}}

  def measure(self, c):
    seen["compiled"].append((c.model.remat, c.model.n_layers))
    return {"device": made_up_peak(c, self) + seen["extra"].get((c.model.remat, c.model.n_layers), 0),
            "how": "measured"}

  def time_step(c, devices=None):
    seen["timed"].append((c.model.remat, c.model.n_layers))
    return made_up_seconds(c)
  monkeypatch.setattr(Target, "measure", measure)
  monkeypatch.setattr(plan_timing, "time_step", time_step)
  return cfg, target, seen


def whole(seen, kind) -> list:
  return [r for r, n in seen[kind] if n == 16]


def test_only_the_winner_is_compiled_whole_and_nothing_is_timed_whole(gpu):
  cfg, target, seen = gpu
  lines = []
  p = plan_fit.search(cfg, target, report=lines.append)
  assert whole(seen, "compiled") == ["save_dots"]  # one full compile: the winner
  assert whole(seen, "timed") == []  # no step timed whole
  # none and save_dots_attn probed and pruned; the next plan.timed=3 estimated: 5 x 2 shallow compiles, 3 x 2 timed
  assert [(r, n) for r, n in seen["compiled"] if n != 16] == [(r, n) for r in (
      "none", "save_dots_attn", "save_dots", "save_qkv_attn", "save_attn") for n in (4, 8)]
  assert seen["timed"] == [(r, n) for r in ("none", "save_dots_attn", "save_dots", "save_qkv_attn", "save_attn")
                           for n in (4, 8)]
  rows = {r.overrides["model.remat"]: r for r in p.rows}
  assert p.chosen is rows["save_dots"] and p.chosen.status == "fits" and p.chosen.seconds is None
  # the line through (4, 0.152 s) and (8, 0.204 s), extended to 16 layers: 0.308 s; the peak's line is exact
  assert rows["save_dots"].estimate["seconds"] == pytest.approx(0.1 + 0.013 * 16)
  assert rows["save_dots"].measured == made_up_peak(p.cfg, target) == rows["save_dots"].estimate["bytes"]
  assert rows["save_attn"].status == "estimated" and rows["full"].status == "not tried"
  line = p.line()
  assert "step 0.308 s estimated from its 4- and 8-layer steps timed, the fastest of 3 probed" in line, line
  assert "; planning: probes " in line and "(10 shallow compiles " in line and ", 10 shallow timings " in line
  assert "full compile " in line and " (1), timing 0 s" in line
  assert any(ln.startswith("plan: compiled remat=save_dots, ") and " whole: peak " in ln for ln in lines), lines


def test_a_winner_that_does_not_fit_whole_falls_back_to_the_next(gpu):
  cfg, target, seen = gpu
  seen["extra"][("save_dots", 16)] = 64 * MIB  # XLA whole: above its line, over the usable memory
  p = plan_fit.search(cfg, target)
  assert whole(seen, "compiled") == ["save_dots", "save_qkv_attn"] and whole(seen, "timed") == []
  rows = {r.overrides["model.remat"]: r for r in p.rows}
  assert rows["save_dots"].status == "too big" and p.chosen is rows["save_qkv_attn"]
  assert " (2), timing 0 s" in p.line()


def test_fit_probes_the_config_as_written_instead_of_compiling_it_whole(gpu, monkeypatch):
  """plan.mode=fit on the GPU at hand: the config as written (remat=none) is over by its line, so it is not compiled
  whole; the search reuses its two probes; one full compile in all."""
  cfg, target, seen = gpu
  cfg = plan_levers.apply(cfg, {"model.remat": "none"})
  monkeypatch.setattr(plan_fit, "gpu_here", lambda: True)
  monkeypatch.setattr(plan_fit, "make_target", lambda *a, **k: target)
  d = plan_fit.by_mode(cfg, mode="fit")
  assert whole(seen, "compiled") == ["save_dots"] and whole(seen, "timed") == []
  assert seen["compiled"].count(("none", 4)) == 1 and seen["compiled"].count(("none", 8)) == 1
  assert d.cfg.model.remat == "save_dots" and d.line.endswith(" per device")
  assert "; as written the config is extended to " in d.line and "from its 4- and 8-layer programs" in d.line


def test_the_winner_is_the_fastest_estimate_with_a_margin():
  def row(name, seconds, bytes_):
    return Row({"model.remat": name}, "estimated", 0, estimate={"seconds": seconds, "bytes": bytes_})
  a, b, c, d = row("a", 1.00, 90), row("b", 0.98, 90), row("c", 1.20, 90), row("d", 0.50, 101)
  # b is fastest; a is within 3% of it (1.00 <= 0.98 x 1.03) and earlier in the roofline's order: a first;
  # d is faster still, but its line is over the usable memory (100): after every one under it
  assert winner.order([a, b, c, d], 100) == [a, b, c, d]
  e = row("e", 1.01, 90)  # 1.01 > 0.98 x 1.03 = 1.0094: outside the margin, after b
  assert winner.order([e, b, c], 100) == [b, e, c]


def test_start_up_estimate_against_hand_numbers():
  # 3 candidates x 2 probes x (20 s compile + 5 s timing) = 150 s; one full compile 80 s; 230 s in all
  assert winner.start_up_seconds(3, 20.0, 5.0, 80.0) == {"probes_s": 150.0, "full_compile_s": 80.0,
                                                         "timing_s": 0.0, "total_s": 230.0}
  # one fallback: a second full compile, 310 s; one candidate: 2 x 25 + 80 = 130 s
  assert winner.start_up_seconds(3, 20.0, 5.0, 80.0, fallbacks=1)["total_s"] == 310.0
  assert winner.start_up_seconds(1, 20.0, 5.0, 80.0)["total_s"] == 130.0


def test_the_plan_line_says_what_each_part_cost():
  """With a clock the made-up compiler and timer advance (20 s a shallow compile, 5 s a shallow timing, 80 s the
  whole one): probes 3 x 2 x 25 = 150 s, of it 120 s compiling and 30 s timing; the full compile 80 s."""
  cfg = load_config(DEEP)
  target = at_hand(2**40)  # everything fits: the first three are estimated, the first is the winner
  now = [0.0]

  def measure(c):
    now[0] += 80.0 if c.model.n_layers == 16 else 20.0
    return {"device": made_up_peak(c, target), "how": "measured"}

  def timer(c):
    now[0] += 5.0
    return made_up_seconds(c)
  p = winner.search(cfg, target, measure, "flax", timer, clock=lambda: now[0])
  assert p.costs["line"] == ("planning: probes 150 s (6 shallow compiles 120 s, 6 shallow timings 30 s), full compile "
                             "80 s (1), timing 0 s")
  assert p.line().endswith("; " + p.costs["line"])
