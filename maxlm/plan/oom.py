"""The out-of-memory line of a run (maxlm/cli/train.py): the decided levers, XLA's sizes and the next lever to try.
It takes its inputs as arguments: the decided config, how its levers came (`for_run`'s answer) and XLA's estimate."""

from __future__ import annotations

import dataclasses
import re

import jax

from maxlm.config import Config, ConfigError
from maxlm.layers import resolve_backend
from maxlm.plan.levers import LEVERS, current, lever_values
from maxlm.plan.target import Target
from maxlm.runtime.devices import bytes_limit, device_kind, is_gpu, local_device
from maxlm.runtime.env import fraction_in_environment
from maxlm.tables import human_bytes


def next_lever(cfg: Config, target: Target) -> str:
  """The next more memory-saving value of the first lever that has one, as key=value."""
  try:
    values = lever_values(dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, levers="all")), target,
                          resolve_backend(cfg.model.backend))
  except ConfigError:
    values = {}
  now = current(cfg)
  for k in LEVERS:
    vs = values.get(k, ())
    if now[k] in vs and vs.index(now[k]) + 1 < len(vs):
      return f"{k}={vs[vs.index(now[k]) + 1]}"
  return "more devices"


def oom_message(cfg: Config, how: str, compiled_gb: float | None, error: BaseException) -> str:
  """One line for an out-of-memory error of a run of `cfg` (the decided config), its levers come `how`
  (`for_run`'s answer; "" where the planner did not run), `compiled_gb` XLA's estimate of its step where known:
  the levers, the sizes and the next lever to try."""
  dev = local_device()
  limit = bytes_limit(dev)
  target = Target(jax.device_count(), jax.process_count(), device_kind(dev) if is_gpu(dev) else "cpu", limit or 0,
                  None, False)
  text = str(error)
  alloc = re.search(r"allocat\w*\s+([\d.]+\s*[KMGTP]?i?B)", text)
  sizes = [f"XLA could not allocate {alloc.group(1)}" if alloc else "XLA ran out of device memory"]
  if compiled_gb is not None:
    sizes.append(f"XLA's estimate of the step is {human_bytes(compiled_gb * 1e9)} per device")
  if limit:
    frac = fraction_in_environment()
    sizes.append(f"the device has {human_bytes(limit)} for XLA"
                 + (f" (xla.mem_fraction {frac:g})" if frac else ""))
  levers = ", ".join(f"{k}={v}" for k, v in current(cfg).items())
  how = how or f"plan.mode={cfg.plan.mode}"
  hint = "" if how.startswith("chosen") else " (or plan.mode=auto, which measures the levers before it starts)"
  return (f"out of memory on {jax.device_count()} x {target.kind} with {levers} ({how}): {'; '.join(sizes)}; "
          f"next lever: {next_lever(cfg, target)}{hint}")
