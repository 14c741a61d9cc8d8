"""The planner's moment levers, `optim.mu_dtype` and `optim.nu_dtype`: the settings it tries, in order, the
ones it never tries because the configured decays make them lossy, and what its one line says about them.

Order (issue 40): float32 both, then bfloat16 mu with a float32 nu (MaxText's `mu_dtype`), then bfloat16 both;
a bfloat16 nu never with a float32 mu (nu is the one that stalls). The planner takes the fastest setting that
fits; on equal times the more exact one, and times within the estimate's resolution (maxlm/plan/cost.py TIE, 2%)
count as equal (maxlm/plan/levers.py `candidates`).

Lossy. A moment m stored in bfloat16 and rounded to nearest moves by (1 - b) (x - m) a step (x: the new gradient
term); a change below half a bfloat16 ulp, up to 2**-8 |m| (8 significant bits), is rounded away, so m can stay
stuck up to 2**-8 / (1 - b) of its value away from where float32 would take it (nu at optim.b2 = 0.999: 391%;
tests/test_optim.py has the issue's case). The planner counts a setting lossy when that bound exceeds 1% (the
issue's criterion), which with round to nearest is every bfloat16 moment at a usual decay (b <= 0.61 passes).
Stochastic rounding (`optim.moment_rounding=stochastic`, the default) is unbiased at any decay (maxlm/optim.py;
the same test keeps nu and the update within 1% of float32 at b2 = 0.999), so its settings are all tried.
"""

from __future__ import annotations

from maxlm.config import Config, OptimConfig

KEYS = ("optim.mu_dtype", "optim.nu_dtype")
ORDER = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))
HALF_ULP = 2.0 ** -8  # the largest half-ulp of a bfloat16 value, relative to it (8 significant bits)
LIMIT = 0.01  # the largest relative error a rounded moment may be left with (issue 40's 1%)


def stall(b: float) -> float:
  """How far (relative) round to nearest can leave a bfloat16 moment with decay `b` from its float32 value."""
  return HALF_ULP / (1 - b)


def lossy(optim: OptimConfig) -> dict[str, str]:
  """{moment key: why} for each moment whose bfloat16 storage the config's rounding and decay make lossy."""
  if optim.moment_rounding == "stochastic":
    return {}
  out = {}
  for key, name, b in ((KEYS[0], "b1", optim.b1), (KEYS[1], "b2", optim.b2)):
    if stall(b) > LIMIT:
      out[key] = (f"bfloat16 {key.split('.')[1].split('_')[0]} not tried: rounded to nearest "
                  f"(optim.moment_rounding=nearest) it can stay {stall(b):.0%} off at optim.{name}={b:g}")
  return out


def settings(cfg: Config, chosen: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
  """The (mu, nu) dtypes the planner may set, in ORDER: none lossy, a moment kept where it is not in the
  chosen levers; the config's own setting where no moment is a lever."""
  written = (cfg.optim.mu_dtype, cfg.optim.nu_dtype)
  bad = lossy(cfg.optim)
  out = []
  for s in ORDER:
    s = tuple(v if k in chosen else w for k, v, w in zip(KEYS, s, written))
    if s not in ORDER and s != written:
      continue  # a bfloat16 nu with a float32 mu (mu not a lever)
    if any(v == "bfloat16" and w != "bfloat16" and k in bad for k, v, w in zip(KEYS, s, written)):
      continue  # a lossy bfloat16 the config does not already have
    if s not in out:
      out.append(s)
  return tuple(out) or (written,)


def note(cfg: Config, overrides: dict, chosen: tuple[str, ...]) -> str:
  """What the plan line says about the moments ("" where neither is a lever): their dtypes and rounding,
  and the settings not tried, with why."""
  if not set(KEYS) & set(chosen):
    return ""
  o = cfg.optim
  mu, nu = (overrides.get(k, getattr(o, k.split(".")[1])) for k in KEYS)
  bf16 = [n for n, d in (("mu", mu), ("nu", nu)) if d == "bfloat16"]
  if not bf16:
    parts = ["float32 moments"]
  elif o.moment_rounding == "stochastic":
    parts = [f"bfloat16 {' and '.join(bf16)}, stochastically rounded (unbiased at any decay: optim.b1={o.b1:g}, "
             f"optim.b2={o.b2:g})"]
  else:
    worst = max(stall(o.b1) if "mu" in bf16 else 0.0, stall(o.b2) if "nu" in bf16 else 0.0)
    parts = [f"bfloat16 {' and '.join(bf16)}, rounded to nearest (at most {worst:.1%} off at optim.b1={o.b1:g}, "
             f"optim.b2={o.b2:g})"]
  parts += [why for k, why in lossy(o).items() if k in chosen and getattr(o, k.split(".")[1]) != "bfloat16"]
  return "moments: " + "; ".join(parts)
