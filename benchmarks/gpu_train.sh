#!/usr/bin/env bash
# Throughput of the trainer itself on one GPU (run on the H200 after `source .whl/device-setup.sh`).
#
#   bash benchmarks/gpu_train.sh [RUN ...]     RUN in: bf16 fp8_delayed fp8_current llama1b (default: all)
#
# 8B shape cut to 4 layers (vocab 128256, AdamW, fp32 master weights), batch 4 x 4096, synthetic data.
# Each run's log and metrics.jsonl land in ${OUT:-/tmp/maxlm-bench}/<run>/.
set -uo pipefail
OUT=${OUT:-/tmp/maxlm-bench}
STEPS=${STEPS:-40}
runs=("$@"); [ ${#runs[@]} -gt 0 ] || runs=(bf16 fp8_delayed fp8_current llama1b)
common="train.steps=$STEPS train.log_every=10 optim.warmup_steps=10 output_dir=$OUT checkpoint.enabled=false"
shape="config=llama8b.yml model.n_layers=4 data.seq_len=4096 data.global_batch_size=4 model.remat=${REMAT:-none}"
for r in "${runs[@]}"; do
  case $r in
    bf16|fp8_delayed|fp8_current) args="$shape model.precision=$r run_name=8b4l-$r" ;;
    llama1b) args="config=llama3.2-1b.yml data.seq_len=4096 data.global_batch_size=8 model.remat=${REMAT_1B:-none} run_name=1b-bf16" ;;
    *) echo "unknown run $r"; exit 2 ;;
  esac
  echo "=== $r: python -m maxlm.train $args $common ${EXTRA:-}"
  timeout ${RUN_TIMEOUT:-280} python3 -m maxlm.train $args $common ${EXTRA:-} 2>&1 | grep -v "UserWarning\|warnings.warn\|^  " 
done
