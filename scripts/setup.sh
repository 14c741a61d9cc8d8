#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv with everything maxlm needs, Transformer Engine
# included. Idempotent: it does nothing when the venv is already up to date with pyproject.toml.
#
#   bash scripts/setup.sh [VENV]        (default .venv; MAXLM_NO_TE=1 skips Transformer Engine)
#
# Transformer Engine 2.20.2 for JAX ships on PyPI as source only. Its compiled JAX extension is
# taken from ../shared/wheels when that build cache exists, else built from source (~9 min on 2 cores).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/.venv}
STAMP="$V/.maxlm-ready"
want=$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)-${MAXLM_NO_TE:-0}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
PYBIN=${PYTHON:-python3}
[ -x "$V/bin/python" ] || "$PYBIN" -m venv "$V"
PIP="$V/bin/python -m pip"
$PIP install -q --upgrade pip
# JAX pinned to the newest release that supports Python 3.11 (the H200 image brings its own).
$PIP install -q "jax==0.10.2" "jaxlib==0.10.2" "flax==0.12.8"
$PIP install -q -e "$ROOT[dev,viz]"
if [ "${MAXLM_NO_TE:-0}" != 1 ]; then
  TE=2.20.2
  SP=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  $PIP install -q "nvidia-cuda-runtime==13.0.96" "nvidia-cublas==13.1.1.3" "nvidia-cudnn-cu13==9.24.0.43" \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-curand==10.4.0.35" "nvidia-nccl-cu13==2.30.7"
  $PIP install -q --no-deps "nvidia-cudnn-frontend==1.32.0"
  $PIP install -q "transformer-engine-cu13==$TE"
  $PIP install -q --no-deps "transformer-engine==$TE"
  CACHE="$ROOT/../shared/wheels"
  if ! $PIP install -q --no-deps --no-index --find-links "$CACHE" "transformer-engine-jax==$TE" 2>/dev/null; then
    echo "setup: no prebuilt TE JAX extension in $CACHE; building it from source (about 9 minutes)"
    $PIP install -q "pybind11==3.1.0" wheel   # the build runs without isolation: setuptools needs wheel for bdist_wheel
    $PIP install -q --no-deps "jax-cuda13-plugin==0.10.2"   # TE's setup.py asserts a CUDA jax plugin
    WH=$(mktemp -d)
    env NVTE_FRAMEWORK=jax CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
      CPATH="$SP/nvidia/cudnn/include:$SP/nvidia/cu13/include" \
      $PIP wheel -q --no-build-isolation --no-deps --no-binary transformer-engine-jax \
      "transformer-engine-jax==$TE" -w "$WH"
    $PIP install -q --no-deps "$WH"/transformer_engine_jax-*.whl
    $PIP uninstall -q -y jax-cuda13-plugin               # build-only; keeps JAX on the CPU here
  fi
fi
echo "$want" > "$STAMP"
echo "setup: ready in $V"
