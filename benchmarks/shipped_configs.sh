#!/usr/bin/env bash
# The shipped configs on one GPU, as shipped (run on the H200 from the project root; it sources
# .whl/device-setup.sh itself):
#
#   SHIPPED="llama3.2-1b llama3.2-3b" bash benchmarks/shipped_configs.sh
#
# Each config in $SHIPPED (default: llama3.2-1b llama3.2-3b llama3.1-8b mistral7b llama2-7b) trains with
# `python -m maxlm.train config=<name>.yml train.steps=30 train.log_every=10 output_dir=... run_name=<name>
# checkpoint.enabled=false`: nothing else changed, so plan.mode=fit (the default) keeps a config that XLA measures
# to fit the GPU and plans the memory levers of one that does not, in one line. checkpoint.enabled=false only
# because a final checkpoint with the optimizer state is 12 bytes a parameter: ~96 GB for an 8B, more than the
# machine's 64 GiB of disk.
#
# Time: one device call has 600 s. A config is not started when its expected length (EST below, seconds from
# start to step 30 including planning and compiling; `SHIPPED_EST="llama2-7b:200 ..."` overrides) no longer fits
# in SHIPPED_BUDGET_S (570) counted from the start; one that runs out of time keeps the 10-step windows it logged
# (status "timeout(partial)"). Each 8B-class config takes about 6 minutes alone: give those one call each.
# llama70b (not in the default list) does not fit one GPU: its run ends with exit 2 and one line naming the
# smallest device count that fits (simulated on this machine's CPUs), recorded as "error" in the JSON.
#
# Recorded per config in $OUT/shipped_configs.json (and its log as $OUT/<name>.log: at most 7 configs, so that
# with the JSON at most 8 files come back): the plan line; the planner's predicted peak (the "peak X GiB" of that
# line: XLA's memory analysis of the compiled step, measured before the run) against the measured peak (the
# allocator's peak_bytes_in_use, peak_memory_gb in metrics.jsonl) and XLA's estimate for the trainer's own
# executable; tokens/s and MFU (mean of the logged windows after the first, i.e. steps 11-30); the loss at the
# first and last logged steps; the peak of nvidia-smi's memory.used (sampled every second).
set -uo pipefail
T0=$(date +%s)
source .whl/device-setup.sh || exit 1
OUT=${OUT:-/tmp/maxlm-shipped}
SCR=${SHIPPED_SCR:-/tmp/maxlm-shipped-runs}
BUDGET=${SHIPPED_BUDGET_S:-570}
CONFIGS=${SHIPPED:-"llama3.2-1b llama3.2-3b llama3.1-8b mistral7b llama2-7b"}
mkdir -p "$OUT"; rm -rf "$SCR"; mkdir -p "$SCR"
MANIFEST=$SCR/runs.tsv; : > "$MANIFEST"
now() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(now)s] $*"; }
est() {  # expected seconds to step 30 (planning, compiling, 30 steps); SHIPPED_EST overrides
  local w
  for w in ${SHIPPED_EST:-}; do [ "${w%%:*}" = "$1" ] && { echo "${w#*:}"; return; }; done
  case $1 in
    llama3.2-1b) echo 150 ;;
    llama3.2-3b) echo 240 ;;
    llama2-7b) echo 300 ;;
    llama70b) echo 200 ;;   # does not fit one GPU: it ends with one line naming the smallest device count
    *) echo 380 ;;
  esac
}
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
n_run=0
for c in $CONFIGS; do
  if [ ! -f "maxlm/configs/$c.yml" ]; then say "=== $c: no maxlm/configs/$c.yml"; continue; fi
  left=$(( BUDGET - $(now) )); e=$(est "$c")
  if [ "$left" -lt "$e" ] || [ "$n_run" -ge 7 ]; then
    say "=== $c NOT STARTED: expected ~${e}s, ${left}s left of SHIPPED_BUDGET_S=$BUDGET"
    printf '%s\tnot_started\t\t0\n' "$c" >> "$MANIFEST"; continue
  fi
  n_run=$((n_run + 1))
  cmd=(python3 -m maxlm.train "config=$c.yml" train.steps=30 train.log_every=10 "output_dir=$SCR/runs" "run_name=$c"
       checkpoint.enabled=false)
  say "=== $c (timeout ${left}s): ${cmd[*]}"
  (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1; sleep 1; done) \
    > "$SCR/smi_$c.txt" &
  smi=$!
  t1=$(date +%s)
  timeout -k 5 "$left" "${cmd[@]}" > "$OUT/$c.log" 2>&1
  rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  status=ok; if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status=failed; fi
  grep -E "^maxlm: (plan|first step|error)" "$OUT/$c.log" | cut -c1-400
  grep -E "^step [0-9]+/" "$OUT/$c.log" | tail -n 3
  [ "$status" = ok ] || tail -n 5 "$OUT/$c.log" | cut -c1-300
  say "    $c: $status (rc=$rc) after $(( $(date +%s) - t1 ))s"
  printf '%s\t%s\t%s\t%s\n' "$c" "$status" "$rc" "$(( $(date +%s) - t1 ))" >> "$MANIFEST"
done

SH_MANIFEST=$MANIFEST SH_SCR=$SCR SH_OUT=$OUT SH_T0=$T0 SH_BUDGET=$BUDGET python3 - <<'EOF'
import json, os, re, statistics as st, time
E = os.environ
GIB_TO_GB = 2**30 / 1e9
rows = []
for line in open(E["SH_MANIFEST"]):
  name, status, rc, wall = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
  r = {"config": name, "status": status, "rc": int(rc) if rc else None, "wall_s": int(wall or 0)}
  log = os.path.join(E["SH_OUT"], f"{name}.log")
  text = open(log, errors="replace").read() if os.path.exists(log) else ""
  ms = []
  mpath = os.path.join(E["SH_SCR"], "runs", name, "metrics.jsonl")
  if os.path.exists(mpath):
    for l in open(mpath):
      try: ms.append(json.loads(l))
      except ValueError: pass
  logged = [m for m in ms if m.get("loss") is not None]
  steady = [m for m in logged if m.get("step_time") and m["step"] > 10]
  if steady:
    r["steady_steps"] = 10 * len(steady)
    r["tokens_per_s"] = round(st.mean(m["tokens_per_sec"] for m in steady), 1)
    r["step_s"] = round(st.mean(m["step_time"] for m in steady), 3)
    mfu = [m["mfu"] for m in steady if m.get("mfu") is not None]
    r["mfu"] = round(st.mean(mfu), 4) if mfu else None
  if logged:
    r["loss_first_logged"] = {"step": logged[0]["step"], "loss": logged[0]["loss"]}
    r["loss_last_logged"] = {"step": logged[-1]["step"], "loss": logged[-1]["loss"]}
  peaks = [m["peak_memory_gb"] for m in ms if m.get("peak_memory_gb")]
  r["measured_peak_gb"] = max(peaks) if peaks else None
  est = [m["compiled_memory_gb"] for m in ms if m.get("compiled_memory_gb")]
  r["xla_estimate_of_the_run_gb"] = est[0] if est else None
  m = re.search(r"^maxlm: (plan: [^\n]*)", text, re.M)
  r["plan_line"] = m.group(1) if m else None
  m = re.search(r"\(peak ([\d.]+) GiB of ([\d.]+) GiB usable", r["plan_line"] or "")
  r["predicted_peak_gb"] = round(float(m.group(1)) * GIB_TO_GB, 2) if m else None
  if r["predicted_peak_gb"] and r["measured_peak_gb"]:
    r["predicted_over_measured"] = round(r["predicted_peak_gb"] / r["measured_peak_gb"], 4)
    r["within_5_percent"] = abs(r["predicted_over_measured"] - 1) <= 0.05
  m = re.search(r"^maxlm: first step[^\n]*", text, re.M)
  r["first_step_line"] = m.group(0) if m else None
  m = re.search(r"^maxlm: error: [^\n]*", text, re.M)
  if m: r["error"] = m.group(0)
  smi = os.path.join(E["SH_SCR"], f"smi_{name}.txt")
  used = [int(x) for x in open(smi).read().split() if x.isdigit()] if os.path.exists(smi) else []
  r["peak_smi_mib"] = max(used) if used else None
  if steady and r["status"] != "ok":
    r["status"] += "(partial)"
  rows.append(r)
out = {"date": time.strftime("%Y-%m-%d"), "budget_s": int(E["SH_BUDGET"]),
       "elapsed_s": int(time.time()) - int(E["SH_T0"]), "configs": rows,
       "note": "predicted = the planner's peak in its line (XLA's memory analysis, GiB converted to GB); measured = "
               "peak_bytes_in_use (GB); tokens/s and MFU: mean of the logged 10-step windows after the first"}
json.dump(out, open(os.path.join(E["SH_OUT"], "shipped_configs.json"), "w"), indent=1)
def f(x, fmt):
  return format(x, fmt) if isinstance(x, (int, float)) else "-"
print("\n%-13s %-17s %10s %7s %9s %9s %8s %16s" % ("config", "status", "tokens/s", "MFU", "predicted", "measured",
                                                  "pred/meas", "loss first->last"))
for r in rows:
  lf, ll = r.get("loss_first_logged") or {}, r.get("loss_last_logged") or {}
  print("%-13s %-17s %10s %6s%% %8s G %8s G %8s %16s" % (
      r["config"], r["status"], f(r.get("tokens_per_s"), ",.0f"), f(r.get("mfu") and 100 * r["mfu"], ".1f"),
      f(r.get("predicted_peak_gb"), ".1f"), f(r.get("measured_peak_gb"), ".1f"), f(r.get("predicted_over_measured"), ".3f"),
      f"{f(lf.get('loss'), '.3f')}->{f(ll.get('loss'), '.3f')}"))
  if r.get("plan_line"):
    print(f"    {r['plan_line']}")
print("json:", os.path.join(E["SH_OUT"], "shipped_configs.json"), "| elapsed", out["elapsed_s"], "s")
EOF
