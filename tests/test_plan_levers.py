"""The planner's levers and their search (maxlm/plan/levers.py) and host memory: a candidate that optim.offload would pin past the
host's RAM is never compiled and says why, the no-fit line names it, and a config written that way stops at start
in one line (maxlm/plan/__init__.py `decide`). The order, pruning and timing of the search are tested in
tests/test_plan.py, which predates the module."""

import jax
import processes
import pytest

from maxlm.plan import decision as plan_decision
from maxlm.plan import levers as plan_levers
from maxlm.plan import no_fit as plan_no_fit
from maxlm.cli.train import main as train_main
from maxlm.config import ConfigError, load_config
from maxlm.plan import levers
from maxlm.plan.target import Target

# Counted by hand for these dimensions (flax, untied embedding, float32 parameters):
#   embedding 256 x 64 = 16,384; per layer q 64 x 4 x 16 = 4,096, k and v 64 x 2 x 16 = 2,048 each,
#   o 4,096, MLP 3 x 64 x 128 = 24,576, two norms 128: 36,992, two layers 73,984; final norm 64;
#   head 16,384. In all 106,816 parameters.
DIMS = ["model.backend=flax", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
        "model.ffn_dim=128", "model.n_layers=2", "model.vocab_size=256", "data.type=synthetic", "data.seq_len=32",
        "data.global_batch_size=8", "train.steps=2", "checkpoint.enabled=false"]
N_PARAMS = 106_816
# jax 0.10's XLA:GPU keeps a second copy of the donated state under the step's cond (docs/plan.md)
COPIES = 2 if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11) else 1


def gpu_target(host_bytes, n=1) -> Target:
  """n GPUs with a device memory far above this model, and `host_bytes` of host RAM per device."""
  return Target(n, 1, "NVIDIA H200", 2**40, 0.95, True, host_bytes=host_bytes, host_assumed="given by the test")


@pytest.mark.parametrize("offload, per_param", [("none", 0), ("host", 8), ("host_params", 12)])
def test_host_need_is_the_pinned_state_per_device(offload, per_param):
  """float32 moments (mu and nu: 8 bytes a parameter), and with host_params the float32 parameters (4 more), on
  one device; on 8 devices each holds an eighth (the default mesh puts them all on fsdp)."""
  cfg = load_config([*DIMS, f"optim.offload={offload}"])
  assert levers.host_need(cfg, gpu_target(None)) == N_PARAMS * per_param * COPIES
  assert levers.host_need(cfg, gpu_target(None, 8)) == N_PARAMS * per_param * COPIES // 8


def test_host_short_compares_with_the_share_of_the_hosts_ram():
  cfg = load_config([*DIMS, "optim.offload=host_params"])
  need = N_PARAMS * 12 * COPIES
  exact = -(-need * 10 // 9)  # the least RAM of which 90 % holds `need`
  assert levers.host_short(cfg, gpu_target(exact)) is None
  short = levers.host_short(cfg, gpu_target(exact - 2))
  assert short is not None and short.startswith("pinned host memory ") and "optim.offload=host_params" in short
  assert "exceeds 90% of the host's" in short and short.endswith("per device (given by the test)")
  assert ("x2: jax 0.10" in short) == (COPIES == 2)
  # nothing pinned, no host known, or a CPU (one memory): nothing to check
  assert levers.host_short(load_config(DIMS), gpu_target(1)) is None
  assert levers.host_short(cfg, gpu_target(None)) is None
  assert levers.host_short(cfg, Target(1, 1, "cpu", 2**40, None, True, host_bytes=1)) is None


def test_the_search_compiles_no_candidate_the_host_cannot_hold():
  """The host holds the moments (offload=host) but not the parameters too (host_params): no host_params
  candidate is compiled, each says why; the host ones are measured. Without a known host both are."""
  cfg = load_config([*DIMS, "plan.levers=optim.offload"])
  moments_only = N_PARAMS * 8 * COPIES
  measured = []

  def measure(c):  # every candidate "fits" unless it is offload=none (made-up peaks; none of XLA's)
    measured.append(c.optim.offload)
    return {"device": 2**41 if c.optim.offload == "none" else 2**20, "how": "measured"}

  p = plan_levers.search(cfg, gpu_target(moments_only * 10 // 9 + 10), measure, "flax", everything=True)
  assert measured == ["none", "host"]
  rows = {r.overrides["optim.offload"]: r for r in p.rows}
  assert rows["host_params"].status == "too big" and rows["host_params"].measured is None
  assert rows["host_params"].note.startswith("pinned host memory ")
  assert p.chosen is rows["host"]
  measured.clear()
  plan_levers.search(cfg, gpu_target(None), measure, "flax", everything=True)
  assert sorted(measured) == ["host", "host_params", "none"]


def test_the_no_fit_line_names_the_host():
  cfg = load_config([*DIMS, "plan.levers=optim.offload"])
  p = plan_levers.search(cfg, gpu_target(1), lambda c: {"device": 2**41, "how": "measured"}, "flax")
  assert p.chosen is None
  msg = plan_no_fit.no_fit_message(cfg, p)
  assert ("; remat=full, grad_accum=1, offload=host, mu_dtype=float32, nu_dtype=float32, the fastest held in "
          "host memory, was not compiled: pinned host memory ") in msg, msg
  assert "the smallest device count" not in msg  # a host of 1 byte per device holds nothing on any count


def test_a_config_written_to_pin_more_than_the_host_has_stops_at_start(tmp_path, monkeypatch, capsys):
  """plan.mode=off, optim.offload=host_params, a node of 1 MiB RAM (the test switch: these CPU devices are GPUs
  and the host reports MAXLM_TEST_HOST_BYTES): one line naming optim.offload, exit 2, no run directory."""
  monkeypatch.setenv("MAXLM_TEST_GPU_PATHS", "1")
  monkeypatch.setenv("MAXLM_TEST_HOST_BYTES", str(2**20))
  cfg = load_config([*DIMS, "plan.mode=off", "optim.offload=host_params"])
  with pytest.raises(ConfigError, match=r"^config key 'optim.offload': pinned host memory .* per device "
                                        r"\(this node's RAM over its devices\); use more devices"):
    plan_decision.decide(cfg)
  rc = train_main([*DIMS, "plan.mode=off", "optim.offload=host_params", f"output_dir={tmp_path}", "run_name=r"])
  err = capsys.readouterr().err
  lines = [ln for ln in err.splitlines() if ln.strip()]
  assert rc == 2 and len(lines) == 1 and lines[0].startswith("maxlm: error: config key 'optim.offload'"), err
  assert not (tmp_path / "r").exists()
  # the same config on a host of 1 TiB plans as written
  monkeypatch.setenv("MAXLM_TEST_HOST_BYTES", str(2**40))
  assert plan_decision.decide(cfg)["levers"]["optim.offload"] == "host_params"


def test_two_processes_stop_on_process_0s_host_check_in_one_line_each(tmp_path):
  """Two processes (the test switch: their CPU devices take the GPU paths), plan.mode=off with
  optim.offload=host_params: process 0's host has 1 KiB of RAM, process 1's 1 TiB. Process 0 decides for both
  (maxlm/runtime/agree.py), so both stop at start with process 0's line and exit 2; no run directory."""
  env = [{"MAXLM_TEST_GPU_PATHS": "1", "MAXLM_TEST_DEVICE_BYTES": str(2**34), "MAXLM_TEST_HOST_BYTES": "1024"},
         {"MAXLM_TEST_GPU_PATHS": "1", "MAXLM_TEST_DEVICE_BYTES": str(2**34), "MAXLM_TEST_HOST_BYTES": str(2**40)}]
  procs = processes.start(2, ["run_name=r", "train.steps=2", "data.global_batch_size=8", "mesh.dcn_fsdp=2",
                              "plan.mode=off", "optim.offload=host_params"], tmp_path, env)
  codes = processes.finish(procs, 240)
  outs = [processes.output(tmp_path, i) for i in range(2)]
  assert codes == [2, 2], outs
  for i, (out, err) in enumerate(outs):
    lines = [ln for ln in (out + err).splitlines() if "maxlm: error:" in ln]
    assert len(lines) == 1 and not processes.errors(out + err.replace(lines[0], "")), (out, err)
    assert lines[0].startswith(f"[process {i}/2 ") and "maxlm: error: config key 'optim.offload': pinned host " \
        "memory " in lines[0] and "of the host's 1.0 KiB per device" in lines[0], lines[0]
  assert not (tmp_path / "runs" / "r").exists()


def test_each_compile_and_timing_is_reported_as_it_ends_and_the_budget_stops_the_walk():
  """report(line) hears of every compile (its peak against the usable memory, fits or too big, and its seconds)
  and every timing; with plan.budget_s the walk compiles nothing more once that many seconds have gone and one
  candidate fits, and times no more once one is timed; the line says so. A fake clock advances 100 s per compile
  and 7 s per timing: with a budget of 250 s and the first candidate too big, the second and third (fit) are
  compiled, then the walk stops at 300 s, before the fourth, though plan.timed wants 4 that fit, and only the
  second is timed."""
  cfg = load_config([*DIMS, "plan.levers=model.remat", "plan.budget_s=250"])
  target = gpu_target(None)
  order = levers.candidates(cfg, target, "flax")
  assert len(order) >= 6
  now = [0.0]
  compiled, lines = [], []

  def measure(c):
    now[0] += 100.0
    compiled.append(c.model.remat)
    return {"device": 2**41 if len(compiled) == 1 else 2**20, "how": "measured"}

  def timer(c):
    now[0] += 7.0
    return 0.5

  p = levers.search(cfg, target, measure, "flax", timer=timer, timed=4, report=lines.append,
                    clock=lambda: now[0])
  names = [levers.label(o) for o in order]
  assert compiled == [o["model.remat"] for o in order[:3]]
  assert [r.status for r in p.rows[3:]] == ["not tried"] * (len(order) - 3)
  usable = levers.human_bytes(target.usable)
  assert lines == [f"plan: compiled {names[0]}: peak 2.0 TiB of {usable}, too big (100 s)",
                   f"plan: compiled {names[1]}: peak 1.0 MiB of {usable}, fits (100 s)",
                   f"plan: compiled {names[2]}: peak 1.0 MiB of {usable}, fits (100 s)",
                   f"plan: timed {names[1]}: step 0.5 s (7 s)"]  # past the budget: one timed, no more
  assert p.chosen is p.rows[1] and p.rows[2].status == "fits" and p.rows[2].seconds is None
  assert "search stopped by plan.budget_s=250 after 300 s" in p.line()
  # no budget: the walk goes on to plan.timed fits
  compiled.clear()
  p = levers.search(levers.apply(cfg, {"plan.budget_s": 0}), target, measure, "flax", timer=timer, timed=4,
                    clock=lambda: now[0])
  assert compiled == [o["model.remat"] for o in order[:5]] and "budget" not in p.line()  # one too big, 4 fit
  # nothing fits yet when the budget is spent: the walk goes on until one does
  compiled.clear()

  def fourth_fits(c):  # 100 s a compile; the first three too big
    now[0] += 100.0
    compiled.append(c.model.remat)
    return {"device": 2**41 if len(compiled) < 4 else 2**20, "how": "measured"}

  p = levers.search(levers.apply(cfg, {"plan.budget_s": 50}), target, fourth_fits, "flax", clock=lambda: now[0])
  assert len(compiled) == 4 and p.chosen is p.rows[3]


def test_candidates_are_ordered_by_the_estimate_then_exact_moments_then_lever_order(monkeypatch):
  """The search order against a hand-made roofline (levers.step_time replaced by a table written here, so the order
  is checked against hand numbers, not against the estimate that makes it): fastest first; a setting with bfloat16
  moments within cost.TIE (2%) of its float32-moments twin counts the twin's time, so the twin comes first; on equal
  times the fewer bfloat16 moments first, then lever order (accumulation 1 before 2)."""
  hand = {  # (grad_accum, mu, nu): seconds per step
      (1, "float32", "float32"): 1.00,
      (1, "bfloat16", "float32"): 0.995,  # within 2% of its twin: counts 1.00, after it
      (1, "bfloat16", "bfloat16"): 0.90,  # 10% faster than its twin: earns its place, first of all
      (2, "float32", "float32"): 0.95,
      (2, "bfloat16", "float32"): 0.94,  # within 2%: counts 0.95
      (2, "bfloat16", "bfloat16"): 0.95,
  }
  monkeypatch.setattr(levers, "step_time", lambda c, t: {
      "total_s": hand[(c.train.grad_accum, c.optim.mu_dtype, c.optim.nu_dtype)]})
  cfg = load_config([*DIMS, "data.global_batch_size=2", "plan.levers=train.grad_accum,optim.mu_dtype,optim.nu_dtype"])
  order = [(o["train.grad_accum"], o["optim.mu_dtype"], o["optim.nu_dtype"])
           for o in plan_levers.candidates(cfg, gpu_target(None), "flax")]
  assert order == [(1, "bfloat16", "bfloat16"),
                   (2, "float32", "float32"), (2, "bfloat16", "float32"), (2, "bfloat16", "bfloat16"),
                   (1, "float32", "float32"), (1, "bfloat16", "float32")]
