"""The planner's moment levers (maxlm/plan/moments.py): the order it tries the (mu, nu) dtypes in, none that the
configured decay makes lossy, and what its line says about them."""

import pytest

from maxlm.plan import levers as plan_levers
from maxlm.config import load_config
from maxlm.plan import moments
from maxlm.plan.target import Target

ALL = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))


def settings(*args):
  cfg = load_config(list(args))
  return moments.settings(cfg, plan_levers.parse_levers(cfg.plan.levers))


def test_stochastic_rounding_tries_every_setting_in_the_issues_order():
  """fp32 both, then MaxText's bf16 mu / fp32 nu, then bf16 both, whatever the decays (unbiased rounding)."""
  assert settings() == ALL
  assert settings("optim.b1=0.99", "optim.b2=0.9999") == ALL


def test_round_to_nearest_leaves_out_the_moments_its_decay_makes_lossy():
  """Round to nearest can leave a moment 2**-8 / (1 - b) off (half a bf16 ulp, relative, over the step's
  fraction of the new term): b2 = 0.999 -> 391%, b2 = 0.95 -> 7.8%, b1 = 0.9 -> 3.9%, all over 1%; b = 0.5
  -> 0.78%, under. So with the usual decays nothing in bfloat16 is tried."""
  assert moments.stall(0.999) == pytest.approx(2 ** -8 / 0.001)
  assert settings("optim.moment_rounding=nearest") == (("float32", "float32"),)
  assert settings("optim.moment_rounding=nearest", "optim.b1=0.5") == (("float32", "float32"),
                                                                         ("bfloat16", "float32"))
  assert settings("optim.moment_rounding=nearest", "optim.b1=0.5", "optim.b2=0.5") == ALL
  lossy = moments.lossy(load_config(["optim.moment_rounding=nearest", "optim.b2=0.999"]).optim)
  assert lossy["optim.nu_dtype"] == ("bfloat16 nu not tried: rounded to nearest (optim.moment_rounding=nearest) it "
                                     "can stay 391% off at optim.b2=0.999")


def test_levers_left_out_keep_the_config_and_a_config_of_its_own_is_kept():
  assert settings("plan.levers=model.remat") == (("float32", "float32"),)
  assert settings("plan.levers=model.remat", "optim.mu_dtype=bfloat16") == (("bfloat16", "float32"),)
  # only nu a lever: a bfloat16 nu needs a bfloat16 mu, which the config does not have
  assert settings("plan.levers=optim.nu_dtype") == (("float32", "float32"),)
  # a moment key the user wrote is theirs: with plan.levers=auto (the default) it is kept as written
  assert settings("optim.moment_rounding=nearest", "optim.mu_dtype=bfloat16") == (("bfloat16", "float32"),)
  assert settings("optim.nu_dtype=float32") == (("float32", "float32"), ("bfloat16", "float32"))
  # handed to the planner (plan.levers=all), the config's own lossy setting is not the planner's pick: kept where
  # it is written, not added elsewhere
  assert settings("optim.moment_rounding=nearest", "optim.mu_dtype=bfloat16", "plan.levers=all") == (
      ("float32", "float32"), ("bfloat16", "float32"))


def test_candidates_follow_the_settings():
  target = Target(8, 1, "NVIDIA H200", 141 * 10**9, 0.95, True)
  cfg = load_config(["model.backend=flax", "optim.moment_rounding=nearest", "optim.b2=0.999",
                     "plan.levers=model.remat,optim.mu_dtype,optim.nu_dtype"])
  pairs = {(o["optim.mu_dtype"], o["optim.nu_dtype"]) for o in plan_levers.candidates(cfg, target, "flax")}
  assert pairs == {("float32", "float32")}
  sr = plan_levers.apply(cfg, {"optim.moment_rounding": "stochastic"})
  assert {(o["optim.mu_dtype"], o["optim.nu_dtype"]) for o in plan_levers.candidates(sr, target, "flax")} == set(ALL)


def test_the_line_says_what_was_picked_and_why():
  levers = plan_levers.parse_levers("all")
  cfg = load_config(["optim.b2=0.999"])
  both = {"optim.mu_dtype": "bfloat16", "optim.nu_dtype": "bfloat16"}
  assert moments.note(cfg, both, levers) == ("moments: bfloat16 mu and nu, stochastically rounded (unbiased at any "
                                             "decay: optim.b1=0.9, optim.b2=0.999)")
  assert moments.note(cfg, {"optim.mu_dtype": "float32"}, levers) == "moments: float32 moments"
  nearest = load_config(["optim.b2=0.999", "optim.moment_rounding=nearest"])
  note = moments.note(nearest, {"optim.mu_dtype": "float32", "optim.nu_dtype": "float32"}, levers)
  assert note == ("moments: float32 moments; bfloat16 mu not tried: rounded to nearest (optim.moment_rounding="
                  "nearest) it can stay 4% off at optim.b1=0.9; bfloat16 nu not tried: rounded to nearest "
                  "(optim.moment_rounding=nearest) it can stay 391% off at optim.b2=0.999")
  assert moments.note(cfg, both, ("model.remat",)) == ""  # the moments are not levers: nothing to say
