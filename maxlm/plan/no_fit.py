"""The one line when no setting of the levers fits (maxlm/plan/levers.py's search found none): the least measured (or
pruned) candidate, what no lever shrinks, and the fewest devices on which the most saving levers fit, measured on
simulated devices (`smallest_devices`); or, where the user's own lever keys are what keeps every setting out
(`kept_message`), which of them to change and the fastest setting that fits."""

from __future__ import annotations

import dataclasses

from maxlm.config import Config
from maxlm.plan import memory
from maxlm.plan.levers import Plan, label, apply, certain_bytes, host_short, kept, kept_line, most_saving, parse_levers
from maxlm.plan.target import Target
from maxlm.tables import human_bytes


def smallest_devices(cfg: Config, target: Target, limit: int = 4096) -> tuple[int, dict, int] | None:
  """(n, levers, measured bytes): the fewest devices (doubling) on which every lever at its most saving value fits
  (its pinned host memory too), measured on n simulated devices (the target's: XLA:GPU's compile-only, else
  XLA:CPU's); None to `limit`."""
  n = target.n_devices * 2
  while n <= limit:
    t = dataclasses.replace(target, n_devices=n, n_nodes=1, simulated=True, devices=None, _sim=None)
    o = most_saving(cfg, t)
    if o is None and n > cfg.data.global_batch_size:
      return None  # the batch cannot split over more devices either
    fits = o is not None and certain_bytes(apply(cfg, o), t)["certain"] <= t.usable
    if fits and host_short(apply(cfg, o), t) is None:
      try:
        m = t.measure(apply(cfg, o))
      finally:
        t.close()
      if "oom" not in m and m["device"] <= t.usable:
        return n, o, m["device"]
    n *= 2
  return None


def no_fit_message(cfg: Config, p: Plan, note: str = "") -> str:
  """One line: nothing fits here, the least that was needed, and the device count that fits."""
  t = p.target
  tried = [r for r in p.rows if r.measured is not None]
  least = min(tried, key=lambda r: r.measured) if tried else None
  compiled = any(r.measured is not None or r.note.startswith("XLA ran out") or r.probed for r in p.rows)
  msg = f"no setting of plan.levers ({','.join(parse_levers(cfg.plan.levers))}) fits {t.describe(compiled)}"
  msg += f"; {note}" if note else ""
  pruned = [r for r in p.rows if r.status == "pruned" and r.plausible is not None]  # not: a probe out of memory
  host = [r for r in p.rows if r.note.startswith("pinned host memory")]
  if least is not None:
    c = apply(cfg, least.overrides)
    est = memory.estimate(c, t.n_devices, t.n_nodes)
    both = est["params"] + est["copy"] + est["gradients"]  # host_params: the parameters' compute copy
    msg += (f"; the least measured, {label(least.overrides)}, needs {human_bytes(least.measured)}, of which "
            f"the parameters and their gradients take {human_bytes(both)}: no lever in plan.levers shrinks "
            "those further (the missing lever: gradients kept in host memory)")
  elif pruned:
    r = min(pruned, key=lambda r: r.plausible)
    msg += (f"; the least of the {len(pruned)} candidates pruned is {label(r.overrides)} at "
            f"{human_bytes(r.plausible)} ({r.note})")
  elif any(r.probed for r in p.rows):
    r = next(r for r in p.rows if r.probed)
    msg += f"; the fastest, {label(r.overrides)}, was pruned: {r.note}"
  elif not host:
    msg += "; no candidate: the global batch does not split over the data-parallel devices"
  if host:
    msg += f"; {label(host[0].overrides)}, the fastest held in host memory, was not compiled: {host[0].note}"
  found = smallest_devices(cfg, t) if t.gpu else None
  if found:
    n, o, need = found
    where = f"by XLA:GPU on {n} compile-only GPUs" if t.gpu_target else f"on {n} simulated CPU devices"
    msg += (f"; the smallest device count that fits is {n} ({label(o)}: {human_bytes(need)} per device, "
            f"measured {where}; `maxlm plan ... --devices {n}` shows the plan)")
  elif t.gpu and most_saving(cfg, dataclasses.replace(t, n_devices=2 * t.n_devices)) is None:
    msg += (f"; data.global_batch_size={cfg.data.global_batch_size} does not split over {2 * t.n_devices} "
            "devices, so more devices do not help unless it grows")
  elif t.gpu:
    msg += "; no device count up to 4096 fits either"
  return msg


def kept_message(cfg: Config, p: Plan, wide: Plan, note: str = "") -> str:
  """One line: nothing fits with the lever keys kept as written (`p`, the search over the other levers), and the
  fastest setting that does fit with every lever free (`wide`, whose chosen row is that setting): which kept keys
  it changes, and to what. The user's keys are never changed silently: they change them, or leave them unset."""
  t, c = p.target, wide.chosen
  mine = kept(cfg)
  changed = {k: c.overrides[k] for k, v in mine.items() if c.overrides[k] != v}
  compiled = any(r.measured is not None or r.note.startswith("XLA ran out") or r.probed for r in p.rows)
  free = ",".join(parse_levers(cfg.plan.levers)) or "none"
  msg = f"with the lever keys kept as written ({kept_line(cfg)}; plan.levers={free}) nothing fits {t.describe(compiled)}"
  msg += f"; {note}" if note else ""
  how = f"measured by {t.measured_by}" if c.how == "measured" else f"{c.how}, by {t.measured_by}"
  setting = ", ".join(f"{k}={v}" for k, v in c.overrides.items())
  if changed:
    msg += (f"; change {', '.join(f'{k}={mine[k]} to {v}' for k, v in changed.items())}: the fastest setting that "
            f"fits is {setting}")
  else:
    msg += f"; the fastest setting that fits is {setting}"
  return (msg + f" (peak {human_bytes(c.measured)} of {human_bytes(t.usable)} usable per device, {how}); set "
          + ("those keys so, or leave them out of your config to let the planner choose them" if changed else
             "those keys so"))
