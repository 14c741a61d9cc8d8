"""Band arithmetic: golden bands from several seeds, smoothing, and the verdict of one value.

A band at one (metric, step) is mean +- half, where, over the N seeds' values x_1..x_N,

  half = max(k * s, floor_abs, floor_rel * |mean|),  s = sample standard deviation (ddof=1).

k * s covers seed-to-seed variation. The floor exists because s from a handful of seeds is a poor
estimate: with N = 3, 2 s^2 / sigma^2 ~ chi^2_2, so P(s < 0.3 sigma) = 1 - exp(-0.09) = 8.6%; without a
floor roughly one band in twelve would be three times too tight and the suite would fail on noise. It
also absorbs numeric drift that is not a regression (another XLA version, thread count or GPU). The
suite file states its k and floors and why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class BandSpec:
  """How wide a band is: k standard deviations, but never narrower than the floors."""
  k: float = 4.0
  floor_abs: float = 0.0
  floor_rel: float = 0.0


@dataclasses.dataclass(frozen=True)
class Band:
  mean: float
  std: float
  lo: float
  hi: float


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value). Non-finite values give nan."""
  xs = [float(v) for v in values]
  if not xs:
    raise ValueError("no values")
  if not all(math.isfinite(x) for x in xs):
    return math.nan, math.nan
  m = sum(xs) / len(xs)
  if len(xs) == 1:
    return m, 0.0
  return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def band(values: Sequence[float], spec: BandSpec) -> Band:
  """The band of one (metric, step) from its values over seeds."""
  m, s = mean_std(values)
  if not math.isfinite(m):
    raise ValueError(f"non-finite value among {list(values)}: a golden cannot be recorded from it")
  half = max(spec.k * s, spec.floor_abs, spec.floor_rel * abs(m))
  return Band(mean=m, std=s, lo=m - half, hi=m + half)


def verdict(value: float | None, lo: float, hi: float) -> str:
  """'pass' inside [lo, hi]; 'above' / 'below' outside; 'missing' for no value; 'nonfinite' for NaN/Inf."""
  if value is None:
    return "missing"
  if not math.isfinite(value):
    return "nonfinite"
  if value > hi:
    return "above"
  if value < lo:
    return "below"
  return "pass"


def trailing_mean(steps: Sequence[int], values: Sequence[float], window: int) -> dict[int, float]:
  """Smoothed curve: at each logged step s, the mean of the values logged at steps in (s - window, s].

  With window <= the logging interval this is the raw curve. Non-finite values stay in (and make the
  mean non-finite), so a divergence is never smoothed away.
  """
  out = {}
  for i, s in enumerate(steps):
    xs = [float(values[j]) for j in range(i + 1) if steps[j] > s - window]
    out[int(s)] = sum(xs) / len(xs)
  return out


def within_relative(value: float, reference: float, rel: float) -> bool:
  """|value - reference| <= rel * |reference| (the cross-precision rule); False for non-finite input."""
  if not (math.isfinite(value) and math.isfinite(reference)):
    return False
  return abs(value - reference) <= rel * abs(reference)
