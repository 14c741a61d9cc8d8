"""The memory planner (maxlm/plan/__init__.py, plan_measure.py, cli/plan.py) on 8 simulated CPU devices: its per-device
bytes equal XLA's memory analysis of the step the trainer compiles (read here off the trainer's own executable),
a config that fits only with a memory-saving lever gets it (CLI table, trainer, dry run), the search is
deterministic and compiles only what it must, and an out-of-memory error ends in one line."""

import json

import jax
import numpy as np
import pytest

from maxlm import plan
from maxlm.cli import main as cli_main
from maxlm.cli.train import main as train_main
from maxlm.cli.train import run
from maxlm.config import ConfigError, load_config
from maxlm.plan import measure as plan_measure
from maxlm.plan.measure import Target
from maxlm.tables import human_bytes
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
  return (reference[1] + reference[2]) / 2 / (1 - plan_measure.MARGIN) / 1e9


def test_cli_table_chooses_the_lever_that_fits(reference, capsys):
  code = cli_main(["plan", *BASE, "plan.levers=train.grad_accum", "--device-memory-gb", str(midpoint_gb(reference))])
  out, err = capsys.readouterr()
  assert code == 0 and err == ""
  rows = [ln for ln in out.splitlines() if ln[2:6].strip().isdigit()]
  assert len(rows) == 2  # accumulation 1 (too big), then 2 (fits): both compiled, in that order
  assert rows[0].startswith("  ") and rows[0].split()[:3] == ["1", "none", "1"] and "too big" in rows[0]
  assert rows[1].startswith("* ") and rows[1].split()[1:4] == ["2", "none", "2"] and rows[1].endswith("fits")
  assert "chosen: model.remat=none train.grad_accum=2 optim.offload=none optim.state_dtype=float32" in out
  assert "8 x cpu" in out and "measured by XLA on the devices at hand" in out


def test_trainer_and_dry_run_apply_the_plan(reference, tmp_path, monkeypatch, capsys):
  usable = (reference[1] + reference[2]) // 2
  monkeypatch.setattr(plan_measure, "_local_memory", lambda dev: int(usable / (1 - plan_measure.MARGIN)) + 1)
  auto = [*BASE, "plan.mode=auto", "plan.levers=train.grad_accum", f"output_dir={tmp_path}"]
  cfg = load_config(auto)
  tr = Trainer(cfg)
  assert tr.cfg.train.grad_accum == 2 and cfg.train.grad_accum == 1
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith(
      "maxlm: plan: model.remat=none, train.grad_accum=2, optim.offload=none, optim.state_dtype=float32 (peak "
      f"{human_bytes(reference[2])} of ")
  assert out[0].endswith("usable per device; measured by XLA on the devices at hand; 2 compiled, 0 not)")
  code = train_main(["--dry-run", "--json", *auto])
  p = json.loads(capsys.readouterr().out)
  assert code == 0 and p["config"]["train"]["grad_accum"] == 2 and "train.grad_accum=2" in p["plan"]


@pytest.mark.parametrize("where", ["midpoint", "roomy"])
def test_fit_keeps_a_config_that_fits_and_plans_one_that_does_not(reference, where, tmp_path, monkeypatch, capsys):
  # plan.mode=fit (the default) on a GPU (faked): one compile of the config as written; kept when it fits,
  # else the search's choice, the as-written measurement not compiled again
  usable = {"midpoint": (reference[1] + reference[2]) // 2, "roomy": 2 * reference[1]}[where]
  monkeypatch.setattr(plan_measure, "_local_memory", lambda dev: int(usable / (1 - plan_measure.MARGIN)) + 1)
  monkeypatch.setattr(plan, "gpu_here", lambda: True)
  compiled = []
  monkeypatch.setattr(Target, "measure", lambda self, c: compiled.append(plan.current(c))
                      or plan_measure.measure(c, self.devices))
  cfg = load_config([*BASE, "plan.levers=train.grad_accum", f"output_dir={tmp_path}"])
  assert cfg.plan.mode == "fit"
  tr = Trainer(cfg)
  out = capsys.readouterr().out.splitlines()
  h = human_bytes
  if where == "roomy":
    assert tr.cfg is cfg and [c["train.grad_accum"] for c in compiled] == [1]
    assert out == [f"maxlm: plan: the config fits as written (peak {h(reference[1])} of {h(usable)} usable per "
                   "device, measured by XLA; plan.mode=fit keeps it)"]
  else:
    assert tr.cfg.train.grad_accum == 2 and [c["train.grad_accum"] for c in compiled] == [1, 2]
    assert len(out) == 1 and out[0].startswith("maxlm: plan: model.remat=none, train.grad_accum=2, ")
    assert out[0].endswith(f"2 compiled, 0 not); as written the config peaks at {h(reference[1])} per device")
  monkeypatch.setattr(plan, "gpu_here", lambda: False)  # on a CPU fit does nothing: no compile
  compiled.clear()
  assert Trainer(cfg).cfg is cfg and compiled == [] and capsys.readouterr().out == ""


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
  target = Target(8, 1, "NVIDIA H200", 150 * 10**9, 0.95, True)
  need = plan.certain_bytes(cfg, target)
  params = llama70b_params(2) * 4 // 8  # the planner splits every parameter: a lower bound (the norms are small)
  logits = 1 * 1024 * 128256 * (4 + 2)  # a row per device per micro-batch, a 1024-position chunk, fp32 + bf16
  assert need["certain"] == params + 2 * params + 2 * params + logits  # params, grads twice (accumulating), moments
  assert need["certain"] <= got["device"]


def test_llama70b_on_one_gpu_names_the_smallest_device_count(tmp_path, monkeypatch, capsys):
  # The trainer on one (faked) H200: nothing fits; the doubling skips 2 and 4 devices by the certain bytes and
  # measures 8 and 16, here with a made-up XLA that needs 35 GiB over the certain bytes (8 do not fit, 16 do)
  h200 = Target(1, 1, "NVIDIA H200", int(139.87 * 2**30), 0.95, False)  # what JAX reports of an H200
  monkeypatch.setattr(plan, "gpu_here", lambda: True)
  monkeypatch.setattr(plan, "make_target", lambda *a, **k: h200)
  seen = []

  def fake_measure(self, c):
    seen.append(self.n_devices)
    return {"device": plan.certain_bytes(c, self)["certain"] + 35 * 2**30, "how": "measured"}
  monkeypatch.setattr(Target, "measure", fake_measure)
  assert train_main(["config=llama70b.yml", f"output_dir={tmp_path}", "model.backend=flax"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("maxlm: error: no setting of plan.levers (model.remat,")
  assert "; as written the config certainly needs " in err
  assert "; the smallest device count that fits is 16 (remat=full, grad_accum=4, offload=host, " in err
  assert seen == [8, 16] and not any(tmp_path.iterdir())  # nothing written



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
  return Target(8, 1, "NVIDIA H200", int(usable / 0.95 / (1 - plan_measure.MARGIN)) + 1, 0.95, True)


def test_search_is_deterministic_and_compiles_only_what_it_must():
  cfg = load_config(BASE)
  probe = fake_target(2**30)
  base = plan.certain_bytes(cfg, probe)["certain"]
  target = fake_target(base + 5 * 2**20)
  # Made-up peaks above each candidate's certain bytes (MiB): none and save_dots_attn never fit, save_dots
  # runs XLA out of memory, the others fit; an offloaded state costs 1 MiB more.
  extra = {"none": 8, "save_dots_attn": 6, "save_qkv_attn": 4.5, "save_attn": 4, "full": 3}
  seen = []

  def measure(c):
    seen.append(plan.current(c))
    if c.model.remat == "save_dots":
      return {"oom": "RESOURCE_EXHAUSTED"}
    mib = extra[c.model.remat] + (c.optim.offload == "host")
    return {"device": plan.certain_bytes(c, target)["certain"] + int(mib * 2**20), "how": "measured"}

  p1 = plan.search(cfg, target, measure, "flax")
  first = list(seen)
  p2 = plan.search(cfg, target, measure, "flax")
  assert seen[len(first):] == first and [r.overrides for r in p1.rows] == [r.overrides for r in p2.rows]
  assert p1.chosen is not None and p1.chosen.overrides == p2.chosen.overrides
  order = [r.overrides for r in p1.rows]
  assert len(order) == 6 * 2 * 2 * 2  # remat (Flax: 6) x accumulation 1, 2 x offload x moment dtype
  # fastest estimate first; on a tie the float32 moments first (bfloat16 rounds them)
  times = [plan.step_time(plan.apply(cfg, o), target)["total_s"] for o in order]
  assert all(round(a, 9) <= round(b, 9) for a, b in zip(times, times[1:]))
  for a, b, ta, tb in zip(order, order[1:], times, times[1:]):
    if round(ta, 9) == round(tb, 9) and {k: v for k, v in a.items() if k != "optim.state_dtype"} == {
        k: v for k, v in b.items() if k != "optim.state_dtype"}:
      assert (a["optim.state_dtype"], b["optim.state_dtype"]) == ("float32", "bfloat16")
  i = order.index(p1.chosen.overrides)
  assert p1.chosen.status == "fits" and p1.chosen.measured <= target.usable
  assert all(r.status in ("too big", "pruned") for r in p1.rows[:i])
  assert all(r.status == "not tried" for r in p1.rows[i + 1:])
  # compiled: exactly the rows with a measurement or an out-of-memory compile, once each, in order
  assert [r.overrides for r in p1.rows if r.measured is not None or "out of memory" in r.note] == first
  # pruned: certain + share x rough activations over the usable memory; the share is 1/2 until something
  # is measured, then the least (measured - certain) / activations seen, at most 1
  shares = []
  for r in p1.rows[:i + 1]:
    need = plan.certain_bytes(plan.apply(cfg, r.overrides), target)
    share = min([0.5] if not shares else [1.0, *shares])
    assert (r.status == "pruned") == (need["certain"] + int(share * need["activations"]) > target.usable)
    if r.measured is not None:
      shares.append(max(0, r.measured - need["certain"]) / need["activations"])
  assert shares[0] > 1  # so the share went to 1: save_dots_attn (1 x its activations over) was pruned
  assert [r.status for r in p1.rows[:2]] == ["too big", "pruned"]
  expected = next(o for o in order if o["model.remat"] not in ("none", "save_dots_attn", "save_dots")
                  and plan.certain_bytes(plan.apply(cfg, o), target)["certain"]
                  + int((extra[o["model.remat"]] + (o["optim.offload"] == "host")) * 2**20) <= target.usable)
  assert p1.chosen.overrides == expected  # the first that fits, nothing earlier that would have
  # a measurement made already (plan.mode=fit's of the config as written) is used, not pruned nor compiled again
  pruned = p1.rows[1].overrides
  seen.clear()
  p3 = plan.search(cfg, target, measure, "flax", known={tuple(pruned.items()): {"device": 1, "how": "measured"}})
  assert p3.rows[1].status == "fits" and p3.rows[1].measured == 1 and p3.chosen is p3.rows[1]
  assert seen == [plan.current(plan.apply(cfg, p1.rows[0].overrides))]  # only the first row was compiled


def test_lever_values_split_the_batch_and_stay_in_plan_levers():
  cfg = load_config(["model.backend=flax", "data.global_batch_size=24", "plan.levers=train.grad_accum,model.remat"])
  v = plan.lever_values(cfg, fake_target(2**30), "flax")
  assert v["train.grad_accum"] == (1,)  # 24 rows over 8 devices: halves (12 rows) no longer split evenly
  assert v["optim.offload"] == ("none",) and v["optim.state_dtype"] == ("float32",)  # not in plan.levers
  assert "recompute_norm_act" not in v["model.remat"] and v["model.remat"][0] == "none"
  cfg = load_config(["data.global_batch_size=64"])
  assert plan.lever_values(cfg, fake_target(2**30), "te")["train.grad_accum"] == (1, 2, 4, 8)
  with pytest.raises(ConfigError, match="unknown lever 'model.bogus'"):
    plan.parse_levers("model.remat, model.bogus")


def test_offload_arithmetic_for_simulated_gpus():
  # The peak less the state in host memory, plus the streamed update's moments on the device: LAG = 2
  # parameters, each with mu and nu, old and new, in float32, for the largest parameter (1000 B in fp32).
  stats = {"device": 37_000, "params": 7_000, "opt_state": 14_000, "opt_leaf_fp32": 1_000, "how": "measured"}
  assert plan_measure.offloaded(stats)["device"] == 37_000 - 14_000 + 2 * 2 * 2 * 1_000
  assert plan_measure.offloaded(stats)["how"].startswith("arithmetic")


def test_simulated_devices_in_a_child_measure_like_here():
  cfg = load_config(["model.backend=flax", "data.type=synthetic"])
  here = plan_measure.measure(cfg, gpu_footprint=True)
  sim = plan_measure.Simulator(8)
  try:
    got = sim.measure(cfg)
    assert sim.measure(plan.apply(cfg, {"optim.offload": "host"}))["how"].startswith("arithmetic")
  finally:
    sim.close()
  assert got["device"] == here["device"]
  # the stand-in keeps fused attention's footprint: no [B, H, T, T] scores, so less than real CPU attention
  assert here["device"] < plan_measure.measure(cfg)["device"]


def test_out_of_memory_is_one_line_naming_levers_sizes_and_next_lever(tmp_path, monkeypatch, capsys):
  cfg = load_config([*BASE, f"output_dir={tmp_path}", "model.remat=save_attn"])
  error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 43.92GiB.\nmore")

  def train(cfg, preemption, t_start):
    raise error
  monkeypatch.setattr("maxlm.cli.train.train", train)
  monkeypatch.setattr(plan, "_TRAINER", None)
  assert run(cfg) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("maxlm: error: out of memory on 8 x cpu with model.remat=save_attn, ")
  assert "XLA could not allocate 43.92GiB" in err and "(plan.mode=fit)" in err
  assert "next lever: model.remat=full (or plan.mode=auto" in err
  other = jax.errors.JaxRuntimeError("INTERNAL: something else")
  monkeypatch.setattr("maxlm.cli.train.train", lambda *a: (_ for _ in ()).throw(other))
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
  assert err.count("\n") == 1 and err.startswith("maxlm: error: no setting of plan.levers (train.grad_accum) fits")
