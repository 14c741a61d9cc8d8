#!/usr/bin/env bash
# Time to the first step, cold (empty compilation cache) and warm (a second start on the same cache), for
# llama3.2-3b at full size on one GPU (run on the H200 after `source .whl/device-setup.sh`):
#
#   bash benchmarks/startup.sh
#   CASES="bf16:unrolled fp8_delayed:scan" BUDGET_S=500 bash benchmarks/startup.sh
#
# A case is PRECISION:LAYERS[:STEPS] (model.precision, and model.scan_layers: unrolled = false, the shipped
# config's, scan = true; STEPS, default 3: train.steps of both runs, so that tokens_per_s, the mean over the steps
# after the second, measures the step time; both runs must have the same steps, or the warm one is another
# program). CONFIG (default llama3.2-3b) picks the shipped config. PROFILE="CASE ..." adds a third run to each case
# named, a warm start under cProfile: its 45 costliest calls by cumulative time go to $OUT/prof-<case>.txt (the
# timed warm run stays unprofiled). AUTOTUNE="CASE ..." adds three runs to each case named, with compile.warm_start=false and
# plan.mode=off on a cache directory of their own, to measure what XLA's autotune cache buys alone: `nocache` (the
# directory empty: XLA compiles and autotunes, JAX writes its entry and the autotune files), `autotune` (JAX's
# entries deleted, the autotune subdirectory kept: XLA compiles again, autotuning replaced by the kept results),
# `jaxcache` (everything kept: JAX's cache hands the executable back). Their compile_s are the three costs.
# Default order: bf16:unrolled fp8_delayed:unrolled bf16:scan fp8_delayed:scan. Each case runs
# `python -m maxlm.train config=llama3.2-3b.yml train.steps=3` twice on its own cache directory: first emptied
# (cold), then again (warm). The first row of each run's metrics.jsonl gives the parts of the time from process
# start to the first step's end (startup_s = backend_s + plan_s + init_s + lower_s + compile_s + first_run_s,
# maxlm/runtime/startup.py) and whether the train step came from the cache. BUDGET_S (default 540: one 10-minute
# device call less the set-up) bounds the whole script: a case starts only when its estimated cold + warm
# time (the last measured cold and warm times, else COLD_EST_S=130 and WARM_EST_S=60) fits in what is left,
# and each run is stopped when the budget ends. PLAN_MODE (default off) is passed as plan.mode, so that
# compile_s is the trainer's own compile (plan.mode=fit compiles the step once more to measure it).
# After each cold run the cache's size and the number of XLA autotune files it holds
# (xla_gpu_per_fusion_autotune_cache_dir, written by JAX's default jax_persistent_cache_enable_xla_caches)
# are recorded. Outputs, three files in ${OUT:-/tmp/maxlm-startup}: startup.log (every run's output),
# startup.json (one record per run), startup.md (the table, also printed at the end). Runs and caches live
# in /tmp/maxlm-startup-work, not in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/maxlm-startup}
WORK=${WORK:-/tmp/maxlm-startup-work}
BUDGET_S=${BUDGET_S:-540}
CASES=${CASES:-"bf16:unrolled fp8_delayed:unrolled bf16:scan fp8_delayed:scan"}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/startup.log JSON=$OUT/startup.json
: > "$LOG"; : > "$JSON"
t0=$(date +%s)
cold_est=${COLD_EST_S:-130} warm_est=${WARM_EST_S:-60}
left() { echo $(( BUDGET_S - ($(date +%s) - t0) )); }

run() {  # run CASE PHASE CACHE PRECISION SCAN STEPS (PHASE prof: a warm start under cProfile)
  local case=$1 phase=$2 cache=$3 precision=$4 scan=$5 steps=$6 name limit start rc secs
  local -a py=(python3)
  name="${case//:/-}-$phase"
  [ "$phase" = prof ] && py=(python3 -m cProfile -o "$WORK/$name.pstats")
  limit=$(( $(left) - 5 ))
  [ "$limit" -gt 10 ] || { echo "=== $name: skipped, the budget is spent" | tee -a "$LOG"; return 1; }
  echo "=== $name ($(date +%T), limit ${limit} s)" | tee -a "$LOG"
  rm -rf "$WORK/runs/$name"
  start=$(date +%s)
  timeout "$limit" "${py[@]}" -m maxlm.train config="${CONFIG:-llama3.2-3b}.yml" train.steps="$steps" train.log_every=1 \
    checkpoint.enabled=false plan.mode="${PLAN_MODE:-off}" model.precision="$precision" \
    model.scan_layers="$scan" output_dir="$WORK/runs" run_name="$name" compile.cache_dir="$cache" ${EXTRA:-} \
    2>&1 | grep -v "UserWarning\|warnings.warn\|^  " >> "$LOG"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then grep "maxlm: first step\|maxlm: compilation cache" "$LOG" | tail -2
  else echo "$name: exit $rc after ${secs} s"; tail -3 "$LOG"; fi
  if [ "$phase" = prof ] && [ -f "$WORK/$name.pstats" ]; then
    python3 -c "import pstats, sys; pstats.Stats(sys.argv[1], stream=sys.stdout).sort_stats('cumulative').print_stats(45)" \
      "$WORK/$name.pstats" > "$OUT/prof-${case//:/-}.txt" 2>&1
  fi
  python3 - "$WORK/runs/$name/metrics.jsonl" "$cache" "$case" "$phase" "$rc" "$secs" "${CONFIG:-llama3.2-3b}" >> "$JSON" <<'PY'
import json, os, sys
path, cache, case, phase, rc, secs, config = sys.argv[1:]
row, rows = {}, []
if os.path.exists(path):
  rows = [json.loads(line) for line in open(path).read().splitlines() if line.strip()]
  row = rows[0] if rows else {}
later = [r["tokens_per_sec"] for r in rows if r.get("step", 0) > 2 and r.get("tokens_per_sec")]
keep = ("startup_s", "backend_s", "plan_s", "init_s", "lower_s", "compile_s", "first_run_s", "compile_cache_hit",
        "compile_cache_hits", "compile_cache_requests", "warm_start", "peak_memory_gb", "compiled_memory_gb")
size = files = autotune = atime = 0
for root, _, names in os.walk(cache):
  for n in names:
    files += 1
    size += os.path.getsize(os.path.join(root, n))
    autotune += "autotune" in root
    atime += n.endswith("-atime")  # written by maxlm's atomic file cache (JAX's unbounded one writes none)
rec = {"config": config, "case": case, "phase": phase, "exit": int(rc), "wall_s": int(secs),
       **{k: row.get(k) for k in keep}, "tokens_per_s": sum(later) / len(later) if later else None,
       "cache_bytes": size, "cache_files": files, "autotune_files": autotune, "atime_files": atime}
print(json.dumps(rec))
PY
  [ "$rc" -eq 0 ] || return 1
  if [ "$phase" = cold ]; then cold_est=$secs; else warm_est=$secs; fi
}

for case in $CASES; do
  IFS=: read -r precision layers steps <<< "$case"; steps=${steps:-3}
  case $layers in unrolled) scan=false ;; scan) scan=true ;; *) echo "unknown case $case"; exit 2 ;; esac
  need=$(( cold_est + warm_est ))
  if [ "$(left)" -lt "$need" ]; then
    echo "=== $case: skipped, ${need} s estimated, $(left) s left of BUDGET_S=$BUDGET_S" | tee -a "$LOG"
    continue
  fi
  cache=$WORK/cache/${case//:/-}
  rm -rf "$cache"
  run "$case" cold "$cache" "$precision" "$scan" "$steps" && run "$case" warm "$cache" "$precision" "$scan" "$steps" &&
    { [[ " ${PROFILE:-} " != *" $case "* ]] || run "$case" prof "$cache" "$precision" "$scan" "$steps"; }
  if [[ " ${AUTOTUNE:-} " == *" $case "* ]]; then  # what XLA's autotune cache buys alone (see the top)
    cache=$WORK/cache/${case//:/-}-autotune
    rm -rf "$cache"
    EXTRA="${EXTRA:-} compile.warm_start=false" PLAN_MODE=off run "$case" nocache "$cache" "$precision" "$scan" "$steps" &&
      find "$cache" -maxdepth 1 -type f -delete &&
      EXTRA="${EXTRA:-} compile.warm_start=false" PLAN_MODE=off run "$case" autotune "$cache" "$precision" "$scan" "$steps" &&
      EXTRA="${EXTRA:-} compile.warm_start=false" PLAN_MODE=off run "$case" jaxcache "$cache" "$precision" "$scan" "$steps"
  fi
done

python3 - "$JSON" > "$OUT/startup.md" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cols = ("startup_s", "backend_s", "plan_s", "init_s", "lower_s", "compile_s", "first_run_s")
print("| config | case | start | exit | to first step s | imports+backend | plan | init | trace+lower | compile | "
      "first run | train step from | cache MB (autotune files) | peak GB | tokens/s after step 2 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
fmt = lambda v: "-" if v is None else f"{v:.1f}"
for r in rows:
  print(f"| {r.get('config', '-')} | {r['case']} | {r['phase']} | {r['exit']} | " + " | ".join(fmt(r[c]) for c in cols)
        + f" | {'warm start' if r.get('warm_start') else 'JAX cache' if r['compile_cache_hit'] else 'compile'} | "
        f"{r['cache_bytes'] / 1e6:.1f} ({r['autotune_files']}) | "
        f"{fmt(r['peak_memory_gb'])} | {fmt(r.get('tokens_per_s'))} |")
PY
cat "$OUT/startup.md"
echo "total $(( $(date +%s) - t0 )) s of BUDGET_S=$BUDGET_S"
