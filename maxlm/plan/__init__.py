"""Memory planner: the fastest setting of the memory levers whose train step fits, as measured by XLA.

Levers (each a plain config key; `plan.levers` lists those the planner may set): `model.remat`, `train.grad_accum`
(micro-batches at the same global batch), `optim.offload` (none | host | host_params), `optim.mu_dtype` and
`optim.nu_dtype` (float32 | bfloat16; a bfloat16 nu only with a bfloat16 mu). `candidates` lists their
settings, fastest expected first; `search` walks that list and compiles the train step of each plausible one
ahead of time on abstract shapes (maxlm/plan/measure.py: XLA's `memory_analysis()`, nothing allocated); the
first whose measured peak fits the usable memory wins, so the choice is deterministic. `resolve` applies
`plan.mode` for the trainer and the dry run: off = the config as written; auto = the search's choice; fit (the
default) = on the GPUs at hand, the config as written when XLA measures it to fit, else the search's choice
(each said in one line).

* Order. By the roofline estimate (maxlm/plan/cost.py), fastest first; on a tie the fewer bfloat16 moments
  first (float32 both, then bfloat16 mu (MaxText's mu_dtype), then both: maxlm/plan/moments.py, which also
  leaves out a bfloat16 moment the configured decay would make lossy), then lever order.
* Choice. On the GPUs at hand (one process) the first `plan.timed` candidates that fit are run for a few
  steps each (maxlm/plan/timing.py) and the fastest measured wins; elsewhere (simulated devices, several
  processes, plan.timed=0) the first that fits, by the estimate, and the line says "estimated". The line
  also says which moment dtypes were chosen, how they are rounded, and which were not tried and why.
* Pruning (the analytic model, maxlm/plan/sizing.py, only prunes). A candidate is not compiled when the bytes
  it certainly needs (sizing's lower_bound: the state, and the gradients or the logits, both when
  accumulating; a true lower bound of XLA's peak) plus a share of sizing's rough activations exceed the usable
  memory. The share starts at one half, then is the least (measured - certain) / activations seen so far,
  at most 1: calibrated on XLA's own numbers, so that a big model compiles few candidates. Where every
  candidate was pruned the message says so: nothing was compiled.
* Usable memory: device memory x `xla.mem_fraction` (0.95 on a GPU by default; XLA's own default is 0.75),
  less a margin of 2%: XLA's estimate equalled the allocator's measured peak on the H200 (41.8 and 38.7 GB,
  benchmarks/README.md), and the margin covers fragmentation of XLA's memory pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax

from maxlm.config import Config, ConfigError, load_config
from maxlm.layers import resolve_backend
from maxlm.plan import moments, sizing, timing
from maxlm.plan.cost import TIE, degrees, step_time
from maxlm.plan.measure import Target, make_target
from maxlm.metrics import echo
from maxlm.runtime import agree, warm_start, watchdog
from maxlm.runtime.devices import device_kind, device_memory_bytes, is_gpu, local_device
from maxlm.tables import REMATS, human_bytes

LEVERS = ("model.remat", "train.grad_accum", "optim.offload", *moments.KEYS)


def parse_levers(text: str) -> tuple[str, ...]:
  """plan.levers as keys; ConfigError (one line) for an unknown one."""
  if text.strip() == "all":
    return LEVERS
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
  # a pipeline of S stages needs S micro-batches at least (maxlm/pipeline.py)
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
  """Bytes per device: "certain" = sizing's lower_bound (what the step certainly holds at once: the state, and
  the gradients or the logits, both when accumulating; maxlm/plan/sizing.py says why it is a lower bound of
  XLA's peak), the moments (and with host_params the parameters) left out when offloaded; "activations" =
  sizing's rough activations."""
  est = sizing.estimate(cfg, target.n_devices, target.n_nodes)
  return {"certain": est["lower_bound"], "activations": est["activations"]}


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


@dataclasses.dataclass
class Plan:
  target: Target
  rows: list[Row]
  chosen: Row | None
  cfg: Config  # the config with the chosen levers (the input config when none fits)
  moments: str = ""  # what the line says about the moment dtypes (maxlm/plan/moments.py)

  def line(self) -> str:
    """The one line the trainer prints."""
    if self.chosen is None:
      return "no plan fits"
    c = self.chosen
    levers = ", ".join(f"{k}={v}" for k, v in c.overrides.items())
    n = sum(r.measured is not None or r.note.startswith("XLA ran out") for r in self.rows)
    how = f"measured by {self.target.measured_by}" if c.how == "measured" else f"{c.how}, by {self.target.measured_by}"
    timed = [r for r in self.rows if r.seconds is not None]
    speed = (f"; step {c.seconds:.3g} s measured, the fastest of {len(timed)} timed" if c.seconds is not None
             else f"; step {c.time['total_s']:.3g} s estimated (roofline), not measured" if self.target.gpu
             else "")  # CPU devices: no roofline, nothing timed
    return (f"plan: {levers} (peak {human_bytes(c.measured)} of {human_bytes(self.target.usable)} "
            f"usable per device; {how}{speed}; {n} compiled, {len(self.rows) - n} not)"
            + (f"; {self.moments}" if self.moments else ""))


def _fits(cfg, target, row, need, measured, share, rows) -> float:
  """Record `measured` (plan.measure's dict) in `row`; the calibrated share of the activations after it."""
  if "oom" in measured:
    row.status, row.note = "too big", f"XLA ran out of memory compiling: {measured['oom']}"
    return share
  row.measured, row.how, row.stats = measured["device"], measured.get("how", "measured"), measured
  if need["activations"] > 0:  # calibrated: the least share seen, at most 1
    seen = max(0, row.measured - need["certain"]) / need["activations"]
    share = min(share if any(r.measured for r in rows[:-1]) else 1.0, seen)
  row.status = "fits" if row.measured <= target.usable else "too big"
  return share


def _fastest(cfg: Config, fits: list[Row], timer) -> Row | None:
  """The row of `fits` whose step `timer` measured fastest (the first on a tie); a row whose step ran out of
  memory (timer: None) does not fit after all."""
  for r in fits:
    r.seconds = timer(apply(cfg, r.overrides))
    if r.seconds is None:
      r.status, r.note = "too big", "ran out of device memory running the step"
  timed = [r for r in fits if r.seconds is not None]
  return min(timed, key=lambda r: r.seconds) if timed else None


def search(cfg: Config, target: Target, measure, backend: str, everything: bool = False,
           known: dict | None = None, timer=None, timed: int = 1) -> Plan:
  """Walk the candidates in order; `measure(cfg) -> plan.measure's dict`; `known`: measurements made
  already, by lever values (never pruned, never compiled again). With `timer(cfg) -> seconds per step` (the
  devices at hand: maxlm/plan/timing.py), the first `timed` candidates that fit are timed and the fastest
  measured is chosen; without, the first that fits (by the roofline's order). everything=True measures every
  plausible candidate (for the table) but still chooses among the first that fit."""
  rows, fits = [], []
  want = max(1, timed) if timer is not None else 1
  share = 0.5  # of the rough activations taken as plausible: then the least share XLA showed (module doc)
  for o in candidates(cfg, target, backend):
    c = apply(cfg, o)
    need = certain_bytes(c, target)
    row = Row(o, "not tried", need["certain"], time=step_time(c, target))
    rows.append(row)
    if len(fits) >= want and not everything:
      continue
    measured = (known or {}).get(tuple(o.items()))
    plausible = need["certain"] + int(share * need["activations"])
    if measured is None and plausible > target.usable:
      row.status, row.plausible = "pruned", plausible
      row.note = (f"certain {human_bytes(need['certain'])}" if need["certain"] > target.usable else
                  f"certain + {share:.2f} x activations = {human_bytes(plausible)}")
      continue
    share = _fits(cfg, target, row, need, measure(c) if measured is None else measured, share, rows)
    if row.status == "fits" and len(fits) < want:
      fits.append(row)
  chosen = (fits[0] if fits else None) if timer is None else _fastest(cfg, fits, timer)
  return Plan(target, rows, chosen, apply(cfg, chosen.overrides) if chosen else cfg,
              moments.note(cfg, chosen.overrides, parse_levers(cfg.plan.levers)) if chosen else "")


def _label(o: dict) -> str:
  return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in o.items())


def timer(cfg: Config, target: Target):
  """What times a candidate's step here: maxlm/plan/timing.py on GPUs at hand driven by this one process;
  None (the roofline orders) on simulated devices, CPUs, several processes, or with plan.timed=0."""
  if target.simulated or not target.gpu or jax.process_count() > 1 or cfg.plan.timed == 0:
    return None
  return lambda c: timing.time_step(c, target.devices)


def run_search(cfg: Config, target: Target, everything: bool = False) -> Plan:
  """`search` on the target's devices (at hand or simulated)."""
  parse_levers(cfg.plan.levers)
  return search(cfg, target, target.measure, resolve_backend(cfg.model.backend), everything,
                timer=timer(cfg, target), timed=cfg.plan.timed)


def most_saving(cfg: Config, target: Target) -> dict | None:
  """Every lever at its most saving value (None where the mesh or the batch does not split)."""
  try:
    values = lever_values(cfg, target, resolve_backend(cfg.model.backend))
  except ConfigError:  # the mesh does not fit this device count
    return None
  return {k: vs[-1] for k, vs in values.items()} if all(values.values()) else None


def smallest_devices(cfg: Config, target: Target, limit: int = 4096) -> tuple[int, dict, int] | None:
  """(n, levers, measured bytes): the fewest devices (doubling) on which every lever at its most saving value
  fits, measured on n simulated devices (the target's: XLA:GPU's compile-only, else XLA:CPU's); None to `limit`."""
  n = target.n_devices * 2
  while n <= limit:
    t = dataclasses.replace(target, n_devices=n, n_nodes=1, simulated=True, devices=None, _sim=None)
    o = most_saving(cfg, t)
    if o is None and n > cfg.data.global_batch_size:
      return None  # the batch cannot split over more devices either
    if o is not None and certain_bytes(apply(cfg, o), t)["certain"] <= t.usable:
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
  compiled = any(r.measured is not None or r.note.startswith("XLA ran out") for r in p.rows)
  msg = f"no setting of plan.levers ({','.join(parse_levers(cfg.plan.levers))}) fits {t.describe(compiled)}"
  msg += f"; {note}" if note else ""
  pruned = [r for r in p.rows if r.status == "pruned"]
  if least is not None:
    c = apply(cfg, least.overrides)
    est = sizing.estimate(c, t.n_devices, t.n_nodes)
    both = est["params"] + est["copy"] + est["gradients"]  # host_params: the parameters' compute copy
    msg += (f"; the least measured, {_label(least.overrides)}, needs {human_bytes(least.measured)}, of which "
            f"the parameters and their gradients take {human_bytes(both)}: no lever in plan.levers shrinks "
            "those further (the missing lever: gradients kept in host memory)")
  elif pruned:
    r = min(pruned, key=lambda r: r.plausible)
    msg += (f"; the least of the {len(pruned)} candidates pruned is {_label(r.overrides)} at "
            f"{human_bytes(r.plausible)} ({r.note})")
  else:
    msg += "; no candidate: the global batch does not split over the data-parallel devices"
  found = smallest_devices(cfg, t) if t.gpu else None
  if found:
    n, o, need = found
    where = f"by XLA:GPU on {n} compile-only GPUs" if t.gpu_target else f"on {n} simulated CPU devices"
    msg += (f"; the smallest device count that fits is {n} ({_label(o)}: {human_bytes(need)} per device, "
            f"measured {where}; `maxlm plan ... --devices {n}` shows the plan)")
  elif t.gpu and most_saving(cfg, dataclasses.replace(t, n_devices=2 * t.n_devices)) is None:
    msg += (f"; data.global_batch_size={cfg.data.global_batch_size} does not split over {2 * t.n_devices} "
            "devices, so more devices do not help unless it grows")
  elif t.gpu:
    msg += "; no device count up to 4096 fits either"
  return msg


def choose(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
           device_memory: int | None = None, on_measure=None) -> Plan:
  """The plan for the devices at hand (or `make_target`'s simulated ones); ConfigError (one line) when
  nothing fits."""
  target = make_target(cfg, n_devices, n_nodes, device_memory)
  target.on_measure = on_measure
  try:
    p = run_search(cfg, target)
  finally:
    target.close()
  if p.chosen is None:
    raise ConfigError(no_fit_message(cfg, p))
  return p


def gpu_here() -> bool:
  """This process's devices are GPUs (or stand for them: the test switch, maxlm/runtime/devices.py)."""
  return is_gpu(local_device())


def resolve(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
            device_memory: int | None = None, on_measure=None) -> tuple[Config, str | None]:
  """(the config to run, one line on what the planner did; None where it did nothing), by plan.mode: off
  keeps cfg; auto takes `choose`'s levers; fit (the default) acts only on the GPUs at hand (no n_devices /
  n_nodes): it keeps cfg when XLA measures it to fit (one compile, none where the bytes it certainly needs
  exceed a device), else takes the search's levers. ConfigError (one line) when nothing fits. `on_measure` is
  called before each compile (the start-up watchdog's sign of progress)."""
  mode = cfg.plan.mode
  if mode == "off" or (mode != "auto" and (n_devices or n_nodes or not gpu_here())):
    return cfg, None  # fit on a CPU or for other devices: the config as written (`maxlm plan` plans for those)
  if mode == "auto":
    p = choose(cfg, n_devices, n_nodes, device_memory, on_measure)
    return p.cfg, p.line()
  target = make_target(cfg, device_memory=device_memory)
  target.on_measure = on_measure
  try:
    known, certain = {}, certain_bytes(cfg, target)["certain"]
    why = f"certainly needs {human_bytes(certain)}"
    if certain <= target.usable:
      m = known[tuple(current(cfg).items())] = target.measure(cfg)
      if "oom" not in m and m["device"] <= target.usable:
        return cfg, (f"plan: the config fits as written (peak {human_bytes(m['device'])} of "
                     f"{human_bytes(target.usable)} usable per device, measured by XLA; plan.mode=fit "
                     "keeps it)")
      why = "ran XLA out of memory compiling" if "oom" in m else f"peaks at {human_bytes(m['device'])}"
    p = search(cfg, target, target.measure, resolve_backend(cfg.model.backend), known=known,
               timer=timer(cfg, target), timed=cfg.plan.timed)
    if p.chosen is None:
      raise ConfigError(no_fit_message(cfg, p, f"as written the config {why} per device"))
  finally:
    target.close()
  return p.cfg, f"{p.line()}; as written the config {why} per device"


def resolve_kept(cfg: Config, on_measure=None) -> tuple[Config, str | None]:
  """`resolve(cfg)` on the devices at hand, or the decision an earlier start of this run took on this machine
  (compile.warm_start, maxlm/runtime/warm_start.py: the key holds the config, the code, the devices and the memory
  the planner counts as usable), which a decision taken now is kept as."""
  if cfg.plan.mode == "off" or (cfg.plan.mode != "auto" and not gpu_here()):
    return resolve(cfg)  # nothing measured: nothing to keep
  target = make_target(cfg)  # the planner's own view of the devices (no measurement yet)
  entry = warm_start.Entry("plan", [warm_start.run_signature(cfg), target.n_devices, target.kind, target.usable])
  kept = entry.load()
  if kept is not None:
    levers, line = kept
    return (cfg if levers == current(cfg) else apply(cfg, levers)), f"{line} (kept from an earlier start)"
  out, line = resolve(cfg, on_measure=on_measure)
  if line is not None:
    entry.save((current(out), line))
  return out, line


NO_GPU_HINT = "no GPU here: `maxlm plan config=... --devices N --simulate` sizes it for N H200s"


def view() -> list:
  """What this process's planner sees of its devices: the local device's kind and memory."""
  dev = local_device()
  return [device_kind(dev) if is_gpu(dev) else dev.device_kind, device_memory_bytes()]


def decide(cfg: Config, on_measure=None) -> dict:
  """The decision `for_run` hands every process: the levers, the line to print, how they came (for the
  out-of-memory line) and the view it was taken with. Where nothing was planned, the bytes the step certainly
  needs are checked against a device (sizing.check_fits)."""
  out, line = resolve_kept(cfg, on_measure)
  mine = view()
  if line is None and mine[1]:
    try:
      sizing.check_fits(cfg, jax.device_count(), mine[1], n_nodes=jax.process_count())
    except ConfigError as e:
      if gpu_here():
        raise
      raise ConfigError(f"{e}; {NO_GPU_HINT}") from None
  how = (("as written, measured to fit by plan.mode=fit" if out is cfg else f"chosen by plan.mode={cfg.plan.mode}")
         if line else f"plan.mode={cfg.plan.mode}")
  return {"levers": current(out), "line": line, "how": how, "view": mine}


def for_run(cfg: Config, say=None, watch=None) -> tuple[Config, str]:
  """(the run's config by plan.mode, how its levers came), decided once for the run, before the trainer is built:
  by process 0, whose decision every process applies (maxlm/runtime/agree.py), so that all run one program. A
  process whose own view of its devices differs from process 0's says so in one warning line. `say` prints the
  plan's line (process 0's); `watch` is the start-up watchdog: each of the planner's compiles is a phase of
  train.watchdog_first_step_s (maxlm/runtime/watchdog.py `start_up_limit`)."""
  watch = watch or watchdog.OFF
  limit = watchdog.start_up_limit(cfg.train)

  def measuring() -> None:  # process 0, before each compile: a new phase, and a sign of life for the others
    agree.progress("plan")
    watch.arm("start-up: plan (a compile)", limit=limit)
  got = agree.decide("plan", lambda: decide(cfg, measuring), watch, "start-up: plan", limit)
  out = cfg if got["levers"] == current(cfg) else apply(cfg, got["levers"])
  mine = view() if jax.process_index() > 0 and cfg.plan.mode != "off" else got["view"]
  if mine != got["view"]:
    echo(f"maxlm: warning: plan: this process sees {mine[0]} with {human_bytes(mine[1] or 0)}, process 0 "
         f"{got['view'][0]} with {human_bytes(got['view'][1] or 0)}; every process runs process 0's plan "
         f"({', '.join(f'{k}={v}' for k, v in got['levers'].items())})")
  if say is not None and got["line"] is not None:
    say(f"maxlm: {got['line']}")
  return out, got["how"]
