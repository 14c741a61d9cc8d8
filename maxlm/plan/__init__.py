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

The search itself (the order, the choice, the pruning) is maxlm/plan/levers.py, the no-fit line
maxlm/plan/no_fit.py; this module is what a run asks of it: `choose`, `resolve` by plan.mode, the decision kept
across starts (`resolve_kept`) and the one decision every process of a run applies (`for_run`).

* Usable memory: device memory x `xla.mem_fraction` (0.95 on a GPU by default; XLA's own default is 0.75),
  less a margin of 2%: XLA's estimate equalled the allocator's measured peak on the H200 (41.8 and 38.7 GB,
  benchmarks/README.md), and the margin covers fragmentation of XLA's memory pool.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from maxlm.config import Config, ConfigError
from maxlm.layers import resolve_backend
from maxlm.metrics import echo
from maxlm.plan import sizing
from maxlm.plan.measure import make_target
from maxlm.plan.levers import (LEVERS, Plan, Row, apply, candidates, certain_bytes, current, host_short, kept,
                               kept_line, lever_values, most_saving, parse_levers, run_search, search, timer)
from maxlm.plan.no_fit import kept_message, no_fit_message, smallest_devices
from maxlm.runtime import agree, warm_start, watchdog
from maxlm.runtime.devices import device_kind, device_memory_bytes, is_gpu, local_device
from maxlm.tables import human_bytes

__all__ = ["LEVERS", "Plan", "Row", "apply", "candidates", "certain_bytes", "choose", "current", "decide", "no_fit_error",
           "for_run", "gpu_here", "host_short", "lever_values", "make_target", "most_saving",
           "no_fit_message", "parse_levers", "resolve", "resolve_kept", "run_search", "search",
           "smallest_devices", "timer", "view"]


def choose(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
           device_memory: int | None = None, on_measure=None, report=None) -> Plan:
  """The plan for the devices at hand (or `make_target`'s simulated ones); ConfigError (one line) when
  nothing fits."""
  target = make_target(cfg, n_devices, n_nodes, device_memory)
  target.on_measure = on_measure
  try:
    p = run_search(cfg, target, report=report)
    if p.chosen is None:
      raise no_fit_error(cfg, p, target, report=report)
  finally:
    target.close()
  return p


def no_fit_error(cfg: Config, p: Plan, target, note: str = "", known: dict | None = None, report=None) -> ConfigError:
  """The one line when the search `p` found nothing that fits. Where plan.levers keeps lever keys as written (the
  user's own), the search runs again with every lever free (by the roofline's order, untimed; what `p` measured
  is reused), and the line names the kept keys to change and the fastest setting that fits (no_fit.kept_message);
  when nothing fits with every lever either, or nothing was kept, the no-fit line of that search."""
  if not kept(cfg):
    return ConfigError(no_fit_message(cfg, p, note))
  wide = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, levers="all"))
  known = {**(known or {}), **{tuple(r.overrides.items()): r.stats for r in p.rows if r.stats is not None}}
  if report is not None:
    report(f"plan: nothing fits with the lever keys kept as written ({kept_line(cfg)}); searching with every lever "
           "free to say what would")
  q = search(wide, target, target.measure, resolve_backend(cfg.model.backend), known=known, report=report)
  if q.chosen is None:
    return ConfigError(no_fit_message(wide, q, "; ".join(filter(None, (
        note, f"every lever tried, the ones plan.levers keeps ({kept_line(cfg)}) too")))))
  return ConfigError(kept_message(cfg, p, q, note))


def gpu_here() -> bool:
  """This process's devices are GPUs (or stand for them: the test switch, maxlm/runtime/devices.py)."""
  return is_gpu(local_device())


def resolve(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
            device_memory: int | None = None, on_measure=None, report=None) -> tuple[Config, str | None]:
  """(the config to run, one line on what the planner did; None where it did nothing), by plan.mode: off
  keeps cfg; auto takes `choose`'s levers; fit (the default) acts only on the GPUs at hand (no n_devices /
  n_nodes): it keeps cfg when XLA measures it to fit (one compile, none where the bytes it certainly needs
  exceed a device), else takes the search's levers. ConfigError (one line) when nothing fits. `on_measure` is
  called before each compile (the start-up watchdog's sign of progress), `report(line)` after each compile and
  timing (levers.search)."""
  mode = cfg.plan.mode
  if mode == "off" or (mode != "auto" and (n_devices or n_nodes or not gpu_here())):
    return cfg, None  # fit on a CPU or for other devices: the config as written (`maxlm plan` plans for those)
  if mode == "auto":
    p = choose(cfg, n_devices, n_nodes, device_memory, on_measure, report)
    return p.cfg, p.line()
  target = make_target(cfg, device_memory=device_memory)
  target.on_measure = on_measure
  try:
    known, certain = {}, certain_bytes(cfg, target)["certain"]
    short = host_short(cfg, target)
    why = short or f"certainly needs {human_bytes(certain)}"
    if certain <= target.usable and short is None:
      began = time.monotonic()
      m = known[tuple(current(cfg).items())] = target.measure(cfg)
      if report is not None:
        report("plan: compiled the config as written: " + ("XLA ran out of memory" if "oom" in m else
               f"peak {human_bytes(m['device'])} of {human_bytes(target.usable)}")
               + f" ({time.monotonic() - began:.0f} s)")
      if "oom" not in m and m["device"] <= target.usable:
        return cfg, (f"plan: the config fits as written (peak {human_bytes(m['device'])} of "
                     f"{human_bytes(target.usable)} usable per device, measured by XLA; plan.mode=fit "
                     "keeps it)")
      why = "ran XLA out of memory compiling" if "oom" in m else f"peaks at {human_bytes(m['device'])}"
    p = search(cfg, target, target.measure, resolve_backend(cfg.model.backend), known=known,
               timer=timer(cfg, target), timed=cfg.plan.timed, report=report)
    if p.chosen is None:
      raise no_fit_error(cfg, p, target, f"as written the config {why} per device", known, report)
  finally:
    target.close()
  return p.cfg, f"{p.line()}; as written the config {why} per device"


# Config keys that cannot change the planner's decision, beyond those no program reads (warm_start.KEEP_OUT): what
# only the host reads (where the data comes from and how it is read, seeds, the step count) and the optimizer's
# scalars, constants in the step that change neither its buffers nor its work. Left out of the decision's key, so
# that a run of the same shape on the same GPUs (another user's, another learning rate) takes the decision without
# planning, from the shared compilation cache directory (compile.cache_dir; on a cluster, the launch templates'
# <output_dir>/.xla-cache). Everything else stays in the key: the model, the batch's shape, the data's type (packed
# rows choose the context exchange), the moments' dtypes, rounding and decays, the mesh, plan.*, xla.*.
SHAPE_ONLY = warm_start.KEEP_OUT + (
    "train.steps", "train.seed", "optim.learning_rate", "optim.schedule", "optim.warmup_steps", "optim.decay_steps",
    "optim.min_lr_ratio", "optim.wsd_decay_fraction", "optim.eps", "optim.weight_decay", "data.seed", "data.paths",
    "data.weights", "data.eval_paths", "data.eval_fraction", "data.tokenizer", "data.tokenizer_type", "data.add_bos",
    "data.add_eos", "data.bos_id", "data.eos_id", "data.text_split", "data.field", "data.shuffle", "data.num_epochs",
    "data.read_threads", "data.worker_count", "data.prefetch", "data.skip_bad_records", "data.packing_bins")


def resolve_kept(cfg: Config, on_measure=None, report=None) -> tuple[Config, str | None]:
  """`resolve(cfg)` on the devices at hand, or the decision an earlier start took for a run of the same shape on
  the same GPUs (compile.warm_start, maxlm/runtime/warm_start.py: the key holds the config less `SHAPE_ONLY`, the
  code, the devices and the memory the planner counts as usable), which a decision taken now is kept as."""
  if cfg.plan.mode == "off" or (cfg.plan.mode != "auto" and not gpu_here()):
    return resolve(cfg)  # nothing measured: nothing to keep
  target = make_target(cfg)  # the planner's own view of the devices (no measurement yet)
  entry = warm_start.Entry("plan", [warm_start.run_signature(cfg, SHAPE_ONLY), target.n_devices, target.kind,
                                    target.usable])
  kept = entry.load()
  if kept is not None:
    levers, line = kept
    return ((cfg if levers == current(cfg) else apply(cfg, levers)),
            f"{line} (kept from an earlier start of this shape on these GPUs)")
  out, line = resolve(cfg, on_measure=on_measure, report=report)
  if line is not None:
    entry.save((current(out), line))
  return out, line


NO_GPU_HINT = "no GPU here: `maxlm plan config=... --devices N --simulate` sizes it for N H200s"


def view() -> list:
  """What this process's planner sees of its devices: the local device's kind and memory."""
  dev = local_device()
  return [device_kind(dev) if is_gpu(dev) else dev.device_kind, device_memory_bytes()]


def decide(cfg: Config, on_measure=None, report=None) -> dict:
  """The decision `for_run` hands every process: the levers, the line to print, how they came (for the
  out-of-memory line) and the view it was taken with. Where nothing was planned, the bytes the step certainly
  needs are checked against a device (sizing.check_fits), and what optim.offload pins against the host's RAM
  (levers.host_short)."""
  out, line = resolve_kept(cfg, on_measure, report)
  mine = view()
  if line is None and cfg.optim.offload != "none" and gpu_here():  # the config as written, held in host memory
    short = host_short(cfg, make_target(cfg))
    if short is not None:
      less = "optim.offload=host (the moments only) or none" if cfg.optim.offload == "host_params" else \
          "optim.offload=none"
      raise ConfigError(f"config key 'optim.offload': {short}; use more devices (the state shards over fsdp), "
                        f"{less}, or a node with more RAM")
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
  plan's line (process 0's), and as it plans a line for each compile and timing; `watch` is the start-up
  watchdog: each of the planner's compiles is a phase whose limit comes from the compiles before it (maxlm/plan/clock.py,
  maxlm/runtime/watchdog.py `planned_compile_limit`; the first: train.watchdog_first_step_s)."""
  watch = watch or watchdog.OFF
  limit = watchdog.start_up_limit(cfg.train)

  def measuring(expected: float | None) -> None:  # process 0, before each compile: a new phase, a sign of life
    agree.progress("plan")
    watch.arm("start-up: plan (a compile)", limit=watchdog.planned_compile_limit(cfg.train, expected))
  progress = (lambda line: say(f"maxlm: {line}")) if say is not None else None  # each compile and timing, as it ends
  got = agree.decide("plan", lambda: decide(cfg, measuring, progress), watch, "start-up: plan", limit)
  out = cfg if got["levers"] == current(cfg) else apply(cfg, got["levers"])
  mine = view() if jax.process_index() > 0 and cfg.plan.mode != "off" else got["view"]
  if mine != got["view"]:
    echo(f"maxlm: warning: plan: this process sees {mine[0]} with {human_bytes(mine[1] or 0)}, process 0 "
         f"{got['view'][0]} with {human_bytes(got['view'][1] or 0)}; every process runs process 0's plan "
         f"({', '.join(f'{k}={v}' for k, v in got['levers'].items())})")
  if say is not None and got["line"] is not None:
    say(f"maxlm: {got['line']}")
  return out, got["how"]
