"""maxlm.runtime.distributed: the launch found from SLURM / OpenMPI / explicit settings (environments written
here, as srun and mpirun set them), the `[process i/N host]` line prefix, the cross-process checks, and
every fail-fast case of a multi-process start at the CLI (explicit mode on localhost: no launcher needed;
the SLURM batch-shell case under a real SLURM is in tests/test_launch.py)."""

import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from maxlm.config import ConfigError, DistributedConfig, load_config
from maxlm.runtime import distributed
from maxlm.runtime.devices import mesh_placement
from maxlm.runtime.distributed import Launch, resolve
from maxlm.runtime.process_output import PrefixedStream, prefix_output, restore_output

# subprocess runs compile like the suite's own (conftest): XLA's CPU backend at optimization level 0
FAST_CPU = "--xla_backend_optimization_level=0"

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=4",
        "model.vocab_size=128", "model.backend=flax", "train.steps=2", "train.eval_every=0"]

# An srun task: what SLURM 22.05 sets in task 1 of `srun -N 2 --ntasks-per-node=2` (job 1234).
SRUN = {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_NTASKS": "4",
        "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
# An OpenMPI 4 rank: rank 3 of `mpirun -np 4` over two hosts (ORTE job id 0x6f540000 = 1867776000).
MPIRUN = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
          "OMPI_MCA_orte_hnp_uri": "1867776000.0;tcp://10.1.2.3,172.17.0.1:44521"}


def dist(**kw) -> DistributedConfig:
  return DistributedConfig(**kw)


# --- resolving the launch ------------------------------------------------------------------------

def test_one_process_initializes_nothing():
  assert resolve(dist(), {}) is None  # auto, no launcher
  assert resolve(dist(mode="off"), SRUN) is None  # off wins over a launcher
  assert resolve(dist(), {**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # srun -n 1
  assert resolve(dist(), {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"}) is None  # sbatch -n 1, python directly


def test_slurm_task():
  got = resolve(dist(), SRUN, host="gpu007")
  # coordinator: the step's first node; port 61440 + job id mod 4096 (JAX's choice, so that plain
  # jax.distributed.initialize() and maxlm agree): 61440 + 1234
  assert got == Launch("slurm", "gpu007:62674", 4, 1, (1,), "gpu007")
  assert got.prefix == "[process 1/4 gpu007] "
  fixed_port = resolve(dist(mode="slurm"), {**SRUN, "JAX_COORDINATOR_PORT": "3000"})
  assert fixed_port.coordinator_address == "gpu007:3000"


@pytest.mark.parametrize("nodelist,first", [
    ("node001", "node001"), ("node001,host2", "node001"), ("node[001-015],host2", "node001"),
    ("node[001,007-015],host2", "node001"), ("a-b[3,5]", "a-b3"), ("h1.cluster", "h1.cluster")])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
  assert distributed.first_host(nodelist) == first


def test_tasks_per_node_list():
  assert [distributed.tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]
  assert distributed.tasks_on_node("8", 0) == 8 and distributed.tasks_on_node("x", 0) is None


def test_processes_on_this_node():
  """What shares this node's RAM: SLURM's tasks on this node (SRUN: node 0 of "2(x2)"), OpenMPI's local size
  (before SLURM's, as the launch itself), else 1: no launcher, or SLURM variables of a batch shell (no srun)."""
  assert distributed.processes_on_node(SRUN) == 2
  assert distributed.processes_on_node({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "8,4", "SLURM_NODEID": "1"}) == 4
  assert distributed.processes_on_node({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "garbled"}) == 1
  assert distributed.processes_on_node({**SRUN, **MPIRUN, "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
  assert distributed.processes_on_node(MPIRUN) == 2
  assert distributed.processes_on_node({}) == 1
  assert distributed.processes_on_node({"SLURM_JOB_ID": "5", "SLURM_TASKS_PER_NODE": "8"}) == 1


@pytest.mark.parametrize("env,setting,want", [
    ({**SRUN}, "", (1,)),  # one process per GPU: the GPU numbered by the local rank (JAX's convention)
    ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_LOCALID": "0"}, "", None),  # one per node: all
    ({**SRUN, "CUDA_VISIBLE_DEVICES": "5"}, "", None),  # --gpus-per-task=1: the one GPU SLURM bound
    ({**SRUN, "CUDA_VISIBLE_DEVICES": "0,1"}, "", (1,)),
    ({**SRUN}, "all", None),
    ({**SRUN}, "2,3", (2, 3)),
    ({**MPIRUN}, "", (1,)),
    ({**MPIRUN, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "", None),
])
def test_local_devices(env, setting, want):
  assert resolve(dist(local_device_ids=setting), env).local_device_ids == want


def test_explicit_devices_default_to_all():
  got = resolve(dist(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1), {})
  assert got == Launch("explicit", "10.0.0.1:1234", 2, 1, None, distributed.host_name())


def test_openmpi_rank():
  got = resolve(dist(), MPIRUN, host="h")
  # mpirun's first address; port 61440 + (ORTE job id / 4096) mod 4096 = 61440 + 456000 mod 4096
  assert got == Launch("mpi", f"10.1.2.3:{61440 + 1867776000 // 4096 % 4096}", 4, 3, (1,), "h")
  v6 = {**MPIRUN, "OMPI_MCA_orte_hnp_uri": "4096.0;tcp6://[fe80::1,2620:10d::3]:43370"}
  assert resolve(dist(), v6).coordinator_address == "[fe80::1]:61441"


def test_mpi_takes_precedence_over_the_slurm_variables_it_inherits():
  # mpirun inside an sbatch job: its ranks also carry SLURM variables (of the job or of orted's step)
  assert resolve(dist(), {**SRUN, **MPIRUN}).launcher == "mpi"


def test_explicit_keys_override_the_launcher():
  got = resolve(dist(coordinator_address="head:999", num_processes=4, process_id=2), SRUN)
  assert (got.launcher, got.coordinator_address, got.process_id) == ("slurm", "head:999", 2)


def test_openmpi5_needs_the_coordinator_address():
  env = {k: v for k, v in MPIRUN.items() if k != "OMPI_MCA_orte_hnp_uri"}
  with pytest.raises(ConfigError, match="OpenMPI 5.*distributed.coordinator_address=host:port"):
    resolve(dist(), env)
  assert resolve(dist(coordinator_address="h0:5000"), env).coordinator_address == "h0:5000"


def test_batch_shell_without_srun_is_refused():
  shell = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "vm"}  # no SLURM_STEP_NODELIST
  for mode in ("auto", "slurm"):
    with pytest.raises(ConfigError, match=r"batch shell of SLURM job 77 \(2 tasks\) without srun.*`srun py"):
      resolve(dist(mode=mode), shell)
  assert resolve(dist(mode="off"), shell) is None


@pytest.mark.parametrize("d,env,message", [
    (dist(mode="slurm"), {}, "SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID "
                             "are not set: start the trainer with srun"),
    (dist(mode="mpi"), {}, "start the trainer with OpenMPI's mpirun"),
    (dist(mode="explicit"), {}, "needs distributed.coordinator_address, distributed.num_processes, "
                                "distributed.process_id"),
    (dist(coordinator_address="h:1", num_processes=2), {}, "needs distributed.process_id"),
    (dist(mode="slurm"), {**SRUN, "SLURM_PROCID": "x"}, "SLURM_PROCID='x'"),
    (dist(process_id=7), SRUN, "process id 7 is not below the process count 4"),
])
def test_bad_launches(d, env, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    resolve(d, env)


@pytest.mark.parametrize("arg,message", [
    ("distributed.coordinator_address=nohost", "must be host:port"),
    ("distributed.coordinator_address=h:0", "must be host:port"),
    ("distributed.coordinator_address=h:65536", "must be host:port"),
    ("distributed.local_device_ids=0,x", "distributed.local_device_ids"),
    ("distributed.local_device_ids=1,1", "distributed.local_device_ids"),
    ("distributed.mode=kubernetes", "distributed.mode"),
    ("distributed.initialization_timeout_s=0", "distributed.initialization_timeout_s"),
])
def test_bad_distributed_keys(arg, message):
  with pytest.raises(ConfigError, match=message):
    load_config([arg])


def test_process_id_must_be_below_num_processes():
  with pytest.raises(ConfigError, match=r"process_id' \(2\) must be below distributed.num_processes \(2\)"):
    load_config(["distributed.num_processes=2", "distributed.process_id=2"])


# --- output prefix ---------------------------------------------------------------------------------

def test_every_line_gets_the_prefix_also_when_written_in_pieces():
  out = io.StringIO()
  s = PrefixedStream(out, "[process 1/2 h] ")
  s.write("maxlm: a\nmaxlm: b")
  s.write(" continued\n")
  s.write("\n")
  print("Traceback (most recent call last):\n  File x", file=s)
  assert out.getvalue() == ("[process 1/2 h] maxlm: a\n[process 1/2 h] maxlm: b continued\n[process 1/2 h] \n"
                            "[process 1/2 h] Traceback (most recent call last):\n[process 1/2 h]   File x\n")


def test_each_line_reaches_the_stream_in_one_write_with_its_newline():
  """Two processes share mpirun's pipe: a line written as text, then newline (as print() does), must not
  leave the text alone in the pipe for the other process's line to follow on the same line."""
  class Writes(io.StringIO):
    def __init__(self):
      super().__init__()
      self.calls = []

    def write(self, text):
      self.calls.append(text)
      return super().write(text)
  out = Writes()
  s = PrefixedStream(out, "[p 0/2] ")
  print("nccl pass", file=s, flush=True)
  s.write("a\nb")
  assert out.calls == ["[p 0/2] nccl pass\n", "[p 0/2] a\n"]
  s.flush()  # a partial line goes out at a flush, and its rest gets no second prefix
  s.write(" rest\n")
  assert out.calls[2:] == ["[p 0/2] b", " rest\n"]


def test_prefix_output_covers_print_and_logging(capsys):
  logger = logging.getLogger("maxlm-test-prefix")
  root = logging.getLogger()
  handler = logging.StreamHandler(sys.stderr)
  root.addHandler(handler)
  try:
    prefix_output("[process 3/4 h] ")
    print("hello")
    logger.warning("careful")
    print("maxlm: error: x", file=sys.stderr)
  finally:
    restore_output()
    root.removeHandler(handler)
  captured = capsys.readouterr()
  assert captured.out == "[process 3/4 h] hello\n"
  assert captured.err == "[process 3/4 h] careful\n[process 3/4 h] maxlm: error: x\n"
  print("after")
  assert capsys.readouterr().out == "after\n"


# --- do the processes agree? -----------------------------------------------------------------------

def test_config_text_leaves_out_per_process_keys():
  a = load_config(["distributed.process_id=0", "distributed.num_processes=2", "train.steps=3"])
  b = load_config(["distributed.process_id=1", "distributed.num_processes=2", "train.steps=3",
                   "distributed.local_device_ids=1"])
  assert distributed.config_text(a) == distributed.config_text(b)
  flat = json.loads(distributed.config_text(a))
  assert flat["train.steps"] == 3 and "distributed.process_id" not in flat


def test_config_mismatch_names_process_host_and_keys():
  configs = {0: {"train.steps": 20, "data.seed": 0}, 1: {"train.steps": 20, "data.seed": 0},
             2: {"train.steps": 30, "data.seed": 1}}
  procs = {i: {"host": f"n{i}", "local_devices": 8, "config": str(sorted(c.items()))}
           for i, c in configs.items()}
  msg = distributed.config_mismatch(procs, lambda i: json.dumps(configs[i]))
  assert msg == ("distributed: processes resolved different configs: process 2/3 on n2 differs from "
                 "process 0/3 on n0 in data.seed=1 vs 0, train.steps=30 vs 20; give every process the same "
                 "config file and key=value arguments")
  assert distributed.config_mismatch({i: procs[i] for i in (0, 1)}, None) is None


def test_device_mismatch_names_the_odd_process_and_host():
  procs = {i: {"host": f"n{i // 2}", "local_devices": 8, "config": "c"} for i in range(4)}
  assert distributed.device_mismatch(procs) is None
  procs[3]["local_devices"] = 7
  msg = distributed.device_mismatch(procs)
  assert msg.startswith("distributed: processes see different numbers of local devices: process 3/4 on n1 "
                        "sees 7, the others 8; every process must drive as many")


def _mesh(process_of_device):
  """A stand-in for a jax Mesh over (data, fsdp, tensor) whose devices belong to the given processes."""
  procs = np.array(process_of_device)
  devices = np.empty(procs.shape, dtype=object)
  for idx, p in np.ndenumerate(procs):
    devices[idx] = SimpleNamespace(process_index=int(p))
  return SimpleNamespace(devices=devices, axis_names=("data", "fsdp", "tensor"))


def test_mesh_placement_says_which_axes_cross_processes():
  # 2 processes x 2 devices, data across processes (mesh.dcn_data=2, fsdp=2)
  assert mesh_placement(_mesh([[[0], [0]], [[1], [1]]])) == (
      "mesh over 2 processes (processes along each axis: data 2, fsdp 1, tensor 1); process of each device "
      "by mesh position: [[[0], [0]], [[1], [1]]]")
  # 4 processes, fsdp across pairs of them, tensor inside one
  text = mesh_placement(_mesh([[[0, 0], [1, 1], [2, 2], [3, 3]]]))
  assert text.startswith("mesh over 4 processes (processes along each axis: data 1, fsdp 4, tensor 1)")
  # 128 devices: the per-device list is left out
  text = mesh_placement(_mesh(np.repeat(np.arange(16), 8).reshape(2, 64, 1)))
  assert text == "mesh over 16 processes (processes along each axis: data 2, fsdp 8, tensor 1)"


# --- fail fast at the CLI (explicit settings on localhost) -----------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(args, tmp_path, devices=1, **env):
  e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # JAX warns about proxies at start
  e.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_CPU}", **env})
  return subprocess.Popen([sys.executable, "-m", "maxlm.train", f"output_dir={tmp_path}", *TINY, *args],
                          cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs, limit_s):
  """(return code, stderr) of each process; all must end within limit_s."""
  out = []
  for p in procs:
    try:
      _, err = p.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail(f"a process did not stop within {limit_s} s")
    out.append((p.returncode, err))
  return out


def _one_error_line(err: str, prefix: str) -> str:
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(f"{prefix}maxlm: error: distributed: "), err[-3000:]
  return lines[0]


def _pair(tmp_path, extra=(({}, 1), ({}, 1)), timeout_s=20):
  port = _free_port()
  procs = []
  for i, (args, devices) in enumerate(extra):
    common = [f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
              f"distributed.process_id={i}", f"distributed.initialization_timeout_s={timeout_s}",
              "mesh.dcn_fsdp=2"]
    procs.append(_start([*common, *[f"{k}={v}" for k, v in args.items()]], tmp_path, devices))
  return procs


def test_unreachable_coordinator_stops_within_the_timeout(tmp_path):
  port = _free_port()  # nothing listens there
  t0 = time.monotonic()
  p = _start([f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
              "distributed.process_id=1", "distributed.initialization_timeout_s=2"], tmp_path)
  [(code, err)] = _finish([p], 60)
  took = time.monotonic() - t0
  line = _one_error_line(err, f"[process 1/2 {distributed.host_name()}] ")
  assert code == 2 and f"cannot reach the coordinator 127.0.0.1:{port} (process 0) within 2 s" in line
  # the timeout counts from the call to jax.distributed.initialize, after the imports (~3-6 s here)
  assert took < 2 + 20, took
  assert list(tmp_path.iterdir()) == []


def test_process_0_alone_stops_within_the_timeout(tmp_path):
  port = _free_port()
  t0 = time.monotonic()
  p = _start([f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
              "distributed.process_id=0", "distributed.initialization_timeout_s=2"], tmp_path)
  [(code, err)] = _finish([p], 60)
  line = _one_error_line(err, f"[process 0/2 {distributed.host_name()}] ")
  assert code == 2 and (f"this process hosts the coordinator 127.0.0.1:{port}, but not all 2 processes joined "
                        "within 2 s") in line
  assert time.monotonic() - t0 < 2 + 20


def test_processes_with_different_configs_stop_naming_the_keys(tmp_path):
  procs = _pair(tmp_path, (({"train.steps": 3}, 1), ({"train.steps": 4, "optim.b1": 0.8}, 1)))
  host = distributed.host_name()
  for i, (code, err) in enumerate(_finish(procs, 90)):
    line = _one_error_line(err, f"[process {i}/2 {host}] ")
    assert code == 2 and line.endswith(
        f"processes resolved different configs: process 1/2 on {host} differs from process 0/2 on {host} in "
        "optim.b1=0.8 vs 0.9, train.steps=4 vs 3; give every process the same config file and key=value "
        "arguments")
  assert list(tmp_path.iterdir()) == []


def test_processes_with_different_device_counts_stop_naming_the_process(tmp_path):
  procs = _pair(tmp_path, (({}, 2), ({}, 1)))
  host = distributed.host_name()
  for i, (code, err) in enumerate(_finish(procs, 90)):
    line = _one_error_line(err, f"[process {i}/2 {host}] ")
    # a tie (2 vs 1) is measured against process 0
    assert code == 2 and f"local devices: process 1/2 on {host} sees 1, the others 2;" in line, line
  assert list(tmp_path.iterdir()) == []
