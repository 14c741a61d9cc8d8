"""Size a training run without building it: `python -m maxlm.train --dry-run [config=FILE] [key=value ...]`.

Prints the resolved config in short, the mesh, parameter counts, FLOPs per token and per step (the
README's MFU convention, `maxlm.model.flops_per_step`), a per-device memory estimate and a summary of
the data source, then exits 0. `--json` prints the same as one JSON object.

Nothing is allocated or written: the train state is built abstractly (`jax.eval_shape` over the
initializer, one scanned layer standing for all of them: same parameters), and its shardings are read
for an abstract mesh of the configured size (`jax.sharding.AbstractMesh`), so Llama 3 70B sizes in
seconds on a laptop CPU. The mesh is sized for this machine's devices, or for `--devices N` over
`--nodes M` (and `--device-memory-gb G` to compare against); the run's own checks (batch split over the
data-parallel devices, config ranges, data files present) apply, so a bad config stops with one line and
exit code 2. Parameters, optimizer state and FP8 metadata per device come from the abstract state's
shards; gradients equal the parameters; logits and activations are `maxlm/plan/memory.py`'s formulas.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
from jax.sharding import AbstractMesh

from maxlm import plan as planner
from maxlm.plan import Sizing
from maxlm.build import Built, build_step
from maxlm.cli.grammar import SIZING, parse_options
from maxlm.config import Config, ConfigError, DataConfig, load_config
from maxlm.errors import BadInput, report
from maxlm.data.readers import META_NAME, file_format, resolve_files, split_list
from maxlm.data.shards import read_meta
from maxlm.data.sources import resolve_type
from maxlm.runtime import watchdog, xla_presets
from maxlm.parallel import context
from maxlm.layers import check_remat, resolve_backend, supported_precisions
from maxlm.config.rules import check_expert_degree
from maxlm.parallel.mesh import AXES, check_context_split, mesh_shape
from maxlm.metrics import device_peak_flops
from maxlm.model import count_params, flops_per_step
from maxlm.optim import warmup_warning
from maxlm.runtime.env import HOST_SHARE, apply_mem_fraction
from maxlm.parallel.pipelining import bubble_fraction, check as check_pipeline, repeats as pipeline_repeats
from maxlm.tables import PRECISIONS, human_bytes
from maxlm.trainer import check_batch_split

FLAGS = ("--dry-run", "--json")  # and maxlm/cli/grammar.py SIZING: --devices, --nodes, --device-memory-gb


def _shard_bytes(structs, shardings) -> int:
  """Bytes one device holds of a tree of abstract arrays under their shardings."""
  leaves, shards = jax.tree.leaves(structs), jax.tree.leaves(shardings)
  return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(leaves, shards, strict=True))


def build(cfg: Config, mesh, exact_meta: bool) -> Built:
  """The trainer's build (maxlm/build.py) of the abstract train state, nothing allocated: on an AbstractMesh, with
  one traced layer standing for all (scanned, no remat: the same parameters). exact_meta=False: traced
  unquantized (the FP8 recipe does not run here; its state is sized by formula)."""
  m = dataclasses.replace(cfg.model, scan_layers=True, remat="none")
  return build_step(dataclasses.replace(cfg, model=m), mesh, abstract=True, quantized=exact_meta)


def _data_entry(spec: str, fmt: str) -> dict:
  """Files and bytes of one data.paths entry; documents and tokens for prepared shards (their metadata)."""
  files = resolve_files(spec)
  out = {"path": spec, "files": len(files), "bytes": sum(f.stat().st_size for f in files)}
  out["format"] = fmt if fmt != "mixture" else file_format(files[0])
  meta_dir = Path(spec) if Path(spec).is_dir() else files[0].parent
  if out["format"] == "arrayrecord" and (meta_dir / META_NAME).is_file():
    meta = read_meta(meta_dir)
    out.update({k: meta[k] for k in ("documents", "tokens") if isinstance(meta.get(k), int)})
  return out


def data_summary(d: DataConfig, steps: int) -> dict:
  """What the run reads, from names and metadata only (no document is read)."""
  d = resolve_type(d)  # data.type=auto: the format from the file names
  out = {"type": d.type, "seq_len": d.seq_len, "global_batch_size": d.global_batch_size,
         "tokens_per_step": d.global_batch_size * d.seq_len, "tokens_total": steps * d.global_batch_size * d.seq_len}
  if d.type == "synthetic":
    out["source"] = "random tokens"
    return out
  if d.type == "embedded":
    out["source"] = "the shipped Jane Austen corpus (maxlm/assets/austen.txt.xz)"
  else:
    entries = [_data_entry(p, d.type) for p in split_list(d.paths)]
    if not entries:
      raise ConfigError(f"data.type={d.type} needs data.paths")
    out["sources"] = entries
    if d.weights:
      out["weights"] = d.weights
    tokens = [e.get("tokens") for e in entries]
    if all(isinstance(t, int) for t in tokens) and sum(tokens):
      out["corpus_tokens"] = sum(tokens)
      out["epochs"] = out["tokens_total"] / sum(tokens)  # approximate: BOS/EOS and packing padding not counted
  out["tokenizer"] = d.tokenizer or ("recorded in the shards" if d.type == "arrayrecord" else "shipped Austen 8k")
  out["eval"] = (f"files {d.eval_paths}" if d.eval_paths else
                 f"every {round(1 / d.eval_fraction)}th training document" if d.eval_fraction else "none")
  return out


class Shapes:
  """The dry run's abstract build of the config it sizes (maxlm/plan `size`'s state_of): the run's checks, then the
  abstract train state, whose bytes per device the Sizing takes; kept for the report's counts."""

  def __init__(self):
    self.built, self.exact_meta, self.degrees, self.here, self.backend = None, False, {}, [], ""

  def __call__(self, cfg: Config, n_devices: int, n_nodes: int) -> dict:
    m, d, t = cfg.model, cfg.data, cfg.train
    ici, dcn = mesh_shape(cfg.mesh, n_devices, n_nodes)
    self.degrees = degrees = dict(zip(AXES, (i * j for i, j in zip(ici, dcn))))
    check_pipeline(m, t, cfg.mesh, degrees["pipeline"], degrees["context"])
    check_expert_degree(m.moe.experts, degrees["expert"])
    check_batch_split(d, t, degrees)
    check_context_split(d.seq_len, degrees["context"])
    backend = resolve_backend(m.backend)
    check_remat(m.remat, backend)
    here = supported_precisions() if backend == "te" else [n for n, p in PRECISIONS.items() if not p.quantized]
    self.exact_meta = m.precision in here  # TE builds the FP8 state only where the recipe runs
    self.here, self.backend = here, backend
    self.built = built = build(cfg, AbstractMesh(tuple(degrees.values()), AXES), self.exact_meta)
    structs, shardings = built.state, built.state_shardings
    return {"params": _shard_bytes(structs.params, shardings.params),
            "optimizer": _shard_bytes(structs.opt_state, shardings.opt_state),
            "fp8_meta": _shard_bytes(structs.model_state, shardings.model_state) if self.exact_meta else None}


def plan(cfg: Config, n_devices: int, n_nodes: int = 1, device_memory: int | None = None,
         device_kind: str | None = None, sized: Sizing | None = None, shapes: Shapes | None = None) -> dict:
  """Everything the dry run reports, as plain data: the Sizing of the run (maxlm/plan `size`; `sized` with the
  `shapes` it read, as `main` made them, else cfg sized as written on n_devices) with the abstract build's counts."""
  if sized is None:
    shapes = Shapes()
    sized = planner.size(cfg, devices=n_devices, nodes=n_nodes, device_memory=device_memory, mode="off",
                         state_of=shapes)
  m, d, t = cfg.model, cfg.data, cfg.train
  ici, dcn = mesh_shape(cfg.mesh, n_devices, n_nodes)
  degrees, backend, here, exact_meta = shapes.degrees, shapes.backend, shapes.here, shapes.exact_meta
  structs = shapes.built.state

  total = sum(a.size for a in jax.tree.leaves(structs.params))
  embedding = structs.params["embed"]["embedding"].size
  counted = count_params(m)
  if total != counted["total"]:  # the formulas in sizing / flops rely on this count
    raise AssertionError(f"parameters: {total} in the model, {counted['total']} by maxlm.model.count_params")
  memory = sized.analytic
  tokens = d.global_batch_size * d.seq_len
  flops = flops_per_step(m, d.global_batch_size, d.seq_len)
  out = {
      "config": {"model": {k: getattr(m, k) for k in (
          "name", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
          "tie_embeddings", "sliding_window", "rope_theta", "rope_scaling", "precision", "param_dtype", "dtype",
          "remat", "scan_layers")} | {"backend": backend},
          "train": {"steps": t.steps, "grad_accum": t.grad_accum, "seed": t.seed},
          "optim": {"learning_rate": cfg.optim.learning_rate, "schedule": cfg.optim.schedule,
                    "warmup_steps": cfg.optim.warmup_steps, "weight_decay": cfg.optim.weight_decay,
                    "mu_dtype": cfg.optim.mu_dtype, "nu_dtype": cfg.optim.nu_dtype,
                    "moment_rounding": cfg.optim.moment_rounding, "offload": cfg.optim.offload},
          "run_dir": str(cfg.run_dir)},
      "mesh": {"devices": n_devices, "nodes": n_nodes, **degrees, "intra_node": ici, "inter_node": dcn,
               "context_strategy": context.resolve_strategy(cfg.mesh.context_strategy, degrees["context"],
                                                            d.seq_len, d.type != "synthetic" or bool(m.sliding_window)),
               "schedule": t.pipeline_schedule, "repeats": pipeline_repeats(t),
               "bubble": bubble_fraction(degrees["pipeline"], t.grad_accum, pipeline_repeats(t))},
      "params": {"total": total, "embedding": embedding, "non_embedding": total - embedding,
                 "matmul": counted["matmul"]},
      "flops": {"per_token": flops / tokens, "per_step": flops, "tokens_per_step": tokens,
                "convention": "6 * matmul params * tokens + 12 * B * attended pairs * heads * head_dim * layers"},
      "memory": {"per_device_bytes": memory, "remat": m.remat,
                 "fp8_meta_from": "the abstract state" if exact_meta else "the formula in maxlm/plan/memory.py"},
      "data": data_summary(d, t.steps),
      "precision_here": {"supported": here, "ok": m.precision in here},
  }
  if sized.device_bytes:
    out["memory"]["device_bytes"] = sized.device_bytes
    out["memory"]["fits"] = sized.verdict == "fits"
    out["memory"]["lower_bound_fits"] = sized.verdict != "does not fit"
  if sized.host is not None:  # what optim.offload pins, against this host
    h = sized.host
    out["memory"] |= {"host_ram_per_device": h["ram_per_device"], "host_pinned": h["pinned"],
                      "host_copies": h["copies"], "host_fits": h["short"] is None}
  peak = device_peak_flops(device_kind) if device_kind else None
  if peak:
    out["flops"]["device_kind"] = device_kind
    out["flops"]["step_s_at_full_mfu"] = flops / (n_devices * peak)
  return out


def _verdicts(mem: dict) -> list[str]:
  """The report's lines on whether the run fits this host's RAM (what optim.offload pins) and a device."""
  lines = []
  if "host_ram_per_device" in mem:
    verdict = "fits" if mem["host_fits"] else "does NOT fit (the run stops at start)"
    lines.append(f"  {'host RAM':<12}{human_bytes(mem['host_ram_per_device']):>11}   per device; the run pins "
                 f"{human_bytes(mem['host_pinned'])}"
                 + (" (the host state twice: jax 0.10 copies it under the step's cond)" if mem["host_copies"] == 2
                    else "") + f", at most {HOST_SHARE:.0%} may be: {verdict}")
  if "device_bytes" in mem:
    verdict = "fits" if mem["fits"] else ("the lower bound fits, the total does not" if mem["lower_bound_fits"]
                                          else "does NOT fit (the run stops at start)")
    lines.append(f"  {'device':<12}{human_bytes(mem['device_bytes']):>11}   {verdict}")
  return lines


def start_up_limits(cfg: Config, limits: list, planned_s: float | None) -> dict:
  """The start-up watchdog's limits as a run with this config derives them (maxlm/runtime/watchdog.py; they apply
  where the watchdog is on, train.watchdog): each planner compile's (from the compiles before it, the first from
  the slow floor) and the first step's compile (from the longest compile known at start: here the planning, which
  a run's first start counts too)."""
  t = cfg.train
  first = watchdog.scaled(t.watchdog_factor, t.watchdog_first_step_s, "train.watchdog_first_step_s", planned_s,
                          "the planner's compiles" if planned_s is not None else "no compile known at start")
  return {"plan_compiles_s": [round(x.seconds, 1) for x in limits], "first_step_s": round(first.seconds, 1),
          "first_step_how": first.how, "plan_compile_rule": f"the first {t.watchdog_first_step_s:g} s "
          f"(train.watchdog_first_step_s), each later one max({t.watchdog_floor_s:g} s, {t.watchdog_factor:g} x E), E "
          "its time expected from the compiles before it (maxlm/plan/clock.py)"}


def _watchdog_line(wd: dict) -> str:
  made = (f"the {len(wd['plan_compiles_s'])} compiles here {', '.join(f'{x:g}' for x in wd['plan_compiles_s'])} s; "
          if wd["plan_compiles_s"] else "")
  return (f"watchdog start-up limits (where train.watchdog is on): planner compiles: {made}{wd['plan_compile_rule']}; "
          f"the first step {wd['first_step_s']:g} s ({wd['first_step_how']})")


def _axes(ms: dict) -> str:
  """'pipeline 1 x data 1 x fsdp 8 x context 1 x tensor 1': every mesh axis's degree, expert only above 1."""
  return " x ".join(f"{a} {ms[a]}" for a in AXES if a != "expert" or ms[a] > 1)


def _param_split(ms: dict) -> str:
  """The mesh axes the parameters are split over, as the report names them (expert only where it is above 1)."""
  return "fsdp x context x expert x tensor" if ms["expert"] > 1 else "fsdp x context x tensor"


def render(p: dict) -> str:
  """The plan as text, one topic per block."""
  c, m, ms, pa, fl, mem, da = (p["config"], p["config"]["model"], p["mesh"], p["params"], p["flops"], p["memory"],
                               p["data"])
  est = mem["per_device_bytes"]
  heads = f"{m['n_heads']} heads / {m['n_kv_heads']} kv heads x {m['head_dim']}"
  extra = ", tied embeddings" if m["tie_embeddings"] else ""
  extra += f", sliding window {m['sliding_window']}" if m["sliding_window"] else ""
  lines = [
      f"maxlm dry run: {m['name']} (abstract shapes only: nothing allocated, nothing written)",
      f"model   {m['n_layers']} layers, d_model {m['d_model']}, {heads}, ffn {m['ffn_dim']}, vocab "
      f"{m['vocab_size']}{extra}, RoPE theta {m['rope_theta']:g}"
      + (f" ({m['rope_scaling']} scaling)" if m["rope_scaling"] != "none" else ""),
      f"        precision {m['precision']} on backend {m['backend']}, params {m['param_dtype']}, compute "
      f"{m['dtype']}, remat {m['remat']}, scan_layers {m['scan_layers']}",
      f"train   {c['train']['steps']} steps x {da['tokens_per_step']:,} tokens ({da['global_batch_size']} x "
      f"{da['seq_len']}, grad_accum {c['train']['grad_accum']}) = {da['tokens_total']:.3e} tokens; AdamW lr "
      f"{c['optim']['learning_rate']:g} {c['optim']['schedule']}, warmup {c['optim']['warmup_steps']}; run dir "
      f"{c['run_dir']}",
      f"mesh    {ms['devices']} device(s) on {ms['nodes']} node(s): "
      + _axes(ms) + f" (intra-node {ms['intra_node']}, inter-node {ms['inter_node']})"
      + (f"; attention over the context axis: {ms['context_strategy']}" if ms["context"] > 1 else "")
      + (f"; {ms['pipeline']} stages of {m['n_layers'] // ms['pipeline']} layers over {c['train']['grad_accum']} "
         + ("micro-batches (1F1B)" if ms["schedule"] == "1f1b" else "micro-batches (GPipe)" if ms["repeats"] == 1 else
            f"micro-batches (circular: {ms['repeats']} chunks of {m['n_layers'] // ms['pipeline'] // ms['repeats']} "
            "layers per stage)")
         + f", bubble {ms['bubble']:.0%} of a step" if ms["pipeline"] > 1 else ""),
      f"params  {pa['total']:,} total, {pa['non_embedding']:,} without the token embedding "
      f"({pa['embedding']:,}); {pa['matmul']:,} in matmuls (MFU convention, LM head included)",
      f"flops   {fl['per_token']:.4g} per token, {fl['per_step']:.4g} per step (6 x matmul params x tokens + "
      f"causal attention; README, MFU convention)"
      + (f"; {fl['step_s_at_full_mfu']:.3g} s per step at 100% MFU on {fl['device_kind']}"
         if "step_s_at_full_mfu" in fl else ""),
      "memory  per device, estimated:",
  ]
  piped = ms["pipeline"] > 1
  off = c["optim"]["offload"]
  rows = [("params", f"{m['param_dtype']}, sharded over {_param_split(ms)}" + (", the layers also over pipeline" if piped
                                                                          else "")
           + ("; in host memory (optim.offload=host_params)" if off == "host_params" else "")),
          ("optimizer", f"AdamW mu in {c['optim']['mu_dtype']}, nu in {c['optim']['nu_dtype']}, the params' "
                        "shards"
           + (f"; in host memory (optim.offload={off})" if off != "none" else "")),
          ("gradients", "same dtype and shards as the params"),
          ("fp8_meta", f"TE delayed-scaling amax histories and scales, from {mem['fp8_meta_from']}"),
          ("logits", ("the whole batch (pipelined)" if piped else "one micro-batch")
           + ", fp32 for the loss + the compute-dtype copy"),
          ("activations", "rough: everything the backward pass reads, every layer" if mem["remat"] == "none"
           else f"rough: what remat={mem['remat']} keeps per layer + one layer recomputed")]
  rows += [("exchange", f"one MoE layer's all-to-all buffers over expert {ms['expert']}: send and receive, padded "
                        "(dropless)")] if est.get("exchange") else []
  if off == "host_params":
    rows.append(("copy", "the params on the device for the step: matmul weights in the compute dtype"))
  for key, why in rows:
    lines.append(f"  {key:<12}{human_bytes(est[key]):>11}   {why}")
  lines.append(f"  {'lower bound':<12}{human_bytes(est['lower_bound']):>11}   certainly held at once: the state, and the "
               f"gradients or the LM head's output ({human_bytes(est['head'])}), both when accumulating "
               f"({est['lower_bound'] / 1e9:.1f} GB)")
  lines.append(f"  {'total':<12}{human_bytes(est['total']):>11}   ({est['total'] / 1e9:.1f} GB, the unit of peak_memory_gb)")
  if est["host"]:
    lines.append(f"  {'host':<12}{human_bytes(est['host']):>11}   the optimizer state"
                 + (" and the params" if off == "host_params" else "") + " in pinned host memory, not in the totals")
  lines += _verdicts(mem)
  src = da.get("source")
  if src is None:
    src = "; ".join(f"{e['path']} ({e['format']}, {e['files']} file(s), {human_bytes(e['bytes'])}"
                    + (f", {e['documents']:,} documents, {e['tokens']:,} tokens" if "tokens" in e else "") + ")"
                    for e in da["sources"])
  lines.append(f"data    {da['type']}: {src}")
  if "epochs" in da:
    lines.append(f"        the run reads {da['epochs']:.3g} x the corpus ({da['corpus_tokens']:,} tokens)")
  if "tokenizer" in da:
    lines.append(f"        tokenizer {da['tokenizer']}; eval: {da['eval']}")
  if p.get("watchdog"):
    lines.append(_watchdog_line(p["watchdog"]))
  ph = p["precision_here"]
  if not ph["ok"]:
    lines.append(f"note    model.precision={m['precision']} does not run on this machine (supported here: "
                 f"{', '.join(ph['supported'])}); sized for a GPU that runs it")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """`--dry-run` of maxlm.train: 0 after printing, 2 on bad config or input (one line)."""
  argv = sys.argv[1:] if argv is None else argv
  try:
    opts, words = parse_options(argv, FLAGS, SIZING)
    cfg = load_config(words)
    apply_mem_fraction(cfg.xla.mem_fraction, xla_presets.detect_gpu() is not None)  # as the trainer does
    # the trainer's plan.mode, measured the same way (maxlm/plan fit.py): fit acts on the GPUs at hand only
    limits: list[watchdog.Limit] = []  # the start-up watchdog's limit of each planner compile, as a run derives it
    began, shapes = time.monotonic(), Shapes()
    local = "devices" not in opts and "nodes" not in opts
    sized = planner.size(cfg, devices=opts.get("devices"), nodes=opts.get("nodes"),
                         device_memory=int(opts["device_memory_gb"] * 1e9) if "device_memory_gb" in opts else None,
                         state_of=shapes,
                         on_measure=lambda e: limits.append(watchdog.planned_compile_limit(cfg.train, e)))
    if sized.error is not None:
      raise sized.error
    planned_s = time.monotonic() - began if limits else None
    cfg, chosen = sized.cfg, sized.line
    kind = jax.devices()[0].device_kind if local and jax.default_backend() != "cpu" else None
    p = plan(cfg, sized.n_devices, sized.n_nodes, sized.device_bytes, kind, sized, shapes)
  except BadInput as e:  # a config, an argument, data or a precision: one line, exit 2
    return report(e)
  if chosen is not None:
    p["plan"] = chosen
  p["watchdog"] = start_up_limits(cfg, limits, planned_s)
  p["warnings"] = [w for w in (warmup_warning(cfg.optim, cfg.train.steps),) if w]
  note = "".join(f"\nwarning {w}" for w in p["warnings"])
  if local and kind is None and not p["memory"].get("fits", True):  # sized against this machine's CPU memory
    note += ("\nnote    no GPU here: the verdict is for this machine's memory. For GPUs: `maxlm plan "
            "config=... --devices N --simulate` (what the planner would choose on N H200s), or this dry run with "
            "--devices N --device-memory-gb G")
  print(json.dumps(p, indent=1) if opts.get("json") else render(p) + note + (f"\n{chosen}" if chosen else ""), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
