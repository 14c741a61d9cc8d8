#!/usr/bin/env bash
# Full GPU suites back to back (issue 26, item 9: "10 consecutive passes inside full -m gpu runs"). On the H200,
# from the project root, after `source .whl/device-setup.sh`:
#
#   RUNS=1 BUDGET_S=560 bash benchmarks/gpu_suite_repeat.sh
#
# Each run is `MAXLM_TEST_GPU=1 python3 -m pytest -m gpu -q -rfEs --durations=10`, the whole GPU suite in its file
# order, in a fresh process, with the machine's default compilation cache left as the earlier runs left it (as
# the flaky failure was seen). One JSON line per run goes to $OUT/gpu_suite_runs.jsonl: passed, failed, skipped and
# errors (from pytest's JUnit XML), the seconds, the failing test ids, and the 10 slowest tests; the last failing
# run's output tail goes to $OUT/gpu_suite_failure.txt. A run starts only when the previous run's time (else
# EST_S, 450) fits in what is left of BUDGET_S; one stopped by the budget is recorded as "timeout". Keep the lines
# of every call (and session) in benchmarks/results/: consecutive passes can span calls.
# The suite's per-test limit (pyproject.toml: timeout) needs pytest-timeout there; the H200 image lacks it, so put its
# wheel beside maxlm's once: `python3 -m pip download --no-deps -d .whl pytest-timeout` (without it pytest warns of
# an unknown option and no test is ever stopped).
# COMMIT=<rev> labels the lines (default: git's HEAD, which in a device call's copy of the tree can be an older
# commit than the one sent: pass it from the checkout).
# Disk: the GPU tests write checkpoints of tens of GB. Each run gets its own --basetemp under $WORK, removed after
# the run (pyproject.toml keeps only a failed test's tmp_path anyway), and its line records the free disk before
# it (disk_free_gb): on 2026-12-04 a second run on the same machine found its 64 GB disk full of the first's
# pytest-of-root directories and five tests failed on "No space left on device".
# PART=i/n runs only the i-th of n consecutive slices of the suite's test ids, in collection order (the split is
# made from `pytest --collect-only`): a whole run that outlasts one device command (10 minutes) is then made of n
# commands on the same warm machine, part i+1 finding the compilation cache that part i left, and its line says
# "part". A whole run counts only when its n parts ran one after the other on one machine, at one commit, and all
# passed.
set -uo pipefail
OUT=${OUT:-/tmp/maxlm-gpu-suite}
PART=${PART:-}
SELECT=()
if [ -n "$PART" ]; then
  pi=${PART%/*} pn=${PART#*/}
  mapfile -t ALL < <(MAXLM_TEST_GPU=1 python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::')
  [ "${#ALL[@]}" -gt 0 ] && [ "$pi" -ge 1 ] && [ "$pi" -le "$pn" ] || { echo "PART=$PART: no tests, or not i/n with 1 <= i <= n"; exit 2; }
  lo=$(( (pi - 1) * ${#ALL[@]} / pn )) hi=$(( pi * ${#ALL[@]} / pn ))
  SELECT=("${ALL[@]:lo:hi-lo}")
  echo "PART=$PART: tests $((lo + 1))-$hi of ${#ALL[@]}, ${SELECT[0]} .. ${SELECT[-1]}"
fi
WORK=${WORK:-/tmp/maxlm-gpu-suite-work}
RUNS=${RUNS:-1}
BUDGET_S=${BUDGET_S:-560}
est=${EST_S:-450}
mkdir -p "$OUT" "$WORK"
t0=$(date +%s)
for i in $(seq 1 "$RUNS"); do
  left=$(( BUDGET_S - ($(date +%s) - t0) ))
  if [ "$left" -lt "$est" ]; then echo "run $i: not started, ~${est} s expected, ${left} s left"; break; fi
  xml=$WORK/run$i.xml log=$WORK/run$i.log base=$WORK/pytest-tmp
  rm -rf "$base"
  free_gb=$(df -P -k "$WORK" | awk 'NR == 2 {printf "%.1f", $4 / 1048576}')
  start=$(date +%s)
  MAXLM_TEST_GPU=1 timeout -k 10 "$(( left - 5 ))" python3 -m pytest -m gpu -q -rfEs --durations=10 \
    -p no:cacheprovider --basetemp="$base" --junitxml="$xml" "${SELECT[@]}" > "$log" 2>&1
  rc=$? secs=$(( $(date +%s) - start ))
  rm -rf "$base"
  est=$secs
  python3 - "$xml" "$log" "$rc" "$secs" "$i" "$free_gb" >> "$OUT/gpu_suite_runs.jsonl" <<'PY'
import json, os, re, subprocess, sys, time
import xml.etree.ElementTree as ET
xml, log, rc, secs, i, free_gb = sys.argv[1:]
commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                    text=True).stdout.strip()
row = {"run": int(i), **({"part": os.environ["PART"]} if os.environ.get("PART") else {}), "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": commit or None,
       "disk_free_gb": float(free_gb), "exit": int(rc), "seconds": int(secs),
       "status": "timeout" if rc in ("124", "137") else ("passed" if rc == "0" else "failed")}
try:
  suite = ET.parse(xml).getroot()
except (OSError, ET.ParseError) as e:  # no report, or a truncated one (a run killed mid-write)
  row["report_error"] = str(e)
  suite = None
if suite is not None:
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  cases = suite.findall("testcase")
  row.update(tests=len(cases), failures=int(suite.get("failures", 0)), errors=int(suite.get("errors", 0)),
             skipped=int(suite.get("skipped", 0)))
  row["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in cases
                   if c.find("failure") is not None or c.find("error") is not None]
  row["slowest"] = [[f"{c.get('classname')}::{c.get('name')}", round(float(c.get("time", 0)), 1)]
                    for c in sorted(cases, key=lambda c: -float(c.get("time", 0)))[:10]]
text = open(log, errors="replace").read()
m = re.findall(r"^=+ (.*(?:passed|failed|error).*) =+$", text, re.M)
row["summary"] = m[-1] if m else None
print(json.dumps(row))
PY
  tail -n 1 "$OUT/gpu_suite_runs.jsonl" | cut -c1-400
  [ "$rc" -eq 0 ] || tail -n 120 "$log" > "$OUT/gpu_suite_failure.txt"
done
