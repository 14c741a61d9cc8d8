"""The run's decision: plan.mode applied before the trainer is built, kept across starts, one for every process.

`decide` is what `for_run` (maxlm/plan/__init__.py) has process 0 take: the decision an earlier start kept for a run
of the same shape on the same GPUs (compile.warm_start, maxlm/runtime/warm_start.py), or `resolve` (plan.mode by
maxlm/plan/fit.py `by_mode`), then plan.mode=fit's checks of the sized config (`Sizing.check`).
"""

from __future__ import annotations

from maxlm.config import Config
from maxlm.plan import fit
from maxlm.plan.fit import by_mode, no_fit_error, search, size
from maxlm.plan.levers import Plan, apply, current
from maxlm.runtime import warm_start
from maxlm.runtime.devices import device_kind, device_memory_bytes, is_gpu, local_device

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


def choose(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
           device_memory: int | None = None, on_measure=None, report=None) -> Plan:
  """`search` on the devices at hand (or `make_target`'s simulated ones); ConfigError (one line) when nothing
  fits."""
  target = fit.make_target(cfg, n_devices, n_nodes, device_memory)
  target.on_measure = on_measure
  try:
    p = search(cfg, target, report=report)
    if p.chosen is None:
      raise no_fit_error(cfg, p, target, report=report)
  finally:
    target.close()
  return p


def resolve(cfg: Config, n_devices: int | None = None, n_nodes: int | None = None,
            device_memory: int | None = None, on_measure=None, report=None) -> tuple[Config, str | None]:
  """(the config to run by plan.mode, one line on what the planner did; None where it did nothing): fit.by_mode;
  ConfigError (one line) when nothing fits."""
  d = by_mode(cfg, None, n_devices, n_nodes, device_memory, on_measure=on_measure, report=report)
  if d.error is not None:
    raise d.error
  return d.cfg, d.line


def resolve_kept(cfg: Config, on_measure=None, report=None) -> tuple[Config, str | None]:
  """`resolve(cfg)` on the devices at hand, or the decision an earlier start took for a run of the same shape on
  the same GPUs (the key holds the config less `SHAPE_ONLY`, the code, the devices and the memory the planner
  counts as usable), which a decision taken now is kept as."""
  if cfg.plan.mode == "off" or (cfg.plan.mode != "auto" and not fit.gpu_here()):
    return resolve(cfg)  # nothing measured: nothing to keep
  target = fit.make_target(cfg)  # the planner's own view of the devices (no measurement yet)
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


def view() -> list:
  """What this process's planner sees of its devices: the local device's kind and memory."""
  dev = local_device()
  return [device_kind(dev) if is_gpu(dev) else dev.device_kind, device_memory_bytes()]


def decide(cfg: Config, on_measure=None, report=None) -> dict:
  """The decision `for_run` hands every process: the levers, the line to print, how they came (for the
  out-of-memory line) and the view it was taken with. Where nothing was planned, plan.mode=fit's checks of the
  config as written (`Sizing.check`: the bytes the step certainly needs against a device, what optim.offload pins
  against the host's RAM)."""
  out, line = resolve_kept(cfg, on_measure, report)
  if line is None:
    size(cfg, mode="off").check()
  how = (("as written, measured to fit by plan.mode=fit" if out is cfg else f"chosen by plan.mode={cfg.plan.mode}")
         if line else f"plan.mode={cfg.plan.mode}")
  return {"levers": current(out), "line": line, "how": how, "view": view()}

