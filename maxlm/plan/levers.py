"""The planner's search: the lever settings in the order they are tried, what each certainly needs, the walk
that compiles the plausible ones until enough fit (and times them on the GPUs at hand), and the one line that says
so, or that nothing fits and what would.

* Order. By the roofline estimate (maxlm/plan/cost.py), fastest first; on a tie the fewer bfloat16 moments
  first (float32 both, then bfloat16 mu (MaxText's mu_dtype), then both: maxlm/plan/moments.py, which also
  leaves out a bfloat16 moment the configured decay would make lossy), then lever order.
* Choice. On the GPUs at hand (one process) the first `plan.timed` candidates that fit are run for a few
  steps each (maxlm/plan/timing.py) and the fastest measured wins; elsewhere (simulated devices, several
  processes, plan.timed=0) the first that fits, by the estimate, and the line says "estimated". A deep unrolled
  model on the GPUs at hand is not searched here: maxlm/plan/winner.py estimates each candidate from its shallow
  programs and compiles only the winner whole (maxlm/plan/fit.py `search` chooses which). The line
  also says which moment dtypes were chosen, how they are rounded, and which were not tried and why.
* Budget and progress. Once one candidate fits, plan.budget_s bounds the search: past it nothing more is compiled,
  and nothing more timed once one is (on the GPUs at hand a compile of the 8B's unrolled layers takes about a
  minute). Each compile and timing is reported as it ends (the trainer prints it: a long search shows itself).
* Pruning (the analytic model, maxlm/plan/memory.py, only prunes). A candidate is not compiled when the bytes
  it certainly needs (memory.py's lower_bound: the state, and the gradients or the logits, both when
  accumulating; a true lower bound of XLA's peak) plus a share of memory.py's rough activations exceed the usable
  memory. The share is kept per model.remat policy: one half until a candidate of that policy is measured, then
  the least (measured - certain) / activations seen for it so far, at most 1: calibrated on XLA's own numbers,
  so that a big model compiles few candidates. Per policy, because the rough activations err by policy: on the
  H200 (jax 0.11.2, the 8B, bf16 moments) save_attn at one micro-batch measured 0.46 of them (2026-12-04); with
  a float32 nu, remat=none at 8 micro-batches took 1.9 (178.5 GiB, the figure XLA's rematerialization pass
  logged, 2026-12-06). One share for all (as before) then pruned save_attn at one micro-batch, which should fit
  (110.1 GiB with bf16 moments, + 15 GiB for a float32 nu).
  Where every candidate was pruned the message says so: nothing was compiled. On the GPUs at hand, a deep
  unrolled candidate is then first compiled at 4 and 8 layers (maxlm/plan/probe.py) and pruned when the line
  through those peaks, extended to its depth, is over the usable memory by more than probe.SLACK.
* Host memory (optim.offload): a candidate whose pinned host memory per device (memory.py's host: the moments, and
  with host_params the parameters; twice on jax < 0.11, whose XLA:GPU keeps a copy of the donated state under the
  step's cond) exceeds HOST_SHARE of the host RAM per device (the node's RAM, or its cgroup's limit, over the devices
  of the node's processes; a DGX node's on a compile-only target, said so) is not compiled: pinned memory cannot be
  paged out, and past the RAM the kernel ends the process without a word.
* Nothing fits: maxlm/plan/no_fit.py says so in one line.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import jax

from maxlm.config import LEVERS, Config, ConfigError, load_config
from maxlm.layers import resolve_backend
from maxlm.plan import memory, moments, probe, timing
from maxlm.plan.cost import TIE, degrees, step_time
from maxlm.plan.target import Target
from maxlm.plan.xla_gpu import COND_COPY, cond_copies
from maxlm.runtime.env import HOST_SHARE
from maxlm.tables import REMATS, human_bytes

assert LEVERS[-2:] == moments.KEYS
PROBED = "probed"  # Row.how of a candidate pruned by its shallow compiles
START_SHARE = 0.5  # of the rough activations taken as plausible for a remat policy not yet measured


def parse_levers(text: str) -> tuple[str, ...]:
  """plan.levers as keys; ConfigError (one line) for an unknown one. `auto` is made concrete when the config is
  loaded from the user's words (maxlm/config `free_levers`); left as auto (a Config made in Python, where nothing
  tells which keys were written) it is every lever, as all is."""
  if text.strip() in ("all", "auto"):
    return LEVERS
  if text.strip() == "none":
    return ()
  keys = tuple(k.strip() for k in text.split(",") if k.strip())
  bad = [k for k in keys if k not in LEVERS]
  if bad:
    raise ConfigError(f"config key 'plan.levers': unknown lever {bad[0]!r} (levers: {', '.join(LEVERS)})")
  return keys


def current(cfg: Config) -> dict:
  """The lever values of `cfg`, in LEVERS order."""
  return {"model.remat": cfg.model.remat, "train.grad_accum": cfg.train.grad_accum,
          "optim.offload": cfg.optim.offload, "optim.mu_dtype": cfg.optim.mu_dtype,
          "optim.nu_dtype": cfg.optim.nu_dtype}


def apply(cfg: Config, overrides: dict) -> Config:
  """`cfg` with the lever values set (validated like command-line overrides)."""
  return load_config([f"{k}={v}" for k, v in overrides.items()], base=cfg)


def lever_values(cfg: Config, target: Target, backend: str) -> dict[str, tuple]:
  """Every value each lever may take here, fastest (least saving) first; the config's own value for
  the levers not in plan.levers. Accumulation keeps each micro-batch split evenly over the data devices."""
  chosen = parse_levers(cfg.plan.levers)
  deg = degrees(cfg, target)
  dp, batch = deg["data"] * deg["fsdp"], cfg.data.global_batch_size
  powers = (2 ** i for i in range(int(math.log2(batch)) + 1))
  # a pipeline of S stages needs S micro-batches at least (maxlm/parallel/pipelining.py)
  accums = tuple(a for a in powers if batch % a == 0 and (batch // a) % dp == 0 and a >= deg["pipeline"])
  # from the most kept to the least (maxlm/tables.py REMATS: what each keeps per layer)
  remats = tuple(name for name, r in REMATS.items() if not r.te_only or backend == "te")
  offloads = ("none", "host", "host_params") if target.gpu else ("none",)  # a CPU has one memory: nothing to save
  pairs = moments.settings(cfg, chosen)  # in their order, none lossy (maxlm/plan/moments.py)
  values = {"model.remat": remats, "train.grad_accum": accums, "optim.offload": offloads,
            **{k: tuple(dict.fromkeys(p[i] for p in pairs)) for i, k in enumerate(moments.KEYS)}}
  now = current(cfg)
  return {k: (values[k] if k in chosen else (now[k],)) for k in LEVERS}


def candidates(cfg: Config, target: Target, backend: str) -> list[dict]:
  """Every combination of lever values (the moment dtypes as maxlm/plan/moments.py pairs them), in search
  order: by estimated step time, the fewer bfloat16 moments first on a tie, then lever order (deterministic).
  Less exact moments must earn their place: a setting whose estimate is within cost.TIE of its twin with the
  most exact moments tried (the same other levers) counts that twin's time, so the twin comes first; the
  roofline does not resolve finer, and a bfloat16 moment is a loss of precision, however small."""
  values = lever_values(cfg, target, backend)
  pairs = moments.settings(cfg, parse_levers(cfg.plan.levers))
  rows = [o for o in (dict(zip(LEVERS, combo)) for combo in itertools.product(*values.values()))
          if tuple(o[k] for k in moments.KEYS) in pairs]
  rank = {k: {v: i for i, v in enumerate(vs)} for k, vs in values.items()}
  seconds = {id(o): step_time(apply(cfg, o), target)["total_s"] for o in rows}
  exact = {tuple((k, v) for k, v in o.items() if k not in moments.KEYS): o for o in reversed(rows)
           if tuple(o[k] for k in moments.KEYS) == pairs[0]}

  def key(o):
    t = seconds[id(o)]
    twin = exact.get(tuple((k, v) for k, v in o.items() if k not in moments.KEYS))
    if twin is not None and t * (1 + TIE) >= seconds[id(twin)]:
      t = seconds[id(twin)]
    t = round(t, 9)  # rounding: ties broken by the moments, then lever order
    return (t, sum(o[k] == "bfloat16" for k in moments.KEYS), [rank[k][o[k]] for k in LEVERS])
  return sorted(rows, key=key)


def certain_bytes(cfg: Config, target: Target) -> dict:
  """Bytes per device: "certain" = memory.py's lower_bound (what the step certainly holds at once: the state, and
  the gradients or the logits, both when accumulating; maxlm/plan/memory.py says why it is a lower bound of
  XLA's peak), the moments (and with host_params the parameters) left out when offloaded; "activations" =
  memory.py's rough activations."""
  est = memory.estimate(cfg, target.n_devices, target.n_nodes)
  return {"certain": est["lower_bound"], "activations": est["activations"]}


def host_need(cfg: Config, target: Target) -> int:
  """Bytes of pinned host memory per device with cfg's optim.offload (memory.py's host), doubled where this jax's
  XLA:GPU copies the donated state under the step's cond (maxlm/plan/xla_gpu.py `cond_copies`)."""
  return memory.estimate(cfg, target.n_devices, target.n_nodes)["host"] * (2 if cond_copies() else 1)


def host_short(cfg: Config, target: Target) -> str | None:
  """None where cfg's pinned host memory fits the target's hosts (or nothing is pinned, or a CPU: one memory);
  else why not, in one clause with the numbers."""
  if not target.gpu or target.host_bytes is None or cfg.optim.offload == "none":
    return None
  need, have = host_need(cfg, target), int(target.host_bytes * HOST_SHARE)
  if need <= have:
    return None
  whose = target.host_assumed or "this node's RAM over its devices"
  return (f"pinned host memory {human_bytes(need)} per device (optim.offload={cfg.optim.offload}"
          + (f"; x2: {COND_COPY}" if cond_copies() else "") + f") exceeds {HOST_SHARE:.0%} of the host's "
          f"{human_bytes(target.host_bytes)} per device ({whose})")


@dataclasses.dataclass
class Row:
  overrides: dict
  status: str  # "fits", "too big", "pruned", "not tried"
  certain: int
  measured: int | None = None  # XLA's per-device bytes
  how: str = ""  # "measured" or the arithmetic used
  time: dict | None = None  # the roofline estimate (maxlm/plan/cost.py)
  note: str = ""
  stats: dict | None = None  # everything the measurement returned
  plausible: int | None = None  # what the analytic model took as plausible, where it pruned
  seconds: float | None = None  # the step time measured on the devices at hand (maxlm/plan/timing.py)
  estimate: dict | None = None  # bytes and seconds extended from two shallow programs (maxlm/plan/winner.py)

  @property
  def probed(self) -> bool:
    """Pruned by two shallow compiles (maxlm/plan/probe.py), not compiled whole."""
    return self.how == PROBED


@dataclasses.dataclass
class Plan:
  target: Target
  rows: list[Row]
  chosen: Row | None
  cfg: Config  # the config with the chosen levers (the input config when none fits)
  moments: str = ""  # what the line says about the moment dtypes (maxlm/plan/moments.py)
  stopped: float | None = None  # seconds into the search when plan.budget_s stopped it
  written: dict = dataclasses.field(default_factory=dict)  # the lever values as the config wrote them
  costs: dict | None = None  # seconds of each part of the planning (maxlm/plan/winner.py `Costs.line`)

  def line(self) -> str:
    """The one line the trainer prints."""
    if self.chosen is None:
      return "no plan fits"
    c = self.chosen
    free = parse_levers(self.cfg.plan.levers)
    levers = ", ".join(f"{k}={v}" for k, v in c.overrides.items() if k in free)
    kept = kept_line(self.cfg)
    levers = (f"set {levers}" if levers else "set nothing") + (f"; kept as written: {kept}" if kept else "")
    n = sum(r.measured is not None or r.note.startswith("XLA ran out") and not r.probed for r in self.rows)
    p = sum(r.probed for r in self.rows)  # pruned by two shallow compiles (probe.py)
    how = f"measured by {self.target.measured_by}" if c.how == "measured" else f"{c.how}, by {self.target.measured_by}"
    timed = [r for r in self.rows if r.seconds is not None]
    probed = [r for r in self.rows if r.estimate is not None]
    speed = (f"; step {c.seconds:.3g} s measured, the fastest of {len(timed)} timed" if c.seconds is not None
             else f"; step {c.estimate['seconds']:.3g} s estimated from its {c.estimate['depths'][0]}- and "
                  f"{c.estimate['depths'][1]}-layer steps timed, the fastest of {len(probed)} probed"
             if c.estimate is not None
             else f"; step {c.time['total_s']:.3g} s estimated (roofline), not measured" if self.target.gpu
             else "")  # CPU devices: no roofline, nothing timed
    return (f"plan: {levers} (peak {human_bytes(c.measured)} of {human_bytes(self.target.usable)} "
            f"usable per device; {how}{speed}; {n} compiled, " + (f"{p} pruned by shallow compiles, " if p else "")
            + f"{len(self.rows) - n - p} not"
            + (f"; search stopped by plan.budget_s={self.cfg.plan.budget_s:g} after {self.stopped:.0f} s"
               if self.stopped is not None else "") + ")"
            + (f"; {self.moments}" if self.moments else "") + (f"; {self.costs['line']}" if self.costs else ""))


def _fits(cfg, target, row, need, measured, share: float | None) -> float | None:
  """Record `measured` (plan.measure's dict) in `row`; the calibrated share of the activations of the row's remat
  policy after it (`share`: before it, None while no candidate of that policy has been measured)."""
  if "oom" in measured:
    row.status, row.note = "too big", f"XLA ran out of memory compiling: {measured['oom']}"
    return share
  row.measured, row.how, row.stats = measured["device"], measured.get("how", "measured"), measured
  row.status = "fits" if row.measured <= target.usable else "too big"
  return _share(need, row.measured, share)


def _share(need: dict, peak: int, share: float | None) -> float:
  """The calibrated share of a remat policy's rough activations after a peak of `peak` bytes: the least seen, at
  most 1 (`share`: before it, None while none was seen)."""
  if need["activations"] > 0:
    seen = max(0, peak - need["certain"]) / need["activations"]
    share = min(1.0 if share is None else share, seen)
  return START_SHARE if share is None else share


def _probed(row: Row, shallow: dict, n_layers: int) -> None:
  """Record in `row` a prune by probe.predict's result `shallow`."""
  row.status, row.plausible, row.how = "pruned", shallow.get("bytes"), PROBED
  a, b = shallow["depths"]
  row.note = (f"XLA ran out of memory compiling {shallow['at']} layers: {shallow['oom']}"
              if "oom" in shallow else
              f"{a} and {b} layers compiled ({human_bytes(shallow['peaks'][0])}, {human_bytes(shallow['peaks'][1])}): "
              f"{human_bytes(shallow['bytes'])} at {n_layers}")


def _fastest(cfg: Config, fits: list[Row], timer, report, clock, over) -> Row | None:
  """The row of `fits` whose step `timer` measured fastest (the first on a tie); a row whose step ran out of
  memory (timer: None) does not fit after all. Once `over()` (the budget spent) and one is timed, no more are."""
  for r in fits:
    if over() and any(f.seconds is not None for f in fits):
      break
    start = clock()
    r.seconds = timer(apply(cfg, r.overrides))
    if r.seconds is None:
      r.status, r.note = "too big", "ran out of device memory running the step"
    report(f"plan: timed {label(r.overrides)}: "
           + (r.note if r.seconds is None else f"step {r.seconds:.3g} s") + f" ({clock() - start:.0f} s)")
  timed = [r for r in fits if r.seconds is not None]
  return min(timed, key=lambda r: r.seconds) if timed else None


def search(cfg: Config, target: Target, measure, backend: str, everything: bool = False,
           known: dict | None = None, timer=None, timed: int = 1, report=None, clock=time.monotonic) -> Plan:
  """Walk the candidates in order; `measure(cfg) -> plan.measure's dict`; `known`: measurements made
  already, by lever values (never pruned, never compiled again). With `timer(cfg) -> seconds per step` (the
  devices at hand: maxlm/plan/timing.py), the first `timed` candidates that fit are timed and the fastest
  measured is chosen; without, the first that fits (by the roofline's order). everything=True measures every
  plausible candidate (for the table) but still chooses among the first that fit. `report(line)` is told of
  each compile and each timing as it ends (the run's progress lines). cfg.plan.budget_s > 0: once that many
  seconds (by `clock`) have gone and one candidate fits, no further candidate is compiled, and once one is timed no
  further one is timed (the line says so)."""
  rows, fits = [], []
  report = report or (lambda line: None)
  want = max(1, timed) if timer is not None else 1
  # of the rough activations taken as plausible, per remat policy measured: the least share XLA showed (module doc)
  shares: dict[str, float] = {}
  start, stopped, budget_s = clock(), None, cfg.plan.budget_s

  def over() -> bool:
    return budget_s > 0 and clock() - start > budget_s
  stages = None if target.simulated else degrees(cfg, target)["pipeline"]  # probe.py: the devices at hand only
  for o in candidates(cfg, target, backend):
    c = apply(cfg, o)
    need = certain_bytes(c, target)
    row = Row(o, "not tried", need["certain"], time=step_time(c, target))
    rows.append(row)
    if len(fits) >= want and not everything:
      continue
    if fits and over() and not everything:
      stopped = stopped or clock() - start
      continue
    short = host_short(c, target)
    if short is not None:  # nothing to compile: the host could not hold it
      row.status, row.note = "too big", short
      continue
    measured = (known or {}).get(tuple(o.items()))
    remat = o["model.remat"]
    share = shares.get(remat, START_SHARE)
    plausible = need["certain"] + int(share * need["activations"])
    if measured is None and plausible > target.usable:
      row.status, row.plausible = "pruned", plausible
      row.note = (f"certain {human_bytes(need['certain'])}" if need["certain"] > target.usable else
                  f"certain + {share:.2f} x activations = {human_bytes(plausible)}")
      continue
    began = clock()
    shallow = probe.predict(c, stages, measure) if measured is None and stages else None
    if shallow is not None and ("oom" in shallow or probe.too_big(shallow["bytes"], target.usable)):
      _probed(row, shallow, c.model.n_layers)
      if "oom" not in shallow:  # the line taken as the measurement (probe.py: high only past XLA's own remat)
        shares[remat] = _share(need, shallow["bytes"], shares.get(remat))
      report(f"plan: probed {label(o)}: {row.note}, pruned ({clock() - began:.0f} s)")
      continue
    calibrated = _fits(cfg, target, row, need, measure(c) if measured is None else measured, shares.get(remat))
    if calibrated is not None:
      shares[remat] = calibrated
    if measured is None:
      report(f"plan: compiled {label(o)}: " + (row.note if row.measured is None else
             f"peak {human_bytes(row.measured)} of {human_bytes(target.usable)}, {row.status}")
             # XLA's warnings, summarized (xla_log.py), where Target.progress did not say them as they came
             + (f"; {row.stats['xla_log']}" if (row.stats or {}).get("xla_log") and target.progress is None else "")
             + f" ({clock() - began:.0f} s)")
    if row.status == "fits" and len(fits) < want:
      fits.append(row)
  chosen = (fits[0] if fits else None) if timer is None else _fastest(cfg, fits, timer, report, clock, over)
  if timer is not None and any(r.seconds is None and r.status == "fits" for r in fits):
    stopped = stopped or clock() - start  # the budget ended the timing
  return Plan(target, rows, chosen, apply(cfg, chosen.overrides) if chosen else cfg,
              moments.note(cfg, chosen.overrides, parse_levers(cfg.plan.levers)) if chosen else "",
              stopped=stopped, written=current(cfg))


def kept(cfg: Config) -> dict:
  """The lever keys plan.levers leaves as written (the user's own, with plan.levers=auto), with their values."""
  free = parse_levers(cfg.plan.levers)
  return {k: v for k, v in current(cfg).items() if k not in free}


def kept_line(cfg: Config) -> str:
  return ", ".join(f"{k}={v}" for k, v in kept(cfg).items())


def label(o: dict) -> str:
  return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in o.items())


def timer(cfg: Config, target: Target):
  """What times a candidate's step here: maxlm/plan/timing.py on GPUs at hand driven by this one process;
  None (the roofline orders) on simulated devices, CPUs, several processes, or with plan.timed=0."""
  if target.simulated or not target.gpu or jax.process_count() > 1 or cfg.plan.timed == 0:
    return None

  def timed(c: Config) -> float | None:
    if target.on_measure is not None:  # a new start-up phase: the step's compile (or its load), then a few steps
      target.on_measure(target.clock.expect(c))
    return timing.time_step(c, target.devices)
  return timed


def run_search(cfg: Config, target: Target, everything: bool = False, report=None) -> Plan:
  """`search` on the target's devices (at hand or simulated)."""
  parse_levers(cfg.plan.levers)
  return search(cfg, target, target.measure, resolve_backend(cfg.model.backend), everything,
                timer=timer(cfg, target), timed=cfg.plan.timed, report=report)


def most_saving(cfg: Config, target: Target) -> dict | None:
  """Every lever at its most saving value (None where the mesh or the batch does not split)."""
  try:
    values = lever_values(cfg, target, resolve_backend(cfg.model.backend))
  except ConfigError:  # the mesh does not fit this device count
    return None
  return {k: vs[-1] for k, vs in values.items()} if all(values.values()) else None
