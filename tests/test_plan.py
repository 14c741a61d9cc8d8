"""The memory planner (maxlm/plan/__init__.py and plan/levers.py, plan/measure.py, cli/plan.py) on 8 simulated CPU
devices: its per-device bytes equal XLA's memory analysis of the step the trainer compiles (read here off the
trainer's own executable), a config that fits only with a memory-saving lever gets it (CLI table, trainer, dry
run), the search is deterministic and compiles only what it must, an out-of-memory error ends in one line, and in
a run of several processes process 0 decides the plan that every process runs."""

import itertools
import json

import jax
import numpy as np
import processes
import pytest

from maxlm.plan import decision as plan_decision
from maxlm.plan import fit as plan_fit
from maxlm.plan import levers as plan_levers
from maxlm.plan import no_fit as plan_no_fit
from maxlm.plan import target as plan_target
from maxlm import plan
from maxlm.cli import main as cli_main
from maxlm.cli.train import main as train_main
from maxlm.cli.train import run
from maxlm.config import ConfigError, load_config
from maxlm.optim import LAG
from maxlm.plan import measure as plan_measure
from maxlm.plan.cost import TIE, step_time
from maxlm.plan.target import Target
from maxlm.plan.oom import oom_message
from maxlm.tables import DEFAULT_GPU, gpu_named, human_bytes
from maxlm.trainer import Trainer

# Tiny model whose activations matter next to its state: at 16 rows x 256 tokens over 8 devices, two
# micro-batches (train.grad_accum=2) need measurably less than one (about 49 vs 60 MB per device here).
BASE = ["model.backend=flax", "model.remat=none", "data.type=synthetic", "data.seq_len=256",
        "data.global_batch_size=16", "train.steps=2", "checkpoint.enabled=false"]


def xla_bytes(executable) -> int:
  """Per-device bytes of a compiled step as XLA reports them: arguments + outputs + temporaries - aliased
  (the donated state), written out here from `memory_analysis()`'s fields."""
  m = executable.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def trainer_bytes(tmp_path, *extra) -> int:
  """Build the run with the trainer, run one step (it compiles ahead of time first) and read its executable."""
  cfg = load_config([*BASE, f"output_dir={tmp_path}", *extra])
  tr = Trainer(cfg)
  tr.build()
  shape = (cfg.data.global_batch_size, cfg.data.seq_len)
  batch = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  tr.train_step(tr.state, tr.to_device(batch))
  return xla_bytes(tr.jitted_train_step.executable)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """XLA's bytes per device with one micro-batch (the trainer's own step) and two (the planner's measurement,
  which the first test shows to be the trainer's)."""
  return {1: trainer_bytes(tmp_path_factory.mktemp("plan")),
          2: plan_measure.measure(load_config([*BASE, "train.grad_accum=2"]))["device"]}


def test_measure_equals_the_trainers_compiled_memory_analysis(reference):
  assert jax.device_count() == 8
  got = plan_measure.measure(load_config(BASE))
  assert got["device"] == reference[1] and got["how"] == "measured"
  assert got["params"] > 0 and got["opt_state"] == 2 * got["params"] + 8  # Adam's mu, nu + 2 int32 counts
  assert reference[2] < reference[1]  # the premise of the lever tests below


def midpoint_gb(reference) -> float:
  """A device memory (GB) whose usable part (x 0.98) lies halfway between the two measured peaks."""
  return (reference[1] + reference[2]) / 2 / (1 - plan_target.MARGIN) / 1e9


def test_cli_table_chooses_the_lever_that_fits(reference, capsys):
  code = cli_main(["plan", *BASE, "plan.levers=train.grad_accum", "--device-memory-gb", str(midpoint_gb(reference))])
  out, err = capsys.readouterr()
  # progress on stderr, a line as each compile ends; the table alone on stdout
  lines = err.splitlines()
  assert code == 0 and len(lines) == 2
  for line, accum, status in zip(lines, (1, 2), ("too big", "fits")):
    assert line.startswith(f"maxlm: plan: compiled remat=none, grad_accum={accum}, offload=none, ")
    assert f", {status} (" in line
  rows = [ln for ln in out.splitlines() if ln[2:6].strip().isdigit()]
  assert len(rows) == 2  # accumulation 1 (too big), then 2 (fits): both compiled, in that order
  assert rows[0].startswith("  ") and rows[0].split()[:3] == ["1", "none", "1"] and "too big" in rows[0]
  assert rows[1].startswith("* ") and rows[1].split()[1:4] == ["2", "none", "2"] and rows[1].endswith("fits")
  assert ("chosen: model.remat=none train.grad_accum=2 optim.offload=none optim.mu_dtype=float32 "
          "optim.nu_dtype=float32") in out
  assert "8 x cpu" in out and "measured by XLA on the devices at hand" in out


def test_trainer_and_dry_run_apply_the_plan(reference, tmp_path, monkeypatch, capsys):
  usable = (reference[1] + reference[2]) // 2
  monkeypatch.setattr(plan_target, "_local_memory", lambda dev: int(usable / (1 - plan_target.MARGIN)) + 1)
  auto = [*BASE, "plan.mode=auto", "plan.levers=train.grad_accum", f"output_dir={tmp_path}"]
  cfg = load_config(auto)
  decided, how = plan.for_run(cfg, print)  # as the train command does, before it builds the trainer
  assert decided.train.grad_accum == 2 and cfg.train.grad_accum == 1 and how == "chosen by plan.mode=auto"
  assert Trainer(decided).cfg is decided  # the trainer plans nothing itself
  out = capsys.readouterr().out.splitlines()
  # a line as each compile ends, then the plan's
  assert len(out) == 3 and out[0].startswith("maxlm: plan: compiled remat=none, grad_accum=1, ") and \
      f": peak {human_bytes(reference[1])} of " in out[0] and ", too big (" in out[0]
  assert out[1].startswith("maxlm: plan: compiled remat=none, grad_accum=2, ") and ", fits (" in out[1]
  assert out[2].startswith(
      "maxlm: plan: set train.grad_accum=2; kept as written: model.remat=none, optim.offload=none, "
      f"optim.mu_dtype=float32, optim.nu_dtype=float32 (peak {human_bytes(reference[2])} of ")
  assert out[2].endswith("usable per device; measured by XLA on the devices at hand; 2 compiled, 0 not)")
  code = train_main(["--dry-run", "--json", *auto])
  p = json.loads(capsys.readouterr().out)
  assert code == 0 and p["config"]["train"]["grad_accum"] == 2 and "train.grad_accum=2" in p["plan"]


@pytest.mark.parametrize("where", ["midpoint", "roomy"])
def test_fit_keeps_a_config_that_fits_and_plans_one_that_does_not(reference, where, tmp_path, monkeypatch, capsys):
  # plan.mode=fit (the default) on a GPU (faked): one compile of the config as written; kept when it fits,
  # else the search's choice, the as-written measurement not compiled again
  usable = {"midpoint": (reference[1] + reference[2]) // 2, "roomy": 2 * reference[1]}[where]
  monkeypatch.setattr(plan_target, "_local_memory", lambda dev: int(usable / (1 - plan_target.MARGIN)) + 1)
  monkeypatch.setattr(plan_fit, "gpu_here", lambda: True)
  compiled = []
  monkeypatch.setattr(Target, "measure", lambda self, c: compiled.append(plan_levers.current(c))
                      or plan_measure.measure(c, self.devices))
  cfg = load_config([*BASE, "plan.levers=train.grad_accum", f"output_dir={tmp_path}"])
  assert cfg.plan.mode == "fit"
  decided, how = plan.for_run(cfg, print)
  out = capsys.readouterr().out.splitlines()
  h = human_bytes
  if where == "roomy":
    assert decided is cfg and [c["train.grad_accum"] for c in compiled] == [1]
    assert how == "as written, measured to fit by plan.mode=fit"
    assert out[1:] == [f"maxlm: plan: the config fits as written (peak {h(reference[1])} of {h(usable)} usable "
                       "per device, measured by XLA; plan.mode=fit keeps it)"]
  else:
    assert decided.train.grad_accum == 2 and [c["train.grad_accum"] for c in compiled] == [1, 2]
    # a line as each compile ends (the as-written one is not compiled again), then the plan's
    assert len(out) == 3 and out[1].startswith("maxlm: plan: compiled remat=none, grad_accum=2, ")
    assert out[2].startswith("maxlm: plan: set train.grad_accum=2; kept as written: model.remat=none, ")
    assert out[2].endswith(f"2 compiled, 0 not); as written the config peaks at {h(reference[1])} per device")
  assert out[0].startswith(f"maxlm: plan: compiled the config as written: peak {h(reference[1])} of {h(usable)} (")
  monkeypatch.setattr(plan_fit, "gpu_here", lambda: False)  # on a CPU fit does nothing: no compile
  compiled.clear()
  assert plan.for_run(cfg, print) == (cfg, "plan.mode=fit") and compiled == [] and capsys.readouterr().out == ""


def llama70b_params(n_layers: int) -> int:
  """Llama 3 70B's parameter count, written out from its shape (llama70b.yml) for this test."""
  d, heads, kv, dh, ffn, vocab = 8192, 64, 8, 128, 28672, 128256
  layer = d * (heads + 2 * kv) * dh + heads * dh * d + 3 * d * ffn + 2 * d  # qkv, out, MLP, 2 norms
  return 2 * vocab * d + n_layers * layer + d  # embedding, LM head, layers, final norm


def test_llama70b_bytes_per_device_match_a_small_compile():
  # The planner's certain bytes for the 70B shape over 8 devices (FSDP), against XLA's compile of the same step
  # cut to 2 layers on the 8 CPU devices here: the state is the arithmetic's, and XLA needs at least the rest
  cfg = load_config(["config=llama70b.yml", "model.n_layers=2", "model.remat=full", "train.grad_accum=8",
                     "optim.offload=none", "model.backend=flax"])
  got = plan_measure.measure(cfg, gpu_footprint=True)
  norms = (2 * 2 + 1) * 8192  # 2 per layer + the final one: replicated, every other parameter split over 8
  held = (llama70b_params(2) - norms) * 4 // 8 + norms * 4  # float32 bytes a device holds
  assert got["params"] == held and got["opt_state"] == 2 * held + 8  # Adam's mu, nu + 2 int32 counts
  # The planner's certain bytes against the compiled step (a second method, not the planner's formula): at least
  # what that step's state holds on a device (its params and Adam's mu and nu, float32, as sharded) plus the float32
  # gradient sum its 8 micro-batches accumulate (the params' size), less what the planner's split of every
  # parameter leaves out (the replicated norms: 7/8 of their bytes in each of those 4 copies); at most XLA's peak.
  target = Target(8, 1, "NVIDIA H200", 150 * 10**9, 0.95, True)
  need = plan_levers.certain_bytes(cfg, target)["certain"]
  left_out = 4 * (norms * 4 - norms * 4 // 8)
  assert 2 * got["params"] + got["opt_state"] - 8 - left_out <= need <= got["device"], (need, got)


def test_llama70b_on_one_gpu_names_the_smallest_device_count(tmp_path, monkeypatch, capsys):
  # The trainer on one (faked) H200: nothing fits; the doubling skips 2 devices by the certain bytes and measures 4
  # and 8, here with a made-up XLA that needs 70 GiB over the certain bytes: with the parameters and moments in
  # host memory (offload=host_params, the levers' most saving values) 4 do not fit and 8 do (with the moments
  # alone, offload=host, 8 would not: 16 was the answer before host_params)
  h200 = Target(1, 1, "NVIDIA H200", gpu_named(DEFAULT_GPU).memory, 0.95, False)
  monkeypatch.setattr(plan_fit, "gpu_here", lambda: True)
  monkeypatch.setattr(plan_fit, "make_target", lambda *a, **k: h200)
  seen = []

  def fake_measure(self, c):
    seen.append(self.n_devices)
    return {"device": plan_levers.certain_bytes(c, self)["certain"] + 70 * 2**30, "how": "measured"}
  monkeypatch.setattr(Target, "measure", fake_measure)
  assert train_main(["config=llama70b.yml", f"output_dir={tmp_path}", "model.backend=flax"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("maxlm: error: no setting of plan.levers (model.remat,")
  assert "; as written the config certainly needs " in err
  assert "; the smallest device count that fits is 8 (remat=full, grad_accum=8, offload=host_params, " in err
  assert seen == [4, 8] and not any(tmp_path.iterdir())  # nothing written
  eight = Target(8, 1, "NVIDIA H200", gpu_named(DEFAULT_GPU).memory, 0.95, True)
  cfg = load_config(["config=llama70b.yml", "model.backend=flax", "model.remat=full", "train.grad_accum=8"])
  assert (plan_levers.certain_bytes(plan_levers.apply(cfg, {"optim.offload": "host"}), eight)["certain"] + 70 * 2**30
          > eight.usable)
  assert (plan_levers.certain_bytes(plan_levers.apply(cfg, {"optim.offload": "host_params"}), eight)["certain"]
          + 70 * 2**30 <= eight.usable)



def test_a_config_too_big_for_this_cpu_says_how_to_size_it_for_gpus(tmp_path, capsys):
  """The trainer on CPU devices (the planner acts on GPUs only) stops a config whose certain bytes exceed a
  device with sizing's line, now ending with how to size it for GPUs; one line, nothing written."""
  assert train_main(["config=llama8b.yml", f"output_dir={tmp_path}", "model.backend=flax"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("maxlm: error: model needs at least ")  # per simulated device
  assert err.endswith("or use more devices; no GPU here: `maxlm plan config=... --devices N --simulate` sizes it "
                      "for N H200s\n")
  assert not any(tmp_path.iterdir())

def fake_target(usable: int) -> Target:
  return Target(8, 1, "NVIDIA H200", int(usable / 0.95 / (1 - plan_target.MARGIN)) + 1, 0.95, True)


def test_search_is_deterministic_and_compiles_only_what_it_must():
  cfg = load_config([*BASE, "plan.levers=all"])  # BASE writes model.remat: handed to the planner here
  probe = fake_target(2**30)
  first = plan_levers.candidates(cfg, probe, "flax")[0]  # the first tried
  base = plan_levers.certain_bytes(plan_levers.apply(cfg, first), probe)["certain"]
  target = fake_target(base + 5 * 2**20)
  # Made-up peaks above each candidate's certain bytes (MiB): none and save_dots_attn never fit, save_dots
  # runs XLA out of memory, the others fit; an offloaded state costs 1 MiB more.
  extra = {"none": 8, "save_dots_attn": 6, "save_qkv_attn": 4.5, "save_attn": 4, "full": 3}
  seen = []

  def measure(c):
    seen.append(plan_levers.current(c))
    if c.model.remat == "save_dots":
      return {"oom": "RESOURCE_EXHAUSTED"}
    mib = extra[c.model.remat] + (c.optim.offload != "none")
    return {"device": plan_levers.certain_bytes(c, target)["certain"] + int(mib * 2**20), "how": "measured"}

  p1 = plan_levers.search(cfg, target, measure, "flax")
  first = list(seen)
  p2 = plan_levers.search(cfg, target, measure, "flax")
  assert seen[len(first):] == first and [r.overrides for r in p1.rows] == [r.overrides for r in p2.rows]
  assert p1.chosen is not None and p1.chosen.overrides == p2.chosen.overrides
  order = [r.overrides for r in p1.rows]
  assert len(order) == 6 * 2 * 3 * 3  # remat (Flax: 6) x accumulation 1, 2 x offload (3) x (mu, nu) dtypes
  moments = ("optim.mu_dtype", "optim.nu_dtype")
  assert {tuple(o[k] for k in moments) for o in order} == {("float32", "float32"), ("bfloat16", "float32"),
                                                          ("bfloat16", "bfloat16")}  # no bf16 nu with fp32 mu
  # the order itself (estimate, then exact moments, then lever order) is checked against hand-made times in
  # tests/test_plan_levers.py: computing it here with cost.step_time would check the estimate against itself
  i = order.index(p1.chosen.overrides)
  assert p1.chosen.status == "fits" and p1.chosen.measured <= target.usable
  assert all(r.status in ("too big", "pruned") for r in p1.rows[:i])
  assert all(r.status == "not tried" for r in p1.rows[i + 1:])
  # compiled: exactly the rows with a measurement or an out-of-memory compile, once each, in order
  assert [r.overrides for r in p1.rows if r.measured is not None or "out of memory" in r.note] == first
  # pruned: certain + share x rough activations over the usable memory; the share is kept per remat policy:
  # 1/2 until a candidate of that policy is measured, then the least (measured - certain) / activations seen
  # for that policy, at most 1
  shares = {}
  for r in p1.rows[:i + 1]:
    need = plan_levers.certain_bytes(plan_levers.apply(cfg, r.overrides), target)
    remat = r.overrides["model.remat"]
    share = min([0.5] if remat not in shares else [1.0, *shares[remat]])
    assert (r.status == "pruned") == (need["certain"] + int(share * need["activations"]) > target.usable)
    if r.measured is not None:
      shares.setdefault(remat, []).append(max(0, r.measured - need["certain"]) / need["activations"])
  assert shares["none"][0] > 1  # so none's share went to 1
  assert [r.status for r in p1.rows[:2]] == ["too big", "too big"]  # save_dots_attn's own share: 1/2, compiled
  # one share for all would have pruned save_dots_attn after none's measurement (> 1): its own stays 1/2
  assert [r.overrides["model.remat"] for r in p1.rows[:i + 1]] == ["none", "save_dots_attn", "save_dots",
                                                                  "save_qkv_attn"]
  expected = next(o for o in order if o["model.remat"] not in ("none", "save_dots_attn", "save_dots")
                  and plan_levers.certain_bytes(plan_levers.apply(cfg, o), target)["certain"]
                  + int((extra[o["model.remat"]] + (o["optim.offload"] != "none")) * 2**20) <= target.usable)
  assert p1.chosen.overrides == expected  # the first that fits, nothing earlier that would have
  # a measurement made already (plan.mode=fit's of the config as written) is used, not pruned nor compiled again
  pruned = p1.rows[1].overrides
  seen.clear()
  p3 = plan_levers.search(cfg, target, measure, "flax", known={tuple(pruned.items()): {"device": 1, "how": "measured"}})
  assert p3.rows[1].status == "fits" and p3.rows[1].measured == 1 and p3.chosen is p3.rows[1]
  assert seen == [plan_levers.current(plan_levers.apply(cfg, p1.rows[0].overrides))]  # only the first row was compiled


def test_step_time_counts_the_context_exchange():
  """Llama 3 8B at 131,072 tokens on 8 H200s as fsdp 2 x context 4, 2 rows: each device holds one row's 32,768
  positions and receives, per layer, the other 3 devices' K and V (8 KV heads x 128, bf16) three times (forward,
  and the backward's blocks and gradients): 3 x 32 layers x 2 x (32768 x 8 x 128 x 2 B) x 3 at NVLink's 450 GB/s."""
  target = Target(n_devices=8, n_nodes=1, kind="NVIDIA H200", device_bytes=141 * 10**9, fraction=None,
                  simulated=True)
  args = ["config=llama8b", "data.seq_len=131072", "data.global_batch_size=2", "mesh.fsdp=2"]
  cp = step_time(load_config([*args, "mesh.context=4"]), target)
  want = 3 * 32 * 2 * (32768 * 8 * 128 * 2) * 3 / 450e9
  assert cp["context_s"] == pytest.approx(want, rel=1e-12)
  fsdp_only = step_time(load_config([*args, "data.global_batch_size=8", "mesh.fsdp=8"]), target)
  assert fsdp_only["context_s"] == 0.0


def test_lever_values_split_the_batch_and_stay_in_plan_levers():
  cfg = load_config(["model.backend=flax", "data.global_batch_size=24", "plan.levers=train.grad_accum,model.remat"])
  v = plan_levers.lever_values(cfg, fake_target(2**30), "flax")
  assert v["train.grad_accum"] == (1,)  # 24 rows over 8 devices: halves (12 rows) no longer split evenly
  assert v["optim.offload"] == ("none",) and v["optim.mu_dtype"] == v["optim.nu_dtype"] == ("float32",)  # not in
  # plan.levers
  assert "recompute_norm_act" not in v["model.remat"] and v["model.remat"][0] == "none"
  cfg = load_config(["data.global_batch_size=64"])
  assert plan_levers.lever_values(cfg, fake_target(2**30), "te")["train.grad_accum"] == (1, 2, 4, 8)
  with pytest.raises(ConfigError, match="unknown lever 'model.bogus'"):
    plan_levers.parse_levers("model.remat, model.bogus")


def _streamed_peak(leaves: list[int], lag: int, arrays: int = 2) -> int:
  """Device bytes of the streamed update (maxlm/optim.py, optim.offload=host), simulated parameter by parameter in
  the order given: parameter i's moments (mu and nu, float32, `leaves[i]` bytes each; arrays=3: the parameter
  too, host_params) come in once those of parameter i - lag have gone back, each held old and new while updated:
  at every parameter, the last `lag`."""
  return max(sum(2 * arrays * b for b in leaves[max(0, i - lag + 1):i + 1]) for i in range(len(leaves)))


def test_offload_arithmetic_for_simulated_gpus():
  # A made-up XLA:CPU peak of 30,000 B holding the optimizer state (mu and nu of parameters of 1500, 1500, 500 and
  # 250 float32 bytes: 7,500 B); in host memory, the state leaves 22,500 B, and the streamed update adds its worst
  # order's peak, simulated above: the two 1500-byte parameters side by side, 2 x (mu, nu) x (old, new) x 1500.
  leaves = [1500, 1500, 500, 250]
  worst = max(_streamed_peak(list(order), LAG) for order in itertools.permutations(leaves))
  assert worst == 12_000
  stats = {"device": 30_000, "params": 3_750, "opt_state": 7_500, "opt_leaf_fp32": 1_500, "how": "measured"}
  assert plan_measure.offloaded(stats)["device"] == 22_500 + worst == 34_500
  assert plan_measure.offloaded(stats)["how"].startswith("arithmetic")
  # one largest parameter: the arithmetic (from the largest alone) may be above the simulation, never below it
  leaves = [1500, 800, 250]
  worst = max(_streamed_peak(list(order), LAG) for order in itertools.permutations(leaves))
  assert worst == 9_200  # 1500 and 800 side by side
  stats = {**stats, "params": 2_550, "opt_state": 5_100}
  assert plan_measure.offloaded(stats)["device"] >= 30_000 - 5_100 + worst
  # host_params: the parameters (3,750 B) leave the device too, and stream with their moments: the two 1500-byte
  # parameters side by side, 2 x (p, mu, nu) x (old, new) x 1500
  leaves = [1500, 1500, 500, 250]
  worst = max(_streamed_peak(list(order), LAG, arrays=3) for order in itertools.permutations(leaves))
  assert worst == 18_000
  stats = {"device": 30_000, "params": 3_750, "opt_state": 7_500, "opt_leaf_fp32": 1_500, "how": "measured"}
  both = plan_measure.offloaded(stats, "host_params")
  assert both["device"] == 30_000 - 7_500 - 3_750 + worst == 36_750
  assert both["how"].startswith("arithmetic") and "parameters and the optimizer state" in both["how"]


def test_simulated_devices_in_a_child_measure_like_here():
  cfg = load_config(["model.backend=flax", "data.type=synthetic"])
  here = plan_measure.measure(cfg, gpu_footprint=True)
  sim = plan_target.Simulator(8)
  try:
    got = sim.measure(cfg)
    assert sim.measure(plan_levers.apply(cfg, {"optim.offload": "host"}))["how"].startswith("arithmetic")
    both = sim.measure(plan_levers.apply(cfg, {"optim.offload": "host_params"}))
  finally:
    sim.close()
  assert got["device"] == here["device"]
  # host_params: the program of offload=none holding the parameters' compute copy (model.cast_params_once), less
  # the parameters and the optimizer state, plus the streamed parameters and moments
  once = plan_measure.measure(plan_levers.apply(cfg, {"model.cast_params_once": True}), gpu_footprint=True)
  assert both["device"] == plan_measure.offloaded(once, "host_params")["device"]
  assert "parameters and the optimizer state" in both["how"]
  # the stand-in keeps fused attention's footprint: no [B, H, T, T] scores, so less than real CPU attention
  assert here["device"] < plan_measure.measure(cfg)["device"]


def test_out_of_memory_line_takes_its_inputs_as_arguments(monkeypatch):
  """oom_message(cfg, how, compiled_gb, err): the decided config's levers, how they came, XLA's estimate and the
  device's memory (under the test switch, a GPU's 10 GiB bytes_limit), and the next lever."""
  monkeypatch.setenv("MAXLM_TEST_GPU_PATHS", "1")
  monkeypatch.setenv("MAXLM_TEST_DEVICE_BYTES", str(10 * 2**30))
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  cfg = load_config([*BASE, "plan.mode=auto", "model.remat=save_attn"])
  error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.5GiB.")
  line = oom_message(cfg, "chosen by plan.mode=auto", 2**33 / 1e9, error)
  assert line == ("out of memory on 8 x cpu (as a GPU: MAXLM_TEST_GPU_PATHS=1) with model.remat=save_attn, "
                  "train.grad_accum=1, optim.offload=none, optim.mu_dtype=float32, optim.nu_dtype=float32 (chosen by plan.mode=auto): "
                  "XLA could not allocate 3.5GiB; XLA's estimate of the step is 8.0 GiB per device; the device has "
                  "10.0 GiB for XLA; next lever: model.remat=full")


def test_out_of_memory_is_one_line_naming_levers_sizes_and_next_lever(tmp_path, monkeypatch, capsys):
  cfg = load_config([*BASE, f"output_dir={tmp_path}", "model.remat=save_attn"])
  error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 43.92GiB.\nmore")

  def run_trainer(trainer, preemption, startup, wd, held):  # the run's first step, as XLA fails it
    raise error
  monkeypatch.setattr("maxlm.trainer.run", run_trainer)
  assert run(cfg) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("maxlm: error: out of memory on 8 x cpu with model.remat=save_attn, ")
  assert "XLA could not allocate 43.92GiB" in err and "(plan.mode=fit)" in err
  assert "next lever: model.remat=full (or plan.mode=auto" in err
  other = jax.errors.JaxRuntimeError("INTERNAL: something else")
  monkeypatch.setattr("maxlm.trainer.run", lambda *a: (_ for _ in ()).throw(other))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # not an OOM: the traceback stays
    run(cfg)


def test_bad_input_is_one_line_exit_2(capsys):
  assert cli_main(["plan", "plan.levers=model.remat,optim.bogus"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown lever 'optim.bogus'" in err
  assert cli_main(["plan", "--devices", "0"]) == 2
  assert capsys.readouterr().err == "maxlm: error: argument --devices must be a positive number, got '0'\n"
  # nothing fits: the table, then one line (a CPU target names no device count)
  assert cli_main(["plan", *BASE, "plan.levers=train.grad_accum", "--device-memory-gb", "0.001"]) == 2
  out, err = capsys.readouterr()
  # plan.levers keeps four levers: tried with every lever free too (a progress line says so), nothing fits either
  assert err.count("maxlm: error:") == 1 and err.splitlines()[-1].startswith(
      "maxlm: error: no setting of plan.levers (model.remat,train.grad_accum,optim.offload,optim.mu_dtype,"
      "optim.nu_dtype) fits 8 x cpu")
  assert "; every lever tried, the ones plan.levers keeps (model.remat=none, optim.offload=none, " in err


def test_the_choice_follows_measured_step_times():
  """With a timer (on GPUs at hand: maxlm/plan/timing.py; here a fake one), the first `timed` candidates that fit
  are timed and the fastest measured is chosen, whatever the roofline's order; a candidate whose step runs out of
  memory when run (timer: None) does not fit after all; nothing after the timed ones is compiled or timed."""
  cfg = load_config([*BASE, "plan.levers=model.remat"])
  target = fake_target(2**40)  # everything fits
  order = [o["model.remat"] for o in plan_levers.candidates(cfg, target, "flax")]
  compiled, timed = [], []

  def measure(c):
    compiled.append(c.model.remat)
    return {"device": plan_levers.certain_bytes(c, target)["certain"], "how": "measured"}

  def timer_for(seconds):
    def timer(c):
      timed.append(c.model.remat)
      return seconds[c.model.remat]
    return timer

  # measured times the reverse of the estimate: the third is fastest
  seconds = {r: 1.0 + 0.1 * (3 - i) for i, r in enumerate(order)}
  p = plan_levers.search(cfg, target, measure, "flax", timer=timer_for(seconds), timed=3)
  assert compiled == timed == order[:3] and p.chosen.overrides == {**p.chosen.overrides, "model.remat": order[2]}
  assert [r.seconds for r in p.rows[:3]] == [seconds[r] for r in order[:3]] and p.rows[3].status == "not tried"
  assert f"step {seconds[order[2]]:.3g} s measured, the fastest of 3 timed" in p.line()
  # the second is fastest; the first ran out of memory running
  compiled.clear(), timed.clear()
  seconds = {**seconds, order[0]: None, order[1]: 0.5}
  p = plan_levers.search(cfg, target, measure, "flax", timer=timer_for(seconds), timed=2)
  assert timed == order[:2] and p.chosen is p.rows[1] and p.rows[0].status == "too big"
  assert p.rows[0].note == "ran out of device memory running the step"
  # without a timer: the first that fits by the estimate, and the line says so
  p = plan_levers.search(cfg, target, measure, "flax")
  assert p.chosen is p.rows[0] and p.rows[0].seconds is None
  assert "estimated (roofline), not measured" in p.line()


def test_only_the_gpus_at_hand_of_one_process_are_timed():
  cfg = load_config(BASE)
  here = Target(1, 1, "NVIDIA H200", 141 * 10**9, 0.95, False, jax.devices()[:1])
  assert plan_levers.timer(cfg, here) is not None
  assert plan_levers.timer(plan_levers.apply(cfg, {"plan.timed": 0}), here) is None
  assert plan_levers.timer(cfg, fake_target(2**30)) is None  # simulated
  assert plan_levers.timer(cfg, Target(8, 1, "cpu", 2**30, None, False, jax.devices())) is None  # CPU devices


def test_every_candidate_pruned_says_nothing_was_compiled():
  """Where the analytic model prunes every candidate the message says so, and does not claim XLA measured."""
  cfg = load_config([*BASE, "plan.levers=train.grad_accum"])
  target = Target(8, 1, "cpu", 1000, None, False, jax.devices())

  def measure(c):
    raise AssertionError("nothing may be compiled")
  p = plan_levers.search(cfg, target, measure, "flax")
  msg = plan_no_fit.no_fit_message(cfg, p)
  assert p.chosen is None and all(r.status == "pruned" for r in p.rows)
  assert "usable per device; pruned by the analytic model, nothing compiled; the least of the 2 candidates pruned " \
         "is remat=none, grad_accum=" in msg
  assert "measured by XLA" not in msg


# --- several processes: process 0 decides, every process runs its plan (tests/processes.py) ---------------------

@pytest.mark.slow
def test_process_1s_planner_reads_its_own_device_and_runs_process_0s_plan(tmp_path):
  """Two processes, plan.mode=auto: the planner of process 1 used to ask jax.devices()[0] (process 0's device, not
  addressable there) for its memory and died ("MemoryStats is only supported for addressable PjRt devices")."""
  procs = processes.start(2, ["run_name=r", "train.steps=3", "data.global_batch_size=8", "mesh.dcn_fsdp=2",
                              "plan.mode=auto", "plan.levers=train.grad_accum"], tmp_path)
  codes = processes.finish(procs, 240)
  outs = [processes.output(tmp_path, i) for i in range(2)]
  assert codes == [0, 0], outs
  assert not any(processes.errors(o + e) for o, e in outs), outs
  # the plan's line once, from process 0; both processes trained the 3 steps of one program
  assert sum("maxlm: plan: set train.grad_accum=1; kept as written: model.remat=full" in o for o, _ in outs) == 1
  assert "maxlm: plan:" in outs[0][0] and "step 3/3" in outs[0][0]


@pytest.mark.slow
def test_processes_whose_measurements_differ_still_run_one_plan(tmp_path):
  """The test switch gives the GPU paths on CPU (plan.mode=fit measures the devices at hand) and each process its
  own device memory: process 0's fits the config as written, process 1's fits nothing. Process 1 must run process
  0's plan, saying so in one warning line, never its own (a different program would hang the first collective)."""
  env = [{"MAXLM_TEST_GPU_PATHS": "1", "MAXLM_TEST_DEVICE_BYTES": str(2**30)},
         {"MAXLM_TEST_GPU_PATHS": "1", "MAXLM_TEST_DEVICE_BYTES": "1024"}]
  procs = processes.start(2, ["run_name=r", "train.steps=3", "data.global_batch_size=8", "mesh.dcn_fsdp=2",
                              "plan.mode=fit", "plan.levers=train.grad_accum"], tmp_path, env)
  codes = processes.finish(procs, 240)
  outs = [processes.output(tmp_path, i) for i in range(2)]
  assert codes == [0, 0], outs
  assert not any(processes.errors(o + e) for o, e in outs), outs
  assert "maxlm: plan: the config fits as written (peak " in outs[0][0]
  warnings = [ln for ln in (outs[1][0] + outs[1][1]).splitlines() if "warning: plan:" in ln]
  assert len(warnings) == 1 and warnings[0].endswith(
      "maxlm: warning: plan: this process sees cpu (as a GPU: MAXLM_TEST_GPU_PATHS=1) with 1.0 KiB, process 0 "
      "cpu (as a GPU: MAXLM_TEST_GPU_PATHS=1) with 1.0 GiB; every process runs process 0's plan (model.remat=full, "
      "train.grad_accum=1, optim.offload=none, optim.mu_dtype=float32, optim.nu_dtype=float32)"), warnings
  assert "warning: plan:" not in outs[0][0] + outs[0][1]
  assert "train:\n" in (tmp_path / "runs" / "r" / "config.yml").read_text()
  assert "grad_accum: 1" in (tmp_path / "runs" / "r" / "config.yml").read_text()


def test_less_exact_moments_come_first_only_when_the_estimate_gains_more_than_its_resolution():
  """The roofline prices bfloat16 moments a little faster even where the optimizer is a sliver of the step (less
  HBM traffic): within cost.TIE of their float32 twin they must not come first, since the estimate does not resolve
  that and the loss of precision is certain; where they gain more (moments crossing the host link), they do."""
  target = fake_target(2**40)  # everything fits
  levers = {"plan.levers": "optim.mu_dtype,optim.nu_dtype"}
  on_device = plan_levers.apply(load_config(BASE), levers)
  est = {o["optim.nu_dtype"] + o["optim.mu_dtype"]: step_time(plan_levers.apply(on_device, o), target)["total_s"]
         for o in plan_levers.candidates(on_device, target, "flax")}
  assert est["bfloat16bfloat16"] < est["float32float32"] < est["bfloat16bfloat16"] * (1 + TIE)  # the premise
  first = plan_levers.candidates(on_device, target, "flax")[0]
  assert (first["optim.mu_dtype"], first["optim.nu_dtype"]) == ("float32", "float32")
  offloaded = plan_levers.apply(on_device, {"optim.offload": "host"})
  times = [step_time(plan_levers.apply(offloaded, o), target)["total_s"] for o in plan_levers.candidates(offloaded, target, "flax")]
  first = plan_levers.candidates(offloaded, target, "flax")[0]
  assert (first["optim.mu_dtype"], first["optim.nu_dtype"]) == ("bfloat16", "bfloat16")
  assert times[0] * (1 + TIE) < times[-1]  # more than the resolution faster than float32 moments


# Keys the user wrote are constraints (issue 55): a tiny model whose made-up XLA says what fits, so that the
# levers decide; plan.timed=0 and no faked GPU kind, so nothing is timed.
MINE = ["model.backend=flax", "data.type=synthetic", "data.seq_len=64", "data.global_batch_size=32",
        "train.steps=2", "checkpoint.enabled=false", "plan.timed=0"]


def made_up_xla(fits):
  """Target.measure for a made-up XLA: half the usable memory where `fits(levers)`, else one byte over it."""
  def measure(self, c):
    return {"device": self.usable // 2 if fits(plan_levers.current(c)) else self.usable + 1, "how": "measured"}
  return measure


def on_faked_gpu(monkeypatch, fits):
  monkeypatch.setattr(plan_target, "_local_memory", lambda dev: 2**30)
  monkeypatch.setattr(plan_fit, "gpu_here", lambda: True)
  monkeypatch.setattr(Target, "measure", made_up_xla(fits))


def one_micro_batch_needs_a_bf16_nu(o):
  return o["train.grad_accum"] > 1 or o["optim.nu_dtype"] == "bfloat16"


@pytest.mark.parametrize("mode", ["fit", "auto"])
@pytest.mark.parametrize("where", ["command line", "own config file"])
def test_lever_keys_the_user_wrote_are_kept(mode, where, tmp_path, monkeypatch, capsys):
  """MaxText's precision asked for (bfloat16 mu, float32 nu) where one micro-batch fits only with a bfloat16 nu:
  the planner accumulates instead and keeps both moments as written; handed every lever (plan.levers=all) it takes
  the bfloat16 nu, as it did for every config before: the made-up XLA makes the moment levers matter."""
  on_faked_gpu(monkeypatch, one_micro_batch_needs_a_bf16_nu)
  mine = ["optim.mu_dtype=bfloat16", "optim.nu_dtype=float32"]
  if where == "own config file":
    (tmp_path / "mine.yml").write_text("base: tiny.yml\noptim:\n  mu_dtype: bfloat16\n  nu_dtype: float32\n")
    mine = [f"config={tmp_path / 'mine.yml'}"]
  cfg = load_config([*mine, *MINE, f"plan.mode={mode}", f"output_dir={tmp_path}"])
  assert cfg.plan.levers == "model.remat,train.grad_accum,optim.offload"
  decided, _ = plan.for_run(cfg, print)
  line = capsys.readouterr().out.splitlines()[-1]
  assert (decided.optim.mu_dtype, decided.optim.nu_dtype) == ("bfloat16", "float32")
  assert decided.train.grad_accum > 1
  assert "; kept as written: optim.mu_dtype=bfloat16, optim.nu_dtype=float32 (peak " in line
  assert line.startswith(f"maxlm: plan: set model.remat={decided.model.remat}, train.grad_accum="
                         f"{decided.train.grad_accum}, optim.offload=none; kept")
  handed, _ = plan.for_run(plan_levers.apply(cfg, {"plan.levers": "all"}), print)
  assert (handed.train.grad_accum, handed.optim.nu_dtype) == (1, "bfloat16")


def test_a_shipped_configs_lever_values_are_the_planners_to_move(tmp_path, monkeypatch, capsys):
  """config=tiny.yml (shipped) writes model.remat: its values count as defaults; a file of one's own that builds on
  it and writes the key makes it the user's."""
  on_faked_gpu(monkeypatch, lambda o: o["model.remat"] != "full")
  cfg = load_config(["config=tiny.yml", "model.remat=full", *MINE, f"output_dir={tmp_path}"])
  with pytest.raises(ConfigError, match="change model.remat=full to "):
    plan.for_run(cfg)
  shipped = load_config(["config=tiny.yml", *MINE, f"output_dir={tmp_path}"])
  assert shipped.plan.levers == "auto" and plan.for_run(shipped)[0].model.remat != "full"


@pytest.mark.parametrize("mode", ["fit", "auto"])
def test_nothing_fits_with_the_users_keys_one_line_names_them_and_what_fits(mode, tmp_path, monkeypatch, capsys):
  """A float32 nu written where only a bfloat16 one fits: no silent change; the run stops at start in one line that
  names the key to change, to what, and the fastest setting that fits; nothing written."""
  on_faked_gpu(monkeypatch, lambda o: o["optim.nu_dtype"] == "bfloat16")
  code = train_main(["optim.mu_dtype=bfloat16", "optim.nu_dtype=float32", *MINE, f"plan.mode={mode}",
                     f"output_dir={tmp_path}"])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1 and not any(tmp_path.iterdir())
  assert err.startswith("maxlm: error: with the lever keys kept as written (optim.mu_dtype=bfloat16, "
                        "optim.nu_dtype=float32; plan.levers=model.remat,train.grad_accum,optim.offload) nothing "
                        "fits 8 x cpu: ")
  assert "; change optim.nu_dtype=float32 to bfloat16: the fastest setting that fits is model.remat=" in err
  assert ", optim.mu_dtype=bfloat16, optim.nu_dtype=bfloat16 (peak " in err
  assert err.endswith("; set those keys so, or leave them out of your config to let the planner choose them\n")


def test_simulated_devices_keep_the_users_keys_too(monkeypatch):
  """`maxlm plan --devices 16` (simulated GPUs): the same constraint, and the same line when nothing fits."""
  monkeypatch.setattr(Target, "measure", made_up_xla(one_micro_batch_needs_a_bf16_nu))
  cfg = load_config(["optim.mu_dtype=bfloat16", "optim.nu_dtype=float32", *MINE])
  p = plan_decision.choose(cfg, n_devices=16)
  assert p.target.simulated and (p.cfg.optim.mu_dtype, p.cfg.optim.nu_dtype) == ("bfloat16", "float32")
  assert p.cfg.train.grad_accum > 1
  monkeypatch.setattr(Target, "measure", made_up_xla(lambda o: o["optim.nu_dtype"] == "bfloat16"))
  with pytest.raises(ConfigError, match="; change optim.nu_dtype=float32 to bfloat16: the fastest setting"):
    plan_decision.choose(cfg, n_devices=16)
