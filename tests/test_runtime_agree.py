"""maxlm/runtime/agree.py: process 0 decides, every process receives its decision (or its one-line error); and what
start-up decides that way with 4 processes: the plan (kept by process 0's warm start), one run directory, created
by process 0, and one compilation cache, which process 0 alone writes."""

import json
import os
import re
import subprocess
import sys

import processes
import pytest

from maxlm.config import ConfigError
from maxlm.runtime import agree, watchdog


def test_one_process_decides_alone():
  calls = []
  assert agree.decide("x", lambda: calls.append(1) or {"a": 1}, watchdog.OFF, "start-up: x", watchdog.Limit(1.0, "")) == {"a": 1}
  assert calls == [1]
  with pytest.raises(ConfigError, match="no"):
    agree.decide("x", lambda: (_ for _ in ()).throw(ConfigError("no")), watchdog.OFF, "start-up: x", watchdog.Limit(1.0, ""))


def test_an_error_of_process_0_keeps_its_exit_code():
  e = agree.Decided("run directory r already holds another run", 3)
  assert e.exit_code == 3 and str(e) == "run directory r already holds another run"


NOT_WRITTEN = "Not writing persistent cache entry since process_id != 0"  # JAX's warning (JAX_EXPLAIN_CACHE_MISSES)


def _missed(err: str) -> dict[str, str]:
  """Program name -> the cache key a process compiled it under, where it missed (JAX_EXPLAIN_CACHE_MISSES)."""
  return dict(re.findall(r"PERSISTENT COMPILATION CACHE MISS for '(\w+)' with key '([\w-]+)'", err))


@pytest.mark.slow
def test_four_processes_share_one_cache_and_one_run_directory(tmp_path):
  cache = tmp_path / "cache"
  common = ["train.steps=2", "data.global_batch_size=8", "mesh.dcn_fsdp=4", f"compile.cache_dir={cache}",
            "compile.min_compile_s=0"]
  # the GPU paths (docs/testing.md): plan.mode=fit measures, and the warm start keeps process 0's decision
  env = [{"JAX_EXPLAIN_CACHE_MISSES": "1", "MAXLM_TEST_GPU_PATHS": "1", "MAXLM_TEST_DEVICE_BYTES": str(2**30)}] * 4
  first = tmp_path / "first"
  first.mkdir()
  assert processes.finish(processes.start(4, ["run_name=a", *common], first, env), 300) == [0] * 4
  entries = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
  errs = [processes.output(first, i)[1] for i in range(4)]
  # one writer: process 0's train step is in the cache; the others compiled theirs (on CPU JAX's key holds the
  # process's devices, so each process has its own; on GPUs it does not, maxlm/runtime/compile_cache.py) and wrote
  # none of them
  assert f"{_missed(errs[0])['jit_step']}-cache" in entries and NOT_WRITTEN not in errs[0], errs[0][-3000:]
  for e in errs[1:]:
    assert NOT_WRITTEN in e and not {f"{k}-cache" for k in _missed(e).values()} & set(entries), e[-3000:]
  second = tmp_path / "second"
  second.mkdir()
  (second / "runs").symlink_to(first / "runs")  # the same output_dir: a second run beside the first
  assert processes.finish(processes.start(4, ["run_name=b", *common], second, env), 300) == [0] * 4
  outs = [processes.output(second, i) for i in range(4)]
  # process 0 read its train step back; nobody wrote a new entry
  assert "jit_step" not in _missed(outs[0][1]) and "the train step came from the cache (hit" in outs[0][0]
  assert sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache")) == entries
  # the planner's decision, kept by process 0 at the first run (warm start), taken by every process
  assert "maxlm: plan: the config fits as written" in outs[0][0] and "(kept from an earlier start of this shape" in outs[0][0]
  assert not any("maxlm: plan:" in o or "warning" in o for o, _ in outs[1:])
  # one run directory per run, as process 0 made it
  runs = first / "runs"
  assert sorted(p.name for p in runs.iterdir()) == ["a", "b"]
  assert (runs / "b" / "config.yml").is_file() and '"step": 2' in (runs / "b" / "metrics.jsonl").read_text()
  before = (runs / "a" / "metrics.jsonl").read_text()
  # a run directory that holds another run: process 0 refuses, and every process ends with its one line, exit 2
  third = tmp_path / "third"
  third.mkdir()
  (third / "runs").symlink_to(runs)
  codes = processes.finish(processes.start(4, ["run_name=a", *common, "optim.b1=0.8"], third), 300)
  lines = [[ln for ln in processes.output(third, i)[1].splitlines() if ln.strip()] for i in range(4)]
  assert codes == [2] * 4, lines
  for i, ls in enumerate(lines):
    assert len(ls) == 1 and re.fullmatch(
        rf"\[process {i}/4 \S+\] maxlm: error: run directory \S+/a already holds another run .*", ls[0]), ls
  assert (runs / "a" / "metrics.jsonl").read_text() == before  # untouched


# Two processes of jax.distributed on this machine, each deciding something of its own (its own index, as two
# processes whose devices report different memories plan differently): every process must end with process 0's.
CHILD = """
import json, sys
import jax
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), initialization_timeout=60)
from maxlm.config import ConfigError
from maxlm.errors import MaxlmError
from maxlm.runtime import agree, watchdog
limit = watchdog.Limit(60.0, "")
mine = jax.process_index()
got = agree.decide("own", lambda: {"decided_by": mine}, watchdog.OFF, "start-up: test", limit)
try:
  agree.decide("bad", lambda: (_ for _ in ()).throw(ConfigError(f"bad input seen by process {mine}")),
               watchdog.OFF, "start-up: test", limit)
  err = None
except MaxlmError as e:  # process 0: the ConfigError itself; the others: agree.Decided with its message and code
  err = [str(e), e.exit_code]
print(json.dumps({"got": got, "err": err}), flush=True)
"""


def test_every_process_takes_process_0s_decision_not_its_own(tmp_path):
  port = processes.free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": processes.FAST_CPU}
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, f"127.0.0.1:{port}", str(i)], cwd=processes.ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    outs.append(json.loads(out.strip().splitlines()[-1]))
  assert [o["got"] for o in outs] == [{"decided_by": 0}] * 2
  assert [o["err"] for o in outs] == [["bad input seen by process 0", 2]] * 2
