#!/usr/bin/env bash
# The memory planner on one GPU (run on the H200 after `source .whl/device-setup.sh`):
#
#   bash benchmarks/plan_gpu.sh [PART ...]     PART in: fraction compare plan8b train8b (default: the first three)
#
# fraction: what JAX's allocator gets at XLA_CLIENT_MEM_FRACTION=0.95. compare: XLA:GPU's measurement of the
# 8B shape cut to 4 layers (batch 4 x 4096) against the simulated XLA:CPU one (`--simulate`), every remat
# policy, offload none and host. plan8b: `maxlm plan config=llama8b.yml`. train8b: 8 steps of llama8b.yml with
# plan.mode=auto, nvidia-smi sampling the memory used. Outputs land in ${OUT:-/tmp/maxlm-plan}.
set -uo pipefail
OUT=${OUT:-/tmp/maxlm-plan}
mkdir -p "$OUT"
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(fraction compare plan8b)
shape=${SHAPE:-"config=llama8b.yml model.n_layers=4 data.seq_len=4096 data.global_batch_size=4"}
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  case $part in
    fraction)
      nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
      XLA_CLIENT_MEM_FRACTION=0.95 python3 -c 'import jax; s = jax.devices()[0].memory_stats(); print("bytes_limit at 0.95:", s["bytes_limit"], s["bytes_limit"] / 2**30, "GiB")'
      python3 -c 'import jax; s = jax.devices()[0].memory_stats(); print("bytes_limit, no fraction set:", s["bytes_limit"], s["bytes_limit"] / 2**30, "GiB")' ;;
    compare)
      for how in gpu simulate; do
        flag=$([ $how = simulate ] && echo --simulate)
        /usr/bin/time -f "$how: %e s" timeout ${T_COMPARE:-200} python3 -m maxlm.cli plan $shape \
          plan.levers=model.remat,optim.offload --all --json $flag > "$OUT/compare-$how.json" 2> "$OUT/compare-$how.err"
        tail -3 "$OUT/compare-$how.err"
      done
      python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {how: {json.dumps(r["levers"], sort_keys=True): r for r in json.load(open(f"{out}/compare-{how}.json"))["candidates"]}
        for how in ("gpu", "simulate")}
print("| remat | offload | XLA:GPU GiB | simulated XLA:CPU GiB | CPU / GPU | GPU host GiB |")
print("|---|---|---|---|---|---|")
for k, g in rows["gpu"].items():
  s = rows["simulate"].get(k)
  gm, sm = g["measured_bytes"], s and s["measured_bytes"]
  host = (g["xla"] or {}).get("host", 0)
  ratio = f"{sm / gm:.3f}" if gm and sm else "-"
  print(f"| {g['levers']['model.remat']} | {g['levers']['optim.offload']} | {gm and gm / 2**30:.2f} | "
        f"{sm and sm / 2**30:.2f} | {ratio} | {host / 2**30:.2f} |")
PY
      ;;
    plan8b)
      /usr/bin/time -f "plan8b: %e s" timeout ${T_PLAN:-420} python3 -m maxlm.cli plan config=llama8b.yml --json \
        > "$OUT/plan8b.json" 2> "$OUT/plan8b.err"; tail -5 "$OUT/plan8b.err"
      python3 -c "
import json; p = json.load(open('$OUT/plan8b.json')); print(p['target']); print('chosen', p['chosen'])
for r in p['candidates']:
  if r['measured_bytes'] is not None or r['chosen']: print(r['levers'], r['status'], r['measured_bytes'] and round(r['measured_bytes'] / 2**30, 2), r['how'])" ;;
    train8b)
      (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> "$OUT/smi.txt"; sleep 1; done) &
      smi=$!
      timeout ${T_TRAIN:-500} python3 -m maxlm.train config=llama8b.yml plan.mode=auto train.steps=${STEPS:-8} \
        train.log_every=2 checkpoint.enabled=false output_dir="$OUT/runs" 2>&1 | grep -v "UserWarning\|warnings.warn\|^  "
      kill $smi; echo "nvidia-smi memory.used max (MiB): $(sort -n "$OUT/smi.txt" | tail -1)"
      tail -2 "$OUT/runs/"*/metrics.jsonl | cut -c1-400 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
