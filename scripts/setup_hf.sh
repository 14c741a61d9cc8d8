#!/usr/bin/env bash
# Add CPU PyTorch and transformers to the project's virtualenv, for the live comparison with transformers
# (tests/test_hf.py, marker `hf`; `make test-hf`). Not part of `make setup`: maxlm itself never imports
# torch, and the main suite runs without it (tests/test_metrics.py checks that the metrics writer stays
# torch-free). Idempotent: it does nothing when both are already installed at these versions.
#
#   bash scripts/setup_hf.sh [VENV]   (default .venv; made first by scripts/setup.sh)
#
# The versions are those tests/golden/hf/versions.json records (the goldens were made with them). torch is
# the CPU build ("+cpu", about 190 MB): the default one on PyPI is the CUDA build, which pulls several GB
# of NVIDIA libraries. It comes from the indexes pip is configured with when one of them has it, else from
# PyTorch's CPU index.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/.venv}
CPU_INDEX=https://download.pytorch.org/whl/cpu
PY=$V/bin/python
[ -x "$PY" ] || { echo "setup-hf: error: no virtualenv in $V; run scripts/setup.sh first" >&2; exit 1; }
read -r TORCH TRANSFORMERS < <("$PY" -c 'import json, sys; v = json.load(open(sys.argv[1]))
print(v["torch"], v["transformers"])' "$ROOT/tests/golden/hf/versions.json")
have=$("$PY" -c 'import importlib.metadata as m
def v(d):
  try: return m.version(d)
  except m.PackageNotFoundError: return "-"
print(v("torch"), v("transformers"))')
if [ "$have" = "$TORCH $TRANSFORMERS" ]; then exit 0; fi
PIP="$PY -m pip"
# `pip index versions` lists what the configured indexes and find-links hold, local versions included
if $PIP index versions torch 2>/dev/null | grep "^Available versions:" | tr -s ', ' '\n\n' | grep -qxF "$TORCH"; then
  src="the configured package indexes"
  $PIP install -q "torch==$TORCH"
else
  src=$CPU_INDEX
  if ! $PIP install -q "torch==$TORCH" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple; then
    echo "setup-hf: error: torch $TORCH (the CPU build) is neither in pip's configured indexes nor reachable" \
         "at $CPU_INDEX" >&2
    exit 1
  fi
fi
$PIP install -q "transformers==$TRANSFORMERS"
echo "setup-hf: torch $TORCH (from $src) and transformers $TRANSFORMERS in $V"
