#!/bin/bash
# shellcheck disable=SC2206  # array words built from scratch paths, variant names, numbers: no spaces
# maxlm vs MaxText 0.2.5 vs PyTorch (HF LlamaForCausalLM + torch.compile) on ONE H200 in ONE device
# call, so the ratios share a GPU, a driver and a moment. Llama-3-8B shape cut to 4 layers, batch 4 x
# 4096, vocab 128256, synthetic data, AdamW, fp32 master weights, bf16 compute; FP8 through
# Transformer Engine (delayed / current scaling). No remat in maxlm (model.remat=none, as
# benchmarks/gpu_train.sh); MaxText with remat_policy=minimal_with_context (its GPU recipe; it has no
# "none"); PyTorch without checkpointing.
#
# Layout (../shared/bench/prep.sh builds it; see ../shared/bench/README.md). Run from the project root:
#   .bench/side_by_side.sh       this script
#   .bench/maxtext/*.whl         MaxText 0.2.5 + its missing dependencies (../shared/bench/maxtext/)
#   .bench/torch_peer_full.py    the PyTorch peer
#   .bench/maxlm_commit.txt      the maxlm commit the results are labelled with
#   maxlm sources                ./maxlm/ (the project root as cwd) or .bench/main/ (a copy of the tree)
#   maxlm's device wheels        ./.whl/ or .bench/whl/ (../shared/tools/device-wheels.sh)
#
# Order (SBS_RUNS): the headline pairs first, interleaved so that both frameworks meet the same GPU state:
#   maxlm:bf16 maxtext:bf16_te maxlm:fp8_delayed maxtext:fp8ds_te maxlm:fp8_current torch:compiled maxtext:fp8cs_te
# Each run has its own timeout; a run is not started when its expected length (the longest finished
# run of its framework, else a default) no longer fits in SBS_BUDGET_S (580 s) counted from the start.
#
# Installs: maxlm's wheels into $SBS_SITE (default /tmp/site) as .whl/device-setup.sh does (only
# cp312 / py3 wheels, one per distribution), PYTHONPATH=$SBS_SITE:<maxlm tree>, CUDNN_PATH/LD_LIBRARY_PATH
# at the pip cuDNN. MaxText's wheels into $SBS_SITE_MT (default /tmp/site_mt), only distributions that
# .whl lacks (grain, array_record, ml_collections, portpicker, pydantic, TE come from $SBS_SITE);
# MaxText runs with PYTHONPATH=$SBS_SITE_MT:$SBS_SITE. PyTorch runs with the machine's own environment.
# XLA_FLAGS: maxlm gets the inherited value (normally unset: the user default, no MaxText flags);
# MaxText gets its A3 recipe flags (never empty: MaxText 0.2.5 dumps HLO when XLA_FLAGS is empty).
# JAX compilation cache: none for maxlm; a fresh directory per MaxText run (no reuse across variants).
#
# The full-size pair (runs maxlm:llama8b_full, maxtext:llama8b_full; not in the default SBS_RUNS):
#   maxlm:llama8b_full    python -m maxlm.train config=llama8b.yml as shipped (Llama 3 8B, 32 layers, batch 8 x
#                         8192, plan.mode=fit: the planner chooses the memory levers and prints them in one line),
#                         train.steps=$SBS_FULL_STEPS (30) train.log_every=$SBS_LOG_EVERY (10); checkpoint.enabled=false
#                         (a final 8B checkpoint with its optimizer state is ~96 GB of disk) and the output dir
#   maxtext:llama8b_full  MaxText llama3-8b, all 32 layers, per_device_batch_size=1 max_target_length=8192,
#                         mu_dtype=bfloat16 remat_policy=full scan_layers=true attention=cudnn_flash_te,
#                         XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, $SBS_MT_FULL_STEPS (20) steps, its recipe's XLA flags
#   maxtext:llama8b_full+POLICY[+bN]   the same with remat_policy=POLICY (and per_device_batch_size=N): the
#                         search for MaxText's best setting (e.g. llama8b_full+save_out_proj+b1)
#   Each samples nvidia-smi's memory.used every second (max in the JSON: peak_smi_mib). The full maxlm run's
#   timeout is all the time left (SBS_BUDGET_S), MaxText's SBS_TMO_MAXTEXT_FULL (240 s): a run cut short keeps
#   the steps it logged ("(partial)").
#   run(command="SBS_RUNS='maxtext:llama8b_full maxlm:llama8b_full' bash .bench/side_by_side.sh", carry=[".whl", ".bench"])
# Output: $OUT/side_by_side.json + $OUT/<run>.log per run (8 files with the default SBS_RUNS; the
# device returns at most 8). Final table: step ms (mean over steady steps), tokens/s, TFLOP/s (each
# framework's own count; all follow MaxText's convention, 144.0 TF/step here), ratio vs MaxText at
# the same precision and vs torch.compile.
# Steady state: maxlm 30 steps logged every 10, the rows of steps 11-30 (= benchmarks/README.md's
# method); MaxText 25 steps, steps 5-24 (per-step host timings, synced one step behind); PyTorch 3
# warm-ups then 20 timed steps.
# Knobs: SBS_RUNS SBS_BUDGET_S SBS_STEPS SBS_LOG_EVERY SBS_MT_STEPS SBS_MT_SKIP SBS_TORCH_STEPS
#        SBS_TMO_MAXLM SBS_TMO_MAXTEXT SBS_TMO_TORCH (per-run timeouts, s) SBS_EST_MAXLM SBS_EST_MAXTEXT
#        SBS_EST_TORCH (expected run lengths before one has finished, s) SBS_MT_REMAT SBS_MT_XLA_FLAGS
#        SBS_MAXLM_EXTRA SBS_MT_EXTRA (key=value words appended) SBS_PY SBS_SITE SBS_SITE_MT SBS_SCR
set -uo pipefail
T0=$(date +%s)
BENCH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(pwd)
PY=${SBS_PY:-python3}
SITE=${SBS_SITE:-/tmp/site}
SITE_MT=${SBS_SITE_MT:-/tmp/site_mt}
W1=(); W2=()
SCR=${SBS_SCR:-/tmp/sbs}
OUTD=${OUT:-$SCR/out}
BUDGET=${SBS_BUDGET_S:-580}
RESERVE=12                                  # seconds kept for a killed run's grace (-k 5) and the summary
STEPS=${SBS_STEPS:-30}; LOGE=${SBS_LOG_EVERY:-10}
MT_STEPS=${SBS_MT_STEPS:-25}; MT_SKIP=${SBS_MT_SKIP:-5}; TORCH_STEPS=${SBS_TORCH_STEPS:-20}
FULL_STEPS=${SBS_FULL_STEPS:-30}; MT_FULL_STEPS=${SBS_MT_FULL_STEPS:-20}   # the full-size pair (llama8b_full)
MT_REMAT=${SBS_MT_REMAT:-minimal_with_context}
RUNS=${SBS_RUNS:-"maxlm:bf16 maxtext:bf16_te maxlm:fp8_delayed maxtext:fp8ds_te maxlm:fp8_current torch:compiled maxtext:fp8cs_te"}
declare -A TMO=([maxlm]=${SBS_TMO_MAXLM:-170} [maxtext]=${SBS_TMO_MAXTEXT:-190} [torch]=${SBS_TMO_TORCH:-170})
declare -A EST=([maxlm]=${SBS_EST_MAXLM:-70} [maxtext]=${SBS_EST_MAXTEXT:-90} [torch]=${SBS_EST_TORCH:-75})
# the full pair: expected seconds before a run is started (maxlm: planning + compile + 10 steps, so that a run cut
# short still has one steady window; MaxText: ~150 s measured by hand); timeout = the time left
declare -A EST_FULL=([maxlm]=${SBS_EST_MAXLM_FULL:-260} [maxtext]=${SBS_EST_MAXTEXT_FULL:-150})
declare -A SEEN_WALL=() SHOWN=()
mkdir -p "$SCR" "$OUTD"; rm -rf "$SCR"/maxlm_runs "$SCR"/mt_out "$SCR"/mt_cache_* "$SCR"/torch_out   # fresh: no compile cache reuse
MANIFEST=$SCR/runs.tsv; : > "$MANIFEST"
SETUP_LOG=$SCR/setup.log; : > "$SETUP_LOG"
now() { echo $(( $(date +%s) - T0 )); }
CONSOLE=$SCR/stdout.txt; : > "$CONSOLE"   # a copy of the console goes into the JSON (output_tail keeps only its end)
con() { tee -a "$CONSOLE"; }
say() { echo "[$(now)s] $*" | con; }
die() { say "SIDE_BY_SIDE FAILED: $*"; tail -n 30 "$SETUP_LOG" | con; exit 1; }

# ---- locate the pieces ----
if [ -f "$ROOT/maxlm/train.py" ]; then MAXLM_ROOT=$ROOT
elif [ -f "$BENCH/main/maxlm/train.py" ]; then MAXLM_ROOT=$BENCH/main
else die "no maxlm sources: neither ./maxlm nor $BENCH/main/maxlm"; fi
WHL=""; for d in "$ROOT/.whl" "$BENCH/whl"; do ls "$d"/*.whl >/dev/null 2>&1 && { WHL=$d; break; }; done
MTW=""; ls "$BENCH"/maxtext/*.whl >/dev/null 2>&1 && MTW=$BENCH/maxtext
PEER=""; [ -f "$BENCH/torch_peer_full.py" ] && PEER=$BENCH/torch_peer_full.py
[ -n "$WHL" ] || die "no maxlm device wheels (.whl/ or $BENCH/whl/): carry .whl"
[ -n "$MTW" ] || say "WARNING: no MaxText wheels ($BENCH/maxtext/): MaxText runs will fail"
MAXLM_REV=$(cat "$BENCH/maxlm_commit.txt" 2>/dev/null || echo unknown)   # written by prep.sh
say "maxlm tree $MAXLM_ROOT (commit $MAXLM_REV); wheels $WHL; MaxText wheels ${MTW:-none}; peer ${PEER:-none}"
gpu() { nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,temperature.gpu,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader 2>/dev/null \
        || nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; }
GPU0=$(gpu)
say "GPU: $GPU0"

# ---- install: one copy per distribution, only wheels that Python 3.12 can take ----
pick() {  # pick DIR [skip-distribution ...] -> prints chosen wheel paths
  local d=$1; shift; local f b n; declare -A seen=(); for n in "$@"; do seen[$n]=1; done
  for f in "$d"/*.whl; do
    b=$(basename "$f"); n=$(echo "${b%%-*}" | tr 'A-Z-' 'a-z_')
    case $b in *-cp3*-cp3*) case $b in *-cp312-*) ;; *) echo "  skip $b (not cp312)" >> "$SETUP_LOG"; continue ;; esac ;; esac
    [ -n "${seen[$n]:-}" ] && { echo "  skip $b (distribution already chosen)" >> "$SETUP_LOG"; continue; }
    seen[$n]=1; echo "$f"
  done
}
mapfile -t W1 < <(pick "$WHL")
BASE_DISTS=(); for f in "${W1[@]}"; do b=$(basename "$f"); BASE_DISTS+=("$(echo "${b%%-*}" | tr 'A-Z-' 'a-z_')"); done
printf '%s\n' "${BASE_DISTS[@]}" | grep -qx transformer_engine_jax || die "no cp312 transformer_engine_jax wheel in $WHL (../shared/tools/device-wheels.sh copies it from ../shared/wheels)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${W1[@]}" >> "$SETUP_LOG" 2>&1 \
  || die "pip install of ${#W1[@]} maxlm wheels into $SITE failed"
if [ -n "$MTW" ]; then
  mapfile -t W2 < <(pick "$MTW" "${BASE_DISTS[@]}")
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_MT" "${W2[@]}" >> "$SETUP_LOG" 2>&1 \
    || die "pip install of ${#W2[@]} MaxText wheels into $SITE_MT failed"
fi
say "installed ${#W1[@]} wheels into $SITE, ${#W2[@]} into $SITE_MT"
ORIG_LD=${LD_LIBRARY_PATH:-}
CUDNN_DIR=$("$PY" -c "import nvidia.cudnn as m; print(list(m.__path__)[0])" 2>/dev/null)
if [ -n "$CUDNN_DIR" ]; then export CUDNN_PATH=$CUDNN_DIR LD_LIBRARY_PATH=$CUDNN_DIR/lib${ORIG_LD:+:$ORIG_LD}
else say "WARNING: python package nvidia.cudnn not found; CUDNN_PATH left unset"; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset JAX_COMPILATION_CACHE_DIR
INHERITED_XLA=${XLA_FLAGS-}
MT_XLA=${SBS_MT_XLA_FLAGS-"--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer= --xla_gpu_enable_highest_priority_async_stream=true --xla_gpu_all_reduce_combine_threshold_bytes=134217728 --xla_gpu_all_gather_combine_threshold_bytes=134217728 --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 --xla_gpu_pipeline_all_gather=on --xla_gpu_pipeline_reduce_scatter=on --xla_gpu_pipeline_all_reduce=on --xla_gpu_enable_while_loop_double_buffering=true --xla_gpu_enable_all_gather_combine_by_dim=false --xla_gpu_enable_reduce_scatter_combine_by_dim=false --xla_disable_hlo_passes=rematerialization"}
[ -n "${MT_XLA// /}" ] || MT_XLA="--xla_dump_large_constants=false"
say "XLA_FLAGS for maxlm: ${INHERITED_XLA:-<unset>} (inherited); for MaxText: $MT_XLA"
VERSIONS=$(PYTHONPATH=$SITE_MT:$SITE "$PY" - 2>/dev/null <<'EOF'
import importlib.metadata as md, json, sys
names = ["jax", "jaxlib", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint", "transformer_engine",
         "transformer_engine_cu13", "transformer_engine_jax", "nvidia-cudnn-cu13", "grain", "maxtext", "torch",
         "transformers", "triton"]
v = {"python": sys.version.split()[0]}
for n in names:
  try: v[n] = md.version(n)
  except md.PackageNotFoundError: v[n] = None
print(json.dumps(v))
EOF
)
say "versions: ${VERSIONS:-?}"

# ---- helpers ----
show_fail() {  # first traceback (MaxText's TE context manager chains a second error after the real one)
  local f=$1
  if grep -q "Traceback (most recent call last)" "$f"; then
    awk '/Traceback \(most recent call last\)/{p=1} p{print "    | " substr($0, 1, 240); if (++n >= 25) exit}' "$f"
    grep -E '^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Exit)\b' "$f" | head -n 3 | cut -c1-300 | sed 's/^/    ! /'
  fi
  tail -n 5 "$f" | cut -c1-300 | sed 's/^/    $ /'
}
MT_CFG=$SITE_MT/maxtext/configs/base.yml
MT_COMMON=(model_name=llama3-8b override_model_config=true base_num_decoder_layers=4 hardware=gpu
           skip_jax_distributed_system=true dataset_type=synthetic steps=$MT_STEPS per_device_batch_size=4
           max_target_length=4096 packing=false dtype=bfloat16 weight_dtype=float32 remat_policy=$MT_REMAT
           scan_layers=false use_iota_embed=false enable_checkpointing=false enable_tensorboard=false
           log_config=false base_output_directory=$SCR/mt_out)

run_one() {  # run_one FRAMEWORK VARIANT
  local fw=$1 v=$2 name log left est tmo t1 rc wall n
  name=${fw}_$v; log=$OUTD/$name.log
  case $fw in maxlm|maxtext|torch) ;; *) say "=== $name: unknown framework (maxlm, maxtext, torch)"; return ;; esac
  local full=""; case $v in llama8b_full*) full=1 ;; esac
  # the full pair's variants: maxlm llama8b_full[_fp8_delayed|_fp8_current][_head] (precision; _head: fp8_lm_head),
  # MaxText llama8b_full[_fp8ds|_fp8cs] (its te_fp8_delayedscaling / te_fp8_currentscaling quantization)
  local fprec=${v#llama8b_full}; fprec=${fprec#_}; local fhead="" mt_pol=full mt_b=1
  case $v in llama8b_full+*)   # MaxText's other settings: +POLICY[+bN]
    mt_pol=${v#llama8b_full+}; case $mt_pol in *+b*) mt_b=${mt_pol##*+b}; mt_pol=${mt_pol%+b*} ;; esac ;; esac
  case $fprec in *_head) fhead=1; fprec=${fprec%_head} ;; esac
  est=${SEEN_WALL[$fw]:-${EST[$fw]}}; [ -n "$full" ] && est=${EST_FULL[$fw]:-300}
  left=$(( BUDGET - RESERVE - $(now) ))
  if [ "$left" -lt "$est" ]; then
    say "=== $name NOT STARTED: expected ~${est}s, ${left}s left of SBS_BUDGET_S=$BUDGET"
    printf '%s\t%s\t%s\tnot_started\t\t0\t\t\n' "$name" "$fw" "$v" >> "$MANIFEST"; return
  fi
  tmo=${TMO[$fw]}; [ -n "$full" ] && tmo=$left   # a full maxlm run: all the time left
  [ -n "$full" ] && [ "$fw" = maxtext ] && tmo=${SBS_TMO_MAXTEXT_FULL:-240}
  [ "$tmo" -gt "$left" ] && tmo=$left
  local -a cmd
  case $fw in
    maxlm)
      if [ -n "$full" ]; then   # as shipped: only the steps, the logging interval, the output and no checkpoint
        cmd=(env PYTHONPATH="$SITE:$MAXLM_ROOT" "$PY" -m maxlm.train config=llama8b.yml train.steps=$FULL_STEPS
             train.log_every=$LOGE run_name=$v output_dir=$SCR/maxlm_runs checkpoint.enabled=false)
        case $fprec in "") ;; fp8_delayed|fp8_current) cmd+=(model.precision=$fprec) ;;
          *) say "=== $name: unknown maxlm full variant"; return ;; esac
        [ -n "$fhead" ] && cmd+=(model.fp8_lm_head=true)
        # shellcheck disable=SC2206
        cmd+=(${SBS_MAXLM_FULL_EXTRA:-})
      else
      cmd=(env PYTHONPATH="$SITE:$MAXLM_ROOT" "$PY" -m maxlm.train config=llama8b.yml model.n_layers=4 data.seq_len=4096
           data.global_batch_size=4 model.remat=none model.precision=$v run_name=8b4l-$v train.steps=$STEPS
           train.log_every=$LOGE optim.warmup_steps=10 output_dir=$SCR/maxlm_runs checkpoint.enabled=false)
      # shellcheck disable=SC2206
      cmd+=(${SBS_MAXLM_EXTRA:-})
      fi ;;
    maxtext)
      local -a q=()
      case $v in
        bf16_te) ;;
        fp8ds_te) q=(quantization=te_fp8_delayedscaling) ;;
        fp8cs_te) q=(quantization=te_fp8_currentscaling) ;;
        llama8b_full|llama8b_full+*) ;;
        llama8b_full_fp8ds) q=(quantization=te_fp8_delayedscaling) ;;
        llama8b_full_fp8cs) q=(quantization=te_fp8_currentscaling) ;;
        *) say "=== $name: unknown MaxText variant"; return ;;
      esac
      if [ -n "$full" ]; then   # Llama 3 8B, 32 layers: the settings measured by hand at ~8,190 tokens/s
        cmd=(env PYTHONPATH="$SITE_MT:$SITE" DECOUPLE_GCLOUD=TRUE TF_CPP_MIN_LOG_LEVEL=1 XLA_FLAGS="$MT_XLA"
             XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 "$PY" -m maxtext.trainers.pre_train.train "$MT_CFG" run_name=sbs_$v
             model_name=llama3-8b hardware=gpu skip_jax_distributed_system=true dataset_type=synthetic
             steps=$MT_FULL_STEPS per_device_batch_size=$mt_b max_target_length=8192 packing=false dtype=bfloat16
             weight_dtype=float32 mu_dtype=bfloat16 remat_policy=$mt_pol scan_layers=true use_iota_embed=false
             enable_checkpointing=false enable_tensorboard=false log_config=false base_output_directory=$SCR/mt_out
             jax_cache_dir=$SCR/mt_cache_$v attention=cudnn_flash_te "${q[@]}")
        # shellcheck disable=SC2206
        cmd+=(${SBS_MT_FULL_EXTRA:-})
      else
      cmd=(env PYTHONPATH="$SITE_MT:$SITE" DECOUPLE_GCLOUD=TRUE TF_CPP_MIN_LOG_LEVEL=1 XLA_FLAGS="$MT_XLA"
           "$PY" -m maxtext.trainers.pre_train.train "$MT_CFG" run_name=sbs_$v "${MT_COMMON[@]}"
           jax_cache_dir=$SCR/mt_cache_$v attention=cudnn_flash_te "${q[@]}")
      # shellcheck disable=SC2206
      cmd+=(${SBS_MT_EXTRA:-})
      fi ;;
    torch)
      cmd=(env -u PYTHONPATH -u XLA_FLAGS -u CUDNN_PATH)   # the machine's own environment
      if [ -n "$ORIG_LD" ]; then cmd+=(LD_LIBRARY_PATH="$ORIG_LD"); else cmd+=(-u LD_LIBRARY_PATH); fi
      cmd+=(PEER_MODES=$v PEER_STEPS=$TORCH_STEPS OUT=$SCR/torch_out "$PY" "$PEER")
      mkdir -p "$SCR/torch_out" ;;
  esac
  if [ -z "${SHOWN[$fw]:-}" ]; then say "=== $name (timeout ${tmo}s): ${cmd[*]}"; SHOWN[$fw]=1
  else say "=== $name (timeout ${tmo}s; command as above with the variant's keys; full command in its log)"; fi
  echo "# ${cmd[*]}" > "$log"
  t1=$(date +%s)
  local smi=""
  if [ -n "$full" ]; then
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1; sleep 1; done) \
      > "$SCR/smi_$name.txt" &
    smi=$!
  fi
  if [ "$fw" = maxlm ]; then
    (cd "$MAXLM_ROOT" && if [ -n "$INHERITED_XLA" ]; then export XLA_FLAGS=$INHERITED_XLA; else unset XLA_FLAGS; fi
     exec timeout -k 5 "$tmo" "${cmd[@]}") >> "$log" 2>&1
  else
    timeout -k 5 "$tmo" "${cmd[@]}" >> "$log" 2>&1
  fi
  rc=$?; wall=$(( $(date +%s) - t1 ))
  [ -n "$smi" ] && { kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null; }
  case $fw in
    maxlm)   n=$(grep -c "tok/s" "$log"); grep -E "^maxlm: plan:" "$log" | cut -c1-400 | sed 's/^/    /' | con
             grep -E "^step [0-9]+/" "$log" | tail -n 2 | sed 's/^/    /' | con ;;
    maxtext) n=$(grep -c "completed step:" "$log"); grep "completed step:" "$log" | tail -n 1 | sed 's/^.*\] /    /' | cut -c1-200 | con ;;
    torch)   n=$(grep -c '^{"name"' "$log"); grep '^{"name"' "$log" | sed 's/^/    /' | con ;;
  esac
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status=failed; fi
  [ "$fw" = torch ] && grep -q '^{"name".*"error"' "$log" && status=failed
  say "    $name: $status (rc=$rc) after ${wall}s, $n result lines"
  [ "$status" = ok ] || show_fail "$log" | con
  if [ "$status" = ok ] && [ -z "$full" ]; then
    local e=$(( wall * 11 / 10 + 3 )); [ "$e" -gt "${SEEN_WALL[$fw]:-0}" ] && SEEN_WALL[$fw]=$e
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$fw" "$v" "$status" "$rc" "$wall" "$log" "${cmd[*]}" >> "$MANIFEST"
}

for r in $RUNS; do run_one "${r%%:*}" "${r#*:}"; done

# ---- summary ----
GPU1=$(gpu)
[ -n "${VERSIONS:-}" ] || VERSIONS='{}'
SBS_MANIFEST=$MANIFEST SBS_OUTD=$OUTD SBS_SCR=$SCR SBS_LOGE=$LOGE SBS_MT_SKIP=$MT_SKIP SBS_VERSIONS="$VERSIONS" \
SBS_TORCH_STEPS=$TORCH_STEPS SBS_MAXLM_REV="$MAXLM_REV" \
SBS_GPU0="$GPU0" SBS_GPU1="$GPU1" SBS_XLA_MAXLM="${INHERITED_XLA:-<unset>}" SBS_XLA_MT="$MT_XLA" SBS_T0=$T0 \
SBS_BUDGET=$BUDGET SBS_SETUP_LOG=$SETUP_LOG SBS_MT_REMAT=$MT_REMAT SBS_MAXLM_ROOT=$MAXLM_ROOT "$PY" - <<'EOF'
import json, os, re, statistics as st, time
E = os.environ
TOK = 4 * 4096
# the full-size pair: tokens per step (maxlm: llama8b.yml's batch 8 x 8192; MaxText: 1 x 8192 per device)
FULL_TOK = {"maxlm": 8 * 8192, "maxtext": 8192}
H200_PEAK_TFLOPS = 989.0  # dense bf16, the peak maxlm's MFU uses (maxlm/metrics.py); MaxText's MFU is taken on it
GIB_TO_GB = 2**30 / 1e9
rows = []
for line in open(E["SBS_MANIFEST"]):
  name, fw, var, status, rc, wall, log, cmd = (line.rstrip("\n").split("\t") + [""] * 8)[:8]
  r = {"run": name, "framework": fw, "variant": var, "status": status, "rc": int(rc) if rc else None,
       "wall_s": int(wall or 0), "log": os.path.basename(log) if log else None, "cmd": cmd}
  text = open(log, errors="replace").read() if log and os.path.exists(log) else ""
  full = var.startswith("llama8b_full")
  per_step = FULL_TOK.get(fw, TOK) if full else TOK
  mt_b = re.search(r"\+b(\d+)$", var) if fw == "maxtext" else None  # llama8b_full+POLICY+bN
  if full and mt_b:
    per_step *= int(mt_b.group(1))
  r["shape"] = "full" if full else "4 layers"
  if full:
    r["tokens_per_step"] = per_step
    smi = os.path.join(E["SBS_SCR"], f"smi_{name}.txt")
    used = [int(x) for x in open(smi).read().split() if x.isdigit()] if os.path.exists(smi) else []
    r["peak_smi_mib"] = max(used) if used else None  # nvidia-smi memory.used, sampled every second
  if fw == "maxlm":
    prec = (var.removeprefix("llama8b_full").removeprefix("_").removesuffix("_head") or "bf16") if full else var
    run_dir = os.path.join(E["SBS_SCR"], "maxlm_runs", var if full else f"8b4l-{var}")
    mpath = os.path.join(run_dir, "metrics.jsonl")
    ms = []
    if os.path.exists(mpath):
      for l in open(mpath):
        try: ms.append(json.loads(l))
        except ValueError: pass
    steady = [m for m in ms if m.get("step_time") and m["step"] > int(E["SBS_LOGE"])]
    if steady:
      t = st.mean(m["step_time"] for m in steady)
      r.update(steady_steps=int(E["SBS_LOGE"]) * len(steady), step_ms=t * 1e3, tokens_per_s=per_step / t,
               tflops=st.mean(m["tflops_per_device"] for m in steady), loss=steady[-1].get("loss"),
               step_ms_rows=[round(m["step_time"] * 1e3, 2) for m in steady])
    m = re.search(r"maxlm: (.*? params, backend=\S+, precision=\S+\)[^\n]*)", text)
    if m: r["banner"] = m.group(1)[:200]
    if full:
      logged = [m for m in ms if m.get("loss") is not None]
      if steady:
        r["mfu"] = st.mean(m["mfu"] for m in steady if m.get("mfu") is not None) if any(m.get("mfu") for m in steady) else None
      if logged:
        r.update(loss_first_logged={"step": logged[0]["step"], "loss": logged[0]["loss"]},
                 loss_last_logged={"step": logged[-1]["step"], "loss": logged[-1]["loss"]})
      peaks = [m["peak_memory_gb"] for m in ms if m.get("peak_memory_gb")]
      r["peak_memory_gb"] = max(peaks) if peaks else None  # the allocator's peak_bytes_in_use
      est = [m["compiled_memory_gb"] for m in ms if m.get("compiled_memory_gb")]
      r["xla_compiled_estimate_gb"] = est[0] if est else None
      m = re.search(r"^maxlm: (plan: [^\n]*)", text, re.M)
      r["plan_line"] = m.group(1) if m else None
      m = re.search(r"\(peak ([\d.]+) GiB of ([\d.]+) GiB usable", r["plan_line"] or "")
      if m:
        r["plan_predicted_peak_gb"] = round(float(m.group(1)) * GIB_TO_GB, 2)
      m = re.search(r"^maxlm: first step[^\n]*", text, re.M)
      r["first_step_line"] = m.group(0) if m else None
  elif fw == "maxtext":
    prec = {"bf16_te": "bf16", "fp8ds_te": "fp8_delayed", "fp8cs_te": "fp8_current", "llama8b_full": "bf16",
            "llama8b_full_fp8ds": "fp8_delayed", "llama8b_full_fp8cs": "fp8_current"}.get(var.split("+")[0], var)
    pat = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), Tokens/s/device: ([\d.]+).*?loss: ([\d.]+)")
    steps = [(int(a), float(b), float(c), float(d), float(e)) for a, b, c, d, e in pat.findall(text)]
    steady = [s for s in steps if s[0] >= int(E["SBS_MT_SKIP"])]
    if steady:
      t = st.mean(s[1] for s in steady)
      r.update(steady_steps=len(steady), step_ms=t * 1e3, step_ms_median=st.median(s[1] for s in steady) * 1e3,
               tokens_per_s=per_step / t, tflops=st.mean(s[2] for s in steady), loss=steady[-1][4])
    if full:
      if steady:
        r["mfu"] = r["tflops"] / H200_PEAK_TFLOPS  # MaxText's own FLOP count over the H200's dense bf16 peak
      if steps:
        r.update(loss_first_logged={"step": steps[0][0], "loss": steps[0][4]},
                 loss_last_logged={"step": steps[-1][0], "loss": steps[-1][4]})
      m = re.search(r"\[train\] Total estimated memory size: ([\d.]+) GB", text)  # GiB (bytes / 1024**3)
      r["xla_compiled_estimate_gb"] = round(float(m.group(1)) * GIB_TO_GB, 2) if m else None
      r["memstats"] = re.findall(r"Using \(GB\) [^\n]*", text)[:3]
    m = re.search(r"Total TFLOPs: ([\d.]+)", text)
    if m: r["tflops_per_step"] = float(m.group(1))
  else:
    prec = "bf16"
    for l in text.splitlines():
      if l.startswith('{"name"'):
        try: j = json.loads(l)
        except ValueError: continue
        if "step_ms" in j:
          r.update(steady_steps=int(E["SBS_TORCH_STEPS"]), step_ms=j["step_ms"], tokens_per_s=j["tokens_per_sec"],
                   tflops=j.get("tflops_maxtext_count"), loss=j.get("loss"), compile_s=j.get("compile_s"),
                   peak_mem_gb=j.get("peak_mem_gb"))
        else:
          r["error"] = j.get("error")
  r["precision"] = prec
  if "step_ms" in r and r["status"] != "ok":
    r["status"] += "(partial)"
  rows.append(r)

# Earlier results on the same GPU type (2026-12-02 runs): used only where this call has none.
# The full pair's MaxText reference: llama3-8b, 32 layers, batch 1 x 8192, mu bf16, full remat, by hand (2026-12-04).
REF = {("maxtext", "bf16", "4 layers"): 65536.0, ("maxtext", "fp8_delayed", "4 layers"): 80709.4,
       ("maxtext", "fp8_current", "4 layers"): 80313.7, ("torch", "bf16", "4 layers"): 56307.0,
       ("maxtext", "bf16", "full"): 8190.0}
def tok(fw, prec, shape):
  for r in rows:
    if r["framework"] == fw and r["precision"] == prec and r["shape"] == shape and r.get("tokens_per_s"):
      return r["tokens_per_s"], False
  v = REF.get((fw, prec, shape))
  return (v, True) if v else (None, False)
for r in rows:
  if not r.get("tokens_per_s") or r["framework"] == "torch":
    continue
  if r["framework"] == "maxlm":
    b, ref = tok("maxtext", r["precision"], r["shape"])
    if b: r["vs_maxtext_same_precision"] = round(r["tokens_per_s"] / b, 4); r["vs_maxtext_is_earlier_reference"] = ref
  if r["shape"] == "full":
    continue  # no full-size torch peer
  b, ref = tok("torch", "bf16", "4 layers")
  if b: r["vs_torch_compiled"] = round(r["tokens_per_s"] / b, 4); r["vs_torch_is_earlier_reference"] = ref
for r in rows:
  for k in ("step_ms", "step_ms_median", "tokens_per_s", "tflops", "mfu"):
    if isinstance(r.get(k), float): r[k] = round(r[k], 2 if k not in ("tokens_per_s", "mfu") else (1 if k != "mfu" else 4))

setup_tail = open(E["SBS_SETUP_LOG"], errors="replace").read().splitlines()[-40:]
console = open(os.path.join(E["SBS_SCR"], "stdout.txt"), errors="replace").read().splitlines()  # up to the table
summary = {"meta": {"shape": "Llama-3-8B, 4 layers, batch 4 x 4096, vocab 128256, synthetic data, AdamW, fp32 master weights",
                    "tokens_per_step": TOK, "gpu_start": E["SBS_GPU0"], "gpu_end": E["SBS_GPU1"],
                    "versions": json.loads(E["SBS_VERSIONS"] or "{}"),
                    "xla_flags": {"maxlm": E["SBS_XLA_MAXLM"], "maxtext": E["SBS_XLA_MT"], "torch": "<unset>"},
                    "maxtext_remat_policy": E["SBS_MT_REMAT"], "maxlm_remat": "none", "maxlm_tree": E["SBS_MAXLM_ROOT"], "maxlm_commit": E["SBS_MAXLM_REV"],
                    "budget_s": int(E["SBS_BUDGET"]), "elapsed_s": int(time.time()) - int(E["SBS_T0"]),
                    "references_if_missing": {f"{a}/{b}/{c}": v for (a, b, c), v in REF.items()},
                    "full_pair": "maxlm: llama8b.yml as shipped (32 layers, batch 8 x 8192, plan.mode=fit); MaxText: "
                                 "llama3-8b, 32 layers, batch 1 x 8192, mu_dtype=bfloat16, remat_policy=full, "
                                 "scan_layers=true, XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; tokens/s = tokens per step / "
                                 "mean steady step time (maxlm steps after the first logged window, MaxText from step "
                                 + E["SBS_MT_SKIP"] + ")"},
           "runs": rows, "console": console, "setup_log_tail": setup_tail}
json.dump(summary, open(os.path.join(E["SBS_OUTD"], "side_by_side.json"), "w"), indent=1)

def f(x, fmt):
  return format(x, fmt) if isinstance(x, (int, float)) else "-"
print("\n=== side by side (one H200, one call): tokens/s = tokens per step (16384; full pair: maxlm 65536, "
      "MaxText 8192) / mean steady step time")
print("%-20s %-16s %6s %9s %10s %8s %14s %10s %6s" % ("run", "status", "steps", "step ms", "tokens/s", "TFLOP/s",
                                                      "vs MaxText", "vs torch", "wall"))
for r in rows:
  vm = r.get("vs_maxtext_same_precision")
  vm = (f(vm, ".3f") + ("*" if r.get("vs_maxtext_is_earlier_reference") else "")) if vm else "-"
  vt = r.get("vs_torch_compiled")
  vt = (f(vt, ".3f") + ("*" if r.get("vs_torch_is_earlier_reference") else "")) if vt else "-"
  print("%-20s %-16s %6s %9s %10s %8s %14s %10s %5ss" % (r["run"], r["status"], f(r.get("steady_steps"), "d"),
        f(r.get("step_ms"), ".1f"), f(r.get("tokens_per_s"), ",.0f"), f(r.get("tflops"), ".1f"), vm, vt, r["wall_s"]))
print("* = against an earlier run's number (2026-12-02, same GPU type; full pair: MaxText 8,190 tokens/s by hand, "
      "2026-12-04): this call has none")
for r in rows:
  if r["shape"] == "full":
    lf, ll = r.get("loss_first_logged") or {}, r.get("loss_last_logged") or {}
    print(f"{r['run']}: MFU {f(r.get('mfu') and 100 * r['mfu'], '.1f')}%, peak memory "
          f"{f(r.get('peak_memory_gb'), '.1f')} GB (XLA's estimate {f(r.get('xla_compiled_estimate_gb'), '.1f')} GB; "
          f"nvidia-smi {f(r.get('peak_smi_mib'), 'd')} MiB), loss {f(lf.get('loss'), '.4f')} at step {lf.get('step', '-')}"
          f" -> {f(ll.get('loss'), '.4f')} at step {ll.get('step', '-')}")
    if r.get("plan_line"):
      print(f"  {r['plan_line']}")
print("XLA_FLAGS maxlm:", E["SBS_XLA_MAXLM"])
print("XLA_FLAGS MaxText:", E["SBS_XLA_MT"])
print("json:", os.path.join(E["SBS_OUTD"], "side_by_side.json"), "| elapsed", summary["meta"]["elapsed_s"], "s")
EOF
