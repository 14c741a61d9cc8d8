#!/bin/bash
# MaxText 0.2.5's settings for the full Llama 3 8B (32 layers, batch 1 x 8192) at bf16 mu / fp32 nu, one after the
# other in one device call, to find its best setting at maxlm's equal precision (issue 40). Each try is the
# side-by-side's `maxtext:llama8b_full` with its words appended (SBS_MT_FULL_EXTRA), $STEPS steps; a try not
# started when fewer than $EST seconds are left of $BUDGET.
#   run(command="source .whl/device-setup.sh >/dev/null; bash benchmarks/maxtext_settings.sh", carry=[".whl", ".bench"])
# Output: $OUT/t<i>/side_by_side.json and the try's log (2 files a try: at most 4 tries a call).
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-570}; EST=${EST:-150}; STEPS=${STEPS:-15}
TRIES=${TRIES:-"remat_policy=custom|context=device remat_policy=minimal_offloaded remat_policy=save_out_proj remat_policy=qkv_proj_offloaded"}
i=0
for t in $TRIES; do
  i=$((i + 1)); left=$((BUDGET - $(date +%s) + T0))
  words=${t//|/ }
  if [ "$left" -lt "$EST" ]; then echo "=== try $i ($words): not started, ${left}s left"; continue; fi
  echo "=== try $i: $words (${left}s left)"
  OUT=$OUT/t$i SBS_RUNS='maxtext:llama8b_full' SBS_MT_FULL_STEPS=$STEPS SBS_MT_FULL_EXTRA="$words" \
    SBS_BUDGET_S=$((left < 250 ? left : 250)) SBS_TMO_MAXTEXT_FULL=$((left < 235 ? left - 15 : 220)) SBS_EST_MAXTEXT_FULL=60 \
    bash .bench/side_by_side.sh 2>&1 | tail -4
done
