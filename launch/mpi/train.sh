#!/usr/bin/env bash
# maxlm with OpenMPI 4 (mpirun): one process per host, driving all of its GPUs (launch/README.md).
#
#   MAXLM_NP=2 MAXLM_HOSTFILE=hosts.txt launch/mpi/train.sh config=llama8b.yml mesh.dcn_data=2 ...
#
# hosts.txt lists one line per host, `node1 slots=1`. Every argument goes to `python -m maxlm.train`.
# MAXLM_NP: processes (default 1); MAXLM_HOSTFILE: mpirun --hostfile (default: all on this host);
# MAXLM_PYTHON: the Python (default: the active virtualenv's, else the .venv of this repository that
# `make setup` made, else python3 on PATH); MAXLM_MPIRUN_ARGS: more mpirun options (as root:
# --allow-run-as-root). maxlm finds rank, size and the coordinator (mpirun's host) from OpenMPI 4's
# environment; OpenMPI 5 also needs distributed.coordinator_address=<first host>:<free port>.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${MAXLM_PYTHON:-}" ]; then PY=$MAXLM_PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then PY=$VIRTUAL_ENV/bin/python
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
elif python3 -c 'import maxlm' 2>/dev/null; then PY=python3
else
  echo "maxlm-launch: error: no Python with maxlm: no MAXLM_PYTHON, no active virtualenv, no .venv in" \
       "$REPO and python3 cannot import maxlm; run \`make setup\` there or set MAXLM_PYTHON" >&2
  exit 2
fi
# The persistent compilation cache (maxlm/runtime/compile_cache.py) beside the runs, on storage every node shares, so
# that a requeued start and later jobs find their programs compiled: <output_dir>/.xla-cache (output_dir as
# given here, else runs; relative to this directory) unless JAX_COMPILATION_CACHE_DIR is set. compile.cache_dir=DIR
# among the arguments wins over both; compile.cache=false turns the cache off. Process 0 writes, all read.
out_dir=runs
for a in "$@"; do case $a in output_dir=*) out_dir=${a#output_dir=} ;; esac; done
case $out_dir in /*) ;; *) out_dir=$PWD/$out_dir ;; esac
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out_dir/.xla-cache}
args=(-np "${MAXLM_NP:-1}" --bind-to none)
[ -n "${MAXLM_HOSTFILE:-}" ] && args+=(--hostfile "$MAXLM_HOSTFILE" --map-by ppr:1:node)
# Remote ranks get only the variables named with -x: pass the ones maxlm, JAX, XLA and NCCL read.
for v in $(compgen -e); do
  case "$v" in
    PATH|LD_LIBRARY_PATH|PYTHONPATH|VIRTUAL_ENV|CUDA_VISIBLE_DEVICES|XLA_FLAGS|JAX_*|NCCL_*|MAXLM_*|TF_CPP_*)
      args+=(-x "$v") ;;
  esac
done
# shellcheck disable=SC2086  # MAXLM_MPIRUN_ARGS is a list of options
exec mpirun "${args[@]}" ${MAXLM_MPIRUN_ARGS:-} "$PY" -m maxlm.train "$@"
