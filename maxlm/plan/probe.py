"""A deep model's peak memory from two shallow compiles: on the devices at hand, before the planner compiles a
candidate with every layer unrolled (about a minute for the 8B's 32 layers on the H200), it compiles the same step
with 4 and 8 layers per pipeline stage and extends the line through their two peaks to the real depth. A candidate
whose extended peak is over the usable memory by more than SLACK is pruned without its long compile.

Why a line: everything the step holds grows by the same bytes per unrolled layer (its parameters, gradients and
moments, the activations its remat policy keeps), while the embedding, the LM head and one layer's recomputation do
not grow. On XLA:GPU (the H200 target, compile-only, jax 0.10.2, the 8B at equal precision: bf16 mu, fp32 nu;
benchmarks/results/2026-12-06-depth_probe.jsonl) the line through 4 and 8 layers gave the 16- and 32-layer peaks
within 0.14% in 5 of the 6 settings where XLA's own rematerialization did not act (save_attn and save_qkv_attn at
one micro-batch, save_dots at 4, save_dots_attn at 8, full at 2 with host_params), and 4.4% high in the sixth
(save_attn with optim.offload=host: its temporaries grew by 1.76, 1.51 and 1.63 GiB a layer from 4 to 8, 8 to 16
and 16 to 32 layers). The two probes compiled in 14 to 23 s there, the 32 layers in 30 to 67 s. Not through 2 and 4
layers: there the peak sits elsewhere in the program (save_attn: 7.6% low). Where the program does not fit,
XLA:GPU's own rematerialization pass recomputes values to come nearer the limit, and the true peak is below the
line (remat=none, one micro-batch: 241.6 GiB against 366.7 extended); so the line says whether a candidate fits
without XLA recomputing on its own, which is what the roofline's step-time estimate assumes. A probe that itself
runs XLA out of memory prunes the candidate too.

SLACK (10%): of the usable memory, the room the line is given before it prunes: twice the largest error seen
above (4.4%), rounded up. A line low by any amount costs only time (the candidate is compiled whole and measured);
a line high by more than SLACK would prune a candidate that fits.

Only where it pays and applies: layers unrolled (`model.scan_layers=false`: a scanned stack compiles once whatever
its depth), at least MIN_LAYERS per stage (below, the two probes cost about what the model does), and either the
devices at hand (the search's own probes, maxlm/plan/levers.py) or (`measuring`) an offloaded candidate on
XLA:GPU's compile-only GPUs. There the layers are measured scanned, but an offloaded state streams through the
device one layer of the stack at a time (maxlm/optim.py `_streamed_update`: a static slice per layer and leaf), so
the program and its compile grow with the depth: the 70B on 64 compile-only H200s compiled in 7 to 20 s with
optim.offload=none and 165 to 220 s with offload=host (2-core machine, shared), its 4 and 8 layers in about 30
and 50 s; the line through those gave 117.9 GiB at 80 layers where the whole compile measured 116.9 (fsdp 8 x 8,
save_dots, bfloat16 moments, 2026-12-07). A non-offloaded candidate (one scanned program) is not probed there.
"""

from __future__ import annotations

import time

from maxlm.config import Config, load_config
from maxlm.plan.cost import degrees
from maxlm.tables import human_bytes

DEPTHS = (4, 8)  # layers per pipeline stage of the two probes
PROBES = len(DEPTHS)
SLACK = 0.1  # of the usable memory (module doc)
MIN_LAYERS = 16  # per pipeline stage: the probes compile 12 layers


def depths(cfg: Config, stages: int) -> tuple[int, int] | None:
  """The two probes' model.n_layers (whole pipeline stages of them), or None where probing does not apply
  (scanned layers, or fewer than MIN_LAYERS per stage)."""
  if cfg.model.scan_layers or cfg.model.n_layers < MIN_LAYERS * stages:
    return None
  return DEPTHS[0] * stages, DEPTHS[1] * stages


def extend(lo: tuple[int, int], hi: tuple[int, int], n_layers: int) -> int:
  """The peak at n_layers on the line through (layers, bytes) lo and hi."""
  (a, pa), (b, pb) = lo, hi
  return pb + (pb - pa) * (n_layers - b) // (b - a)


def shallow(cfg: Config, n_layers: int) -> Config:
  """cfg with n_layers layers, nothing else changed (validated like a command-line override)."""
  return load_config([f"model.n_layers={n_layers}"], base=cfg)


def predict(cfg: Config, stages: int, measure) -> dict | None:
  """{"bytes": the extended peak, "depths": the probes' layers, "peaks": their bytes} by `measure(cfg) -> the
  planner's dict` at the two probe depths; {"oom": message, "depths": ..., "at": its layers} where XLA ran out on a probe; None
  where probing does not apply."""
  ds = depths(cfg, stages)
  if ds is None:
    return None
  peaks = []
  for n in ds:
    m = measure(shallow(cfg, n))
    if "oom" in m:
      return {"oom": m["oom"], "depths": ds, "at": n}
    peaks.append(m["device"])
  return {"bytes": extend((ds[0], peaks[0]), (ds[1], peaks[1]), cfg.model.n_layers), "depths": ds,
          "peaks": tuple(peaks)}


def too_big(predicted: int, usable: int) -> bool:
  """Whether the extended peak prunes: over the usable memory by more than SLACK of it."""
  return predicted > usable * (1 + SLACK)


def measuring(target, say=None):
  """`target.measure`, except that on XLA:GPU's compile-only GPUs an offloaded candidate deep enough to probe is
  first compiled at the two probe depths (see the module doc): where the line is over the usable memory by more
  than SLACK (or XLA runs out on a probe) its measurement is the line, `how` says so, and it is not compiled whole;
  else it is compiled whole. `say(line)`: a progress line for each such prune."""
  if not target.gpu_target:
    return target.measure

  def measure(cfg: Config) -> dict:
    if cfg.optim.offload == "none":
      return target.measure(cfg)
    began = time.monotonic()
    shallow = predict(cfg, degrees(cfg, target)["pipeline"], target.measure)
    if shallow is None or ("oom" not in shallow and not too_big(shallow["bytes"], target.usable)):
      return target.measure(cfg)
    (a, b), n = shallow["depths"], cfg.model.n_layers
    if "oom" in shallow:
      out = {"oom": f"at {shallow['at']} layers (a shallow probe, maxlm/plan/probe.py): {shallow['oom']}"}
    else:
      out = {"device": shallow["bytes"], "probe": shallow,
             "how": (f"probed: {a} and {b} layers compiled ({human_bytes(shallow['peaks'][0])}, "
                     f"{human_bytes(shallow['peaks'][1])}), the line extended to {n}: over the usable memory by more "
                     f"than {SLACK:.0%}, not compiled whole")}
    if say is not None:
      said = out.get("oom") or f"{human_bytes(out['device'])} at {n} layers"
      say(f"plan: probed {a} and {b} layers of offload={cfg.optim.offload}, remat={cfg.model.remat}, "
          f"grad_accum={cfg.train.grad_accum}: {said}, not compiled whole ({time.monotonic() - began:.0f} s)")
    return out
  return measure
