#!/usr/bin/env bash
# Mutation testing of the core with mutmut 3.8.1 (configuration: [tool.mutmut] in pyproject.toml; results,
# equivalent mutants and how to read the report: docs/mutation.md). Slow, hence not part of `make test`.
#
#   bash scripts/mutation.sh                   every mutant, from a fresh mutants/ (what `make mutation` runs)
#   bash scripts/mutation.sh 'maxlm.optim*'    only these mutant names, reusing mutants/ and its test map
#
# Prints the score per module and every surviving mutant with its diff (scripts/mutation_report.py);
# mutmut's own output goes to mutants/mutmut.log. MUTATION_CHILDREN (default 2) mutants run at a time.
# MUTATION_SKIP_CLEAN=1 skips mutmut's clean run before a partial run; MUTATION_RESTAT='tests/test_step.py'
# maps those files' tests to functions again (needed after a mutated module gained functions: mutmut
# re-maps only tests it has not seen, and the new functions' mutants would have "no tests").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
CHILDREN=${MUTATION_CHILDREN:-2}

if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("mutmut") != "3.8.1")' 2>/dev/null; then
  echo "mutation: installing mutmut==3.8.1 into $VENV" >&2
  "$PY" -m pip install -q "mutmut==3.8.1"
fi

if [ $# -eq 0 ]; then
  rm -rf mutants  # a full run starts from the current sources (mutmut keeps stale copies otherwise)
elif [ -d mutants/maxlm ]; then
  # A run of some mutants reuses mutants/ (its mutants, results and test map). mutmut regenerates a
  # mutated module whose source changed, but never refreshes the plain copies of the other modules:
  # copy those that changed since, so the tests run against today's code.
  "$PY" - <<'EOF'
import filecmp, shutil
from pathlib import Path
from mutmut.configuration import config
from mutmut.utils.file_utils import walk_all_files
for root, name in walk_all_files():
  src = Path(root) / name
  dst = Path("mutants") / src
  if not config().should_mutate(src) and (not dst.exists() or not filecmp.cmp(src, dst, shallow=False)):
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
EOF
fi
mkdir -p mutants
# Each mutant runs its tests in a fresh process (forked from mutmut's fork server, which has imported the
# libraries of scripts/mutation_preload.txt but started no JAX backend); XLA's persistent cache lets a
# mutant whose compiled programs did not change reuse them instead of recompiling. Cache keys are the
# programs themselves, so a mutant that changes a program always gets its own compilation.
export JAX_COMPILATION_CACHE_DIR="$PWD/mutants/.jax_cache"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

echo "mutation: mutmut run --max-children $CHILDREN $* (scripts/mutation_run.py; log: mutants/mutmut.log)" >&2
start=$(date +%s)
rc=0
"$PY" scripts/mutation_run.py --max-children "$CHILDREN" "$@" >mutants/mutmut.log 2>&1 || rc=$?
elapsed=$(( $(date +%s) - start ))
if [ "$rc" -ne 0 ]; then
  tail -n 40 mutants/mutmut.log | tr '\r' '\n' | tail -n 40 >&2
  echo "mutation: mutmut exited with $rc after ${elapsed} s (mutants/mutmut.log)" >&2
  exit "$rc"
fi
"$PY" scripts/mutation_report.py --elapsed "$elapsed"
