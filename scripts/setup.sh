#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv with everything maxlm needs, Transformer Engine (TE) when
# this machine can have it. Idempotent: it does nothing when the venv is already up to date with
# pyproject.toml, this script and the TE variant below.
#
#   bash scripts/setup.sh [VENV]             (default .venv)
#   bash scripts/setup.sh --te-plan [VENV]   print which TE variant set-up would install, and do nothing
#
# Transformer Engine 2.20.2 for JAX ships on PyPI as source only; its compiled JAX extension comes from
#   1. a prebuilt transformer_engine_jax wheel for this Python and machine in $MAXLM_TE_WHEELS (folders
#      separated by ':'; default ../shared/wheels, then docker/wheels, which the repository carries for
#      CPython 3.11 on x86_64 Linux), else
#   2. a build from source (~9 min on 2 cores), which needs a CUDA toolkit: nvcc and the CUDA headers in
#      $CUDA_HOME (default /usr/local/cuda, else the toolkit of the nvcc on PATH), else
#   3. nowhere: set-up installs maxlm without TE and says so in one line. The Flax backend then runs
#      everything (on a CPU that is all TE would do anyway: there it runs as plain JAX).
# MAXLM_NO_TE=1 skips TE in any case. The variant is recorded in the venv's stamp, so a toolkit or wheel
# that appears later is picked up by the next run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PLAN_ONLY=0
if [ "${1:-}" = --te-plan ]; then PLAN_ONLY=1; shift; fi
V=${1:-$ROOT/.venv}
STAMP="$V/.maxlm-ready"
TE=2.20.2
PYBIN=${PYTHON:-python3}
WHEEL_DIRS=${MAXLM_TE_WHEELS-$ROOT/../shared/wheels:$ROOT/docker/wheels}

cuda_home() {  # the toolkit TE's build would use
  if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return; fi
  if [ -d /usr/local/cuda ]; then echo /usr/local/cuda; return; fi
  local nvcc
  if nvcc=$(command -v nvcc); then dirname "$(dirname "$(readlink -f "$nvcc")")"; fi
}

# One line: `skip`, `wheel <file>`, `build <CUDA_HOME>` or `none <why>`.
te_plan() {
  if [ "${MAXLM_NO_TE:-0}" = 1 ]; then echo "skip MAXLM_NO_TE=1"; return; fi
  local py=$PYBIN tag dir whl cuda
  [ -x "$V/bin/python" ] && py=$V/bin/python
  # CPython tag and machine of the venv's Python, e.g. "cp311 x86_64"
  tag=$("$py" -c 'import sys, sysconfig; print("cp%d%d" % sys.version_info[:2], sysconfig.get_platform().split("-")[-1])')
  set -- $tag
  local IFS=:
  for dir in $WHEEL_DIRS; do
    for whl in "$dir"/transformer_engine_jax-"$TE"-"$1"-"$1"-*linux*_"$2".whl; do
      if [ -f "$whl" ]; then echo "wheel $(cd "$(dirname "$whl")" && pwd)/$(basename "$whl")"; return; fi
    done
  done
  cuda=$(cuda_home)
  if [ -n "$cuda" ] && [ -x "$cuda/bin/nvcc" ] && [ -f "$cuda/include/crt/host_defines.h" ]; then
    echo "build $cuda"
  else
    echo "none no CUDA toolkit (nvcc and include/crt/host_defines.h in CUDA_HOME=${cuda:-unset}) and no" \
         "prebuilt TE JAX wheel for $1 $2 in ${WHEEL_DIRS:-no folder}"
  fi
}

PLAN=$(te_plan)
if [ "$PLAN_ONLY" = 1 ]; then echo "$PLAN"; exit 0; fi
want=$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)-${PLAN%% *}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
[ -x "$V/bin/python" ] || "$PYBIN" -m venv "$V"
PIP="$V/bin/python -m pip"
$PIP install -q --upgrade pip
# JAX pinned to the newest release that supports Python 3.11 (the H200 image brings its own).
$PIP install -q "jax==0.10.2" "jaxlib==0.10.2" "flax==0.12.8"
# setuptools warns at every editable install that folders named like the package may shadow it: not news
PYTHONWARNINGS="ignore:Editable installation" $PIP install -q -e "$ROOT[dev,viz]"

install_te_runtime() {  # what TE's libraries load at import, GPU or not
  $PIP install -q "nvidia-cuda-runtime==13.0.96" "nvidia-cublas==13.1.1.3" "nvidia-cudnn-cu13==9.24.0.43" \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-curand==10.4.0.35" "nvidia-nccl-cu13==2.30.7"
  $PIP install -q --no-deps "nvidia-cudnn-frontend==1.32.0"
  $PIP install -q "transformer-engine-cu13==$TE"
  $PIP install -q --no-deps "transformer-engine==$TE"
}

build_te_jax() {  # $1: CUDA_HOME. The compiler's output goes to a log; a failure is one line.
  local sp wh log=$V/te-build.log
  sp=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "setup: no prebuilt TE JAX extension in ${WHEEL_DIRS:-no folder}; building it from source with the CUDA" \
       "toolkit in $1 (about 9 minutes; log $log)"
  $PIP install -q "pybind11==3.1.0" wheel   # the build runs without isolation: setuptools needs wheel for bdist_wheel
  $PIP install -q --no-deps "jax-cuda13-plugin==0.10.2"   # TE's setup.py asserts a CUDA jax plugin
  wh=$(mktemp -d)
  if ! env NVTE_FRAMEWORK=jax CUDA_HOME="$1" CPATH="$sp/nvidia/cudnn/include:$sp/nvidia/cu13/include" \
      $PIP wheel --no-build-isolation --no-deps --no-binary transformer-engine-jax \
      "transformer-engine-jax==$TE" -w "$wh" >"$log" 2>&1; then
    $PIP uninstall -q -y jax-cuda13-plugin
    echo "setup: error: building TE's JAX extension with the CUDA toolkit in $1 failed (the compiler's output is" \
         "in $log); rerun with MAXLM_NO_TE=1 to set up without TE, or put a prebuilt" \
         "transformer_engine_jax-$TE wheel in a folder of MAXLM_TE_WHEELS" >&2
    exit 1
  fi
  $PIP install -q --no-deps "$wh"/transformer_engine_jax-*.whl
  $PIP uninstall -q -y jax-cuda13-plugin               # build-only; keeps JAX on the CPU here
}

# XLA:GPU's compiler for `maxlm plan --devices N` on a machine without N GPUs (maxlm/plan/target.py): JAX's CUDA
# plugin of the installed jaxlib, ~400 MB, in a folder of the venv rather than in it (importable, its CUDA checks
# would print a traceback at every JAX start on a machine without a GPU). Skipped where the venv's JAX has a CUDA
# plugin already (a GPU machine) or MAXLM_NO_GPU_COMPILER=1; without it the planner simulates on XLA:CPU.
install_gpu_compiler() {
  local dir=$V/maxlm-gpu-compiler jv
  jv=$("$V/bin/python" -c 'import importlib.metadata as m; print(m.version("jaxlib"))')
  if [ "${MAXLM_NO_GPU_COMPILER:-0}" = 1 ] || "$V/bin/python" -c 'import jax_plugins.xla_cuda13' 2>/dev/null \
      || "$V/bin/python" -c 'import jax_plugins.xla_cuda12' 2>/dev/null; then return; fi
  if [ -d "$dir/jax_cuda13_pjrt-$jv.dist-info" ] && [ -d "$dir/jax_cuda13_plugin-$jv.dist-info" ]; then return; fi
  rm -rf "$dir"
  if ! $PIP install -q --no-deps --target "$dir" "jax-cuda13-plugin==$jv" "jax-cuda13-pjrt==$jv"; then
    rm -rf "$dir"
    echo "setup: could not install JAX's CUDA plugin $jv in $dir: maxlm plan --devices N simulates on XLA:CPU"
  fi
}
install_gpu_compiler

case "$PLAN" in
  wheel\ *)
    install_te_runtime
    $PIP install -q --no-deps --no-index "${PLAN#wheel }" ;;
  build\ *)
    install_te_runtime
    build_te_jax "${PLAN#build }" ;;
  none\ *)
    if $PIP show -q transformer-engine-jax 2>/dev/null; then
      echo "setup: ${PLAN#none }: kept the Transformer Engine already installed in $V"
    else
      echo "setup: ${PLAN#none }: installed without Transformer Engine (the Flax backend runs everything on" \
           "CPU); to get TE, install a CUDA toolkit (set CUDA_HOME if it is not in /usr/local/cuda) and rerun," \
           "or put a prebuilt transformer_engine_jax-$TE wheel in a folder of MAXLM_TE_WHEELS"
    fi ;;
esac
echo "$want" > "$STAMP"
case "$PLAN" in
  wheel\ *) te="Transformer Engine $TE from ${PLAN#wheel }" ;;
  build\ *) te="Transformer Engine $TE built from source" ;;
  *) te="no Transformer Engine${MAXLM_NO_TE:+ (MAXLM_NO_TE=$MAXLM_NO_TE)}" ;;
esac
echo "setup: ready in $V ($te)"
