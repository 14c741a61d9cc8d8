"""Plans compiled by XLA:GPU for N H200s on a machine without them: per-device memory of the chosen plan, the
collectives of its compiled step against what FSDP should need, and a PREDICTED step time and tokens/s per GPU
(issue 36 items 3-5). Needs JAX's CUDA plugin (scripts/setup.sh installs it; maxlm/plan/target.py).

    python benchmarks/gpu_plan.py [--cases NAME,...] [--cache DIR] [--jsonl FILE] [--guard-as-select]

Cases (`CASES`): llama8b.yml on 1, 8 (one node) and 64 (8 nodes) H200s, with data.global_batch_size = max(8, N)
(the config's 8 rows on 1 and 8 GPUs; one row per GPU on 64: weak scaling); llama70b.yml on 8, 16, 32 and 64
H200s (8 a node, its batch of 64 rows); `cp8b`: llama8b at seq 131,072 on 8 H200s with the context axis
(context 8; `cp8b-t2`: context 4 x tensor 2, the mesh search's choice); `pp70b`: llama70b on 64 H200s with 8
pipeline stages across the nodes, against its own mesh (pure FSDP).
Each runs the lever search of `maxlm plan` on the case's mesh (`maxlm plan ... --mesh-as-written`), measured by
XLA:GPU; the chosen plan's compiled step gives the memory and the collectives; maxlm/plan/predict.py the
prediction. Layers are not cut: the compile-only measurement scans the layers (maxlm/plan/measure.py), so a
compile takes the time of one layer at any depth, and the collectives of the scanned stack are counted per
layer by the loop's trip count. Measurements are cached in --cache (default ~/.cache/maxlm/gpu_plan), keyed by
the config, the target, jax and maxlm's source: a rerun of unchanged code compiles nothing.

One JSON line per case (also appended to --jsonl), then a Markdown table. On the H200 machine (jax 0.11.2, its
CUDA plugin installed) the same command compiles with that jax; this CPU machine has jax 0.10.2, whose XLA:GPU
keeps a copy of the donated state under the step's lax.cond (docs/plan.md): its peaks are high by up to the
parameters and moments per device. `--guard-as-select` compiles that guard as a select instead (a what-if for
jax 0.11.2's in-place update; maxlm/plan/standins.py for_gpu_step says how close it came on the H200).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import jax

from maxlm.plan import levers as plan_levers
from maxlm.config import load_config, to_dict
from maxlm.layers import resolve_backend
from maxlm.plan import collectives, predict
from maxlm.plan import xla_gpu as target
from maxlm.plan.cost import degrees
from maxlm.plan.target import make_target

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30


def _case(config, n, nodes, *words):
  return {"config": config, "devices": n, "nodes": nodes, "words": list(words)}


CASES = {
    "8b-1": _case("llama8b.yml", 1, 1, "data.global_batch_size=8"),
    "8b-8": _case("llama8b.yml", 8, 1, "data.global_batch_size=8"),
    "8b-64": _case("llama8b.yml", 64, 8, "data.global_batch_size=64"),
    "70b-8": _case("llama70b.yml", 8, 1),
    "70b-16": _case("llama70b.yml", 16, 2),
    "70b-32": _case("llama70b.yml", 32, 4),
    "70b-64": _case("llama70b.yml", 64, 8),
    "cp8b": _case("llama8b.yml", 8, 1, "data.seq_len=131072", "data.global_batch_size=1", "mesh.context=8",
                  "mesh.fsdp=1"),
    "cp8b-t2": _case("llama8b.yml", 8, 1, "data.seq_len=131072", "data.global_batch_size=1", "mesh.context=4",
                     "mesh.tensor=2", "mesh.fsdp=1"),  # what the mesh search chose (tensor shards the parameters)
    "pp70b": _case("llama70b.yml", 64, 8, "mesh.dcn_pipeline=8", "mesh.dcn_fsdp=1", "model.scan_layers=true"),
}
DEFAULT = ("8b-1", "8b-8", "8b-64", "70b-8", "70b-16", "70b-32", "70b-64")


def _source_digest() -> str:
  h = hashlib.sha256()
  for path in sorted((ROOT / "maxlm").rglob("*.py")):
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


class Cache:
  """Measurements on disk, by config, target, jax and maxlm's source."""

  def __init__(self, folder: Path, target):
    self.folder, self.target, self.code = folder, target, _source_digest()
    folder.mkdir(parents=True, exist_ok=True)
    self.compiles = 0

  def measure(self, cfg) -> dict:
    key = hashlib.sha256(json.dumps([to_dict(cfg), self.target.gpu_target, self.target.n_devices,
                                     self.target.n_nodes, jax.__version__, self.code,
                                     os.environ.get(target.GUARD_AS_SELECT)], sort_keys=True)
                         .encode()).hexdigest()[:24]
    path = self.folder / f"{key}.json"
    if path.exists():
      return json.loads(path.read_text())
    self.compiles += 1
    out = self.target.measure(cfg)
    path.write_text(json.dumps(out))
    return out


def with_chunked_head(cfg, deg: dict, want: dict) -> dict:
  """FSDP's expectation with the LM head as maxlm/step.py's chunked loss runs it: its kernel gathered once per
  loss chunk (bf16), and its float32 gradient reduce-scattered once per chunk, where the expectation has it
  gathered twice and scattered once per micro-batch in bf16 (what the compiled steps showed: see the README)."""
  m, a = cfg.model, cfg.train.grad_accum
  if not m.loss_chunk or not want["all-gather"]:
    return want
  chunks = -(-cfg.data.seq_len // m.loss_chunk)
  head = m.d_model * m.vocab_size // deg["tensor"]
  return {"all-gather": want["all-gather"] - 2 * a * head * 2 + a * chunks * head * 2,
          "reduce-scatter": want["reduce-scatter"] - a * head * 2 + a * chunks * head * 4}


def run_case(name: str, case: dict, cache_dir: Path) -> dict:
  cfg = load_config([f"config={case['config']}", *case["words"]])
  t = make_target(cfg, case["devices"], case["nodes"], gpu="h200")
  if not t.gpu_target:
    raise SystemExit(f"gpu_plan: no XLA:GPU here ({t.note}); bash scripts/setup.sh installs JAX's CUDA plugin")
  cache = Cache(cache_dir, t)
  t0 = time.time()
  try:
    p = plan_levers.search(cfg, t, cache.measure, resolve_backend(cfg.model.backend))
  finally:
    t.close()
  guard = "select (what-if)" if os.environ.get(target.GUARD_AS_SELECT) == "1" else "lax.cond (as shipped)"
  row = {"case": name, "config": case["config"], "words": case["words"], "devices": t.n_devices,
         "nodes": t.n_nodes, "measured_by": t.measured_by, "guard": guard, "seconds": round(time.time() - t0, 1),
         "compiles": cache.compiles, "usable_gib": round(t.usable / GIB, 1)}
  if p.chosen is None:
    return row | {"chosen": None, "least_gib": min((r.measured for r in p.rows if r.measured), default=0) / GIB}
  c, stats = p.chosen, p.chosen.stats
  inv = stats["collectives"]
  deg = degrees(p.cfg, t)
  want = collectives.fsdp_expectation(p.cfg.model, p.cfg.train.grad_accum, deg)
  chunked = with_chunked_head(p.cfg, deg, want)
  pred = predict.predict(p.cfg, t, inv)
  return row | {
      "chosen": c.overrides, "mesh": deg, "peak_gib": round(c.measured / GIB, 2), "how": c.how,
      "params_gib": round(stats["params"] / GIB, 2), "opt_state_gib": round(stats["opt_state"] / GIB, 2),
      "collectives": {k: {f: inv[k][f] for f in ("count", "bytes", "network")} for k in collectives.KINDS},
      "fsdp_expected": want,
      "ratio": {k: round(inv[k]["bytes"] / want[k], 3) if want[k] else None for k in want},
      "with_chunked_head": chunked,
      "ratio_chunked": {k: round(inv[k]["bytes"] / chunked[k], 3) if chunked[k] else None for k in chunked},
      "predicted": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in pred.items() if k != "per_kind_s"},
      "predicted_comm_s": {k: round(v, 4) for k, v in pred["per_kind_s"].items()}}


def table(rows: list[dict]) -> str:
  out = ["| case | GPUs (nodes) | levers chosen | peak / usable per GPU | all-gather: count, GB (x FSDP; x with "
         "the chunked head) | reduce-scatter: count, GB (x FSDP; x with the chunked head) | all-reduce GB | "
         "network GB per GPU | compute / comm / step s "
         "(predicted) | tokens/s per GPU (predicted) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if not r.get("chosen"):
      out.append(f"| {r['case']} | {r['devices']} ({r['nodes']}) | nothing fits ({r.get('least_gib', 0):.1f} GiB "
                 f"least) | | | | | | | |")
      continue
    c, p = r["collectives"], r["predicted"]
    levers = ", ".join(str(v) for v in r["chosen"].values())

    def gb(k):
      ratio, chunked = r["ratio"].get(k), r["ratio_chunked"].get(k)
      return f"{c[k]['count']}, {c[k]['bytes'] / 1e9:.1f}" + (f" ({ratio:.2f}x; {chunked:.2f}x)" if ratio else "")
    net = sum(c[k]["network"] for k in c) / 1e9
    out.append(f"| {r['case']} | {r['devices']} ({r['nodes']}) | {levers} | {r['peak_gib']:.1f} / "
               f"{r['usable_gib']:.1f} GiB | {gb('all-gather')} | {gb('reduce-scatter')} | "
               f"{c['all-reduce']['bytes'] / 1e9:.2f} | {net:.1f} | {p['compute_s']:.2f} / {p['comm_s']:.2f} / "
               f"{p['step_s']:.2f} | {p['tokens_per_s_per_gpu']:,.0f} |")
  return "\n".join(out)


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default=",".join(DEFAULT), help=f"comma-separated, of {', '.join(CASES)}")
  ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "maxlm" / "gpu_plan")
  ap.add_argument("--jsonl", type=Path)
  ap.add_argument("--guard-as-select", action="store_true", help="the non-finite guard compiled as a select")
  args = ap.parse_args(argv)
  if args.guard_as_select:
    os.environ[target.GUARD_AS_SELECT] = "1"  # read by the compiling children
  rows = []
  for name in args.cases.split(","):
    row = run_case(name, CASES[name], args.cache)
    rows.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    if args.jsonl:
      with args.jsonl.open("a") as f:
        f.write(line + "\n")
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
