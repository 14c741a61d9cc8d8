#!/usr/bin/env bash
# XLA flag presets on one GPU (run on the H200 after `source .whl/device-setup.sh`; ~5 minutes):
#
#   bash benchmarks/presets.sh [PRECISION:PRESET ...]
#       default: bf16:none bf16:hopper fp8_delayed:none fp8_delayed:hopper
#
# 1. `maxlm doctor` for the benchmark's config (every check should pass; its xla_flags line shows the
#    preset `auto` picked and that this jaxlib starts with those flags),
# 2. every preset's flags against this jaxlib (a fresh backend per preset; XLA aborts on an unknown flag),
# 3. the Llama 3 8B shape cut to 4 layers, batch 4 x 4096, synthetic data (as benchmarks/gpu_train.sh),
#    once per PRECISION:PRESET, then a table of tokens/s (mean of the logged rows after step 10).
# Your XLA_FLAGS still apply and win over a preset's flag of the same name, so one flag can be isolated:
#   XLA_FLAGS=--xla_gpu_enable_triton_gemm=true bash benchmarks/presets.sh bf16:hopper
# Logs and metrics: ${OUT:-/tmp/maxlm-presets}/<precision>-<preset>/. SHAPE="key=value ..." replaces the shape.
set -uo pipefail
OUT=${OUT:-/tmp/maxlm-presets}
STEPS=${STEPS:-30}
PY=${PYTHON:-python3}
runs=("$@"); [ ${#runs[@]} -gt 0 ] || runs=(bf16:none bf16:hopper fp8_delayed:none fp8_delayed:hopper)
shape=${SHAPE:-"config=llama8b.yml model.n_layers=4 data.seq_len=4096 data.global_batch_size=4 model.remat=none"}
common="train.steps=$STEPS train.log_every=10 optim.warmup_steps=10 output_dir=$OUT checkpoint.enabled=false"
mkdir -p "$OUT"

echo "=== maxlm doctor $shape model.precision=fp8_delayed"
timeout 240 $PY -m maxlm.tools.doctor $shape model.precision=fp8_delayed output_dir="$OUT" 2>"$OUT/doctor.stderr"
echo "(doctor exit code $?; its stderr: $OUT/doctor.stderr)"

echo "=== each preset's flags against this jaxlib"
for p in $($PY -c "from maxlm.runtime.xla_presets import PRESETS; print(' '.join(n for n in PRESETS if PRESETS[n]))"); do
  flags=$($PY -c "from maxlm.runtime.xla_presets import PRESETS; print(' '.join(PRESETS['$p']))")
  if XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 $PY -c "import jax; jax.devices()" \
      2>"$OUT/flags-$p.stderr"; then
    echo "$p: accepted ($flags)"
  else
    echo "$p: REJECTED: $(grep -o 'Unknown flags\? in XLA_FLAGS: .*' "$OUT/flags-$p.stderr" || tail -1 "$OUT/flags-$p.stderr")"
  fi
done

for r in "${runs[@]}"; do
  prec=${r%%:*}; preset=${r#*:}; name=$prec-$preset
  echo "=== $name: $PY -m maxlm.train $shape model.precision=$prec xla.preset=$preset $common"
  rm -rf "${OUT:?}/$name"
  timeout ${RUN_TIMEOUT:-150} $PY -m maxlm.train $shape model.precision=$prec xla.preset=$preset run_name=$name \
    $common >"$OUT/$name.log" 2>&1
  echo "exit code $?; $(grep -m1 'xla.preset=' "$OUT/$name.log" || echo 'no preset flags added')"
  grep '^step ' "$OUT/$name.log" | tail -2
done

echo "=== tokens/s (mean over the logged steps after step 10; vs. the same precision with preset none)"
$PY - "$OUT" "${runs[@]}" <<'EOF'
import json, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), sys.argv[2:]
rows = {}
for r in runs:
  f = out / r.replace(":", "-") / "metrics.jsonl"
  steady = [json.loads(ln) for ln in f.read_text().splitlines()] if f.exists() else []
  steady = [m for m in steady if m["step"] > 10 and m.get("tokens_per_sec")]
  rows[r] = (sum(m["tokens_per_sec"] for m in steady) / len(steady),
             1e3 * sum(m["step_time"] for m in steady) / len(steady)) if steady else None
print(f"| precision | preset | tokens/s | step | vs. none |\n|---|---|---|---|---|")
for r, v in rows.items():
  prec, preset = r.split(":", 1)
  base = rows.get(f"{prec}:none")
  rel = f"{v[0] / base[0]:.3f}" if v and base else "n/a"
  print(f"| {prec} | {preset} | " + (f"{v[0]:,.0f} | {v[1]:.1f} ms | {rel} |" if v else "failed (see its log) | | |"))
EOF
