#!/usr/bin/env bash
# The dry run's memory estimate against the measured peak, on one GPU (run on the H200 after
# `source .whl/device-setup.sh`):
#
#   bash benchmarks/memory_estimate.sh [PRECISION ...]     (default: bf16 fp8_delayed)
#
# Shape: the Llama 3 8B shape cut to 4 layers, batch 4 x 4096, model.remat=none (as gpu_train.sh). For each
# precision: `--dry-run --json` (nothing allocated), then a 25-step run logging every 5 steps; the table
# compares the estimate (total and certain lower bound, GB = 1e9 B) with the largest peak_memory_gb in
# metrics.jsonl (the allocator's peak_bytes_in_use, max over local devices).
set -uo pipefail
OUT=${OUT:-/tmp/maxlm-mem}
runs=("$@"); [ ${#runs[@]} -gt 0 ] || runs=(bf16 fp8_delayed)
shape="config=llama8b.yml model.n_layers=4 data.seq_len=4096 data.global_batch_size=4 model.remat=${REMAT:-none} ${EXTRA:-}"
mkdir -p "$OUT"
for p in "${runs[@]}"; do
  python3 -m maxlm.train --dry-run $shape model.precision=$p --json > "$OUT/dryrun-$p.json" || exit 1
  timeout ${RUN_TIMEOUT:-240} python3 -m maxlm.train $shape model.precision=$p train.steps=25 train.log_every=5 \
    optim.warmup_steps=5 checkpoint.enabled=false output_dir="$OUT" run_name=mem-$p 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|^  "
done
python3 - "$OUT" "${runs[@]}" <<'EOF'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
print("| precision | estimate total GB | lower bound GB | params+opt+grads GB | logits GB | activations GB | measured peak GB | peak / estimate |")
print("|---|---|---|---|---|---|---|---|")
for p in runs:
  est = json.load(open(f"{out}/dryrun-{p}.json"))["memory"]["per_device_bytes"]
  rows = [json.loads(l) for l in open(f"{out}/mem-{p}/metrics.jsonl")]
  peak = max((r["peak_memory_gb"] or 0) for r in rows)
  state = est["params"] + est["optimizer"] + est["gradients"] + est["fp8_meta"]
  print(f"| {p} | {est['total'] / 1e9:.1f} | {est['lower_bound'] / 1e9:.1f} | {state / 1e9:.1f} | "
        f"{est['logits'] / 1e9:.1f} | {est['activations'] / 1e9:.1f} | {peak:.1f} | {peak / (est['total'] / 1e9):.3f} |")
EOF
