#!/bin/bash
# Prepare the side-by-side benchmark (README.md beside this script) in the project checkout. This is the
# project's copy of ../shared/bench/prep.sh (it takes side_by_side.sh and torch_peer_full.py from beside itself,
# the MaxText wheels from ../shared/bench/maxtext/, which stay out of git):
#   .whl/    maxlm's device wheels (TE, Grain, ...): made by ../shared/tools/device-wheels.sh when the
#            cp312 transformer_engine_jax wheel is missing (needs pip access to the package index)
#   .bench/  side_by_side.sh, torch_peer_full.py, maxtext/*.whl (MaxText 0.2.5 bundle), maxlm_commit.txt;
#            rebuilt on every call, git-ignored through .git/info/exclude
# and check that what the device call sends (working tree + .whl + .bench) stays under 64 MiB.
#
#   bash benchmarks/side_by_side/prep.sh          from the project root; again after each commit (the label)
#   MAXTEXT_WHEELS=DIR bash benchmarks/side_by_side/prep.sh    MaxText wheels from DIR
#                                                  (../shared/bench/build_maxtext_wheels.sh DIR)
#   then on the GPU machine: run(command="bash .bench/side_by_side.sh", carry=[".whl", ".bench"], timeout_s=600)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LIMIT=$((64 * 1024 * 1024))
fail() { echo "prep.sh: $*" >&2; exit 1; }

ROOT=$(git rev-parse --show-toplevel 2>/dev/null) || fail "not inside a git checkout: run it from the project root"
cd "$ROOT"
[ -f maxlm/cli/train.py ] || fail "$ROOT has no maxlm/cli/train.py: run it from the project root"
MTW=${MAXTEXT_WHEELS:-$ROOT/../shared/bench/maxtext}
ls "$MTW"/*.whl >/dev/null 2>&1 || fail "no MaxText wheels in $MTW (bash ../shared/bench/build_maxtext_wheels.sh DIR, then MAXTEXT_WHEELS=DIR)"
for f in side_by_side.sh torch_peer_full.py; do [ -f "$HERE/$f" ] || fail "$HERE/$f is missing"; done

# ---- .whl/: maxlm's device wheels ----
if ! ls .whl/transformer_engine_jax-*-cp312-*.whl >/dev/null 2>&1; then
  echo "no cp312 transformer_engine_jax wheel in .whl/: running ../shared/tools/device-wheels.sh"
  [ -f "$ROOT/../shared/tools/device-wheels.sh" ] || fail "$ROOT/../shared/tools/device-wheels.sh not found"
  bash "$ROOT/../shared/tools/device-wheels.sh"
  ls .whl/transformer_engine_jax-*-cp312-*.whl >/dev/null 2>&1 || fail "device-wheels.sh left no cp312 transformer_engine_jax wheel in .whl/"
fi
for f in .whl/*-cp3*-cp3*.whl; do   # the device has Python 3.12; side_by_side.sh skips other builds
  [ -e "$f" ] || continue
  case $(basename "$f") in *-cp312-*) ;; *) echo "note: $f is not for Python 3.12: skipped on the device, but it is sent (delete it to save space)" ;; esac
done

# ---- .bench/: the benchmark, rebuilt from scratch ----
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.bench/' "$EXCLUDE" 2>/dev/null || echo '/.bench/' >> "$EXCLUDE"
rm -rf .bench
mkdir -p .bench/maxtext
cp "$HERE/side_by_side.sh" "$HERE/torch_peer_full.py" .bench/
cp "$MTW"/*.whl .bench/maxtext/
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo '+uncommitted')" > .bench/maxlm_commit.txt
git check-ignore -q .bench/side_by_side.sh || fail ".bench/ is not git-ignored ($EXCLUDE)"
git check-ignore -q .whl/ || fail ".whl/ is not git-ignored (device-wheels.sh adds '/.whl/' to $EXCLUDE)"

# ---- what the device call sends: tracked + untracked-not-ignored files, plus the carried folders ----
tree=$( { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{s+=$1} END {print s+0}')
whl=$(du -sb .whl | cut -f1)
bench=$(du -sb .bench | cut -f1)
total=$((tree + whl + bench))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "maxlm commit $(cat .bench/maxlm_commit.txt); $(find .whl -maxdepth 1 -type f -name '*.whl' | wc -l) wheels in .whl/, $(find .bench/maxtext -type f -name '*.whl' | wc -l) in .bench/maxtext/"
echo "what the device call sends (limit 64 MiB = $LIMIT bytes):"
printf '  %-48s %10d bytes (%s)\n' "working tree (tracked + untracked, not ignored)" "$tree" "$(mib "$tree")" \
  ".whl/" "$whl" "$(mib "$whl")" ".bench/" "$bench" "$(mib "$bench")" "total" "$total" "$(mib "$total")"
[ "$total" -lt "$LIMIT" ] || fail "total $total bytes is over the 64 MiB limit: the device call would be refused"
echo "ok. Device call: run(command=\"bash .bench/side_by_side.sh\", carry=[\".whl\", \".bench\"], timeout_s=600)"
