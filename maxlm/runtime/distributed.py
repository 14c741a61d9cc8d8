"""Several processes: `jax.distributed` from SLURM (srun), OpenMPI 4 (mpirun) or explicit settings.

`initialize(cfg, on_timeout)` is called once per process, in one place (`maxlm.train.run`, after
`runtime.configure` and before anything asks JAX about devices). It

1. resolves the launch from `cfg.distributed` and the environment (`resolve`, pure): launcher,
   coordinator address, process count and index, devices. A wrong launch stops here with one line
   (an sbatch batch shell without srun, a forced launcher that is absent, missing explicit keys);
2. prefixes every line the process writes to stdout and stderr with `[process i/N host]`;
3. calls `jax.distributed.initialize` with everything resolved (JAX's own detection is switched
   off), under a watchdog: if not every process reached the coordinator within
   `distributed.initialization_timeout_s`, `on_timeout` gets one line naming the address (JAX itself
   would abort the process with a C++ stack trace a little later);
4. compares the processes through the coordinator's key-value store: the resolved config (a hash;
   on a mismatch the keys that differ) and the number of local devices (naming process and host).

One process (mode off, no launcher found, or a launch of one process) initializes nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Mapping

from maxlm.config import Config, ConfigError, DistributedConfig, to_dict
from maxlm.config.rules import local_device_ids
from maxlm.runtime import watchdog
from maxlm.runtime.process_output import prefix_output

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OMPI_URI = "OMPI_MCA_orte_hnp_uri"  # OpenMPI 4 (ORTE) sets it; OpenMPI 5 no longer does
PER_PROCESS_KEYS = ("distributed.process_id", "distributed.local_device_ids")  # may differ per process
JAX_TIMEOUT_MARGIN_S = 15  # JAX's own deadlines come later: the watchdog's line is what the user sees
PORT_BASE, PORT_SPAN = 61440, 4096  # the coordinator port JAX derives from a job id: 61440 + id % 4096


@dataclasses.dataclass(frozen=True)
class Launch:
  """What `jax.distributed.initialize` gets; `local_device_ids` None = every device the process sees."""
  launcher: str  # slurm | mpi | explicit | external (initialized by the caller)
  coordinator_address: str
  num_processes: int
  process_id: int
  local_device_ids: tuple[int, ...] | None
  host: str

  @property
  def prefix(self) -> str:
    return f"[process {self.process_id}/{self.num_processes} {self.host}] "


def host_name() -> str:
  return socket.gethostname().split(".")[0]


# --- resolving the launch (pure: config + environment) ---------------------------------------------

def first_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'node[001-015],gpu2' -> 'node001'."""
  m = re.match(r"([^,\[]*)(?:\[([^\],-]+))?", nodelist.strip())
  return (m[1] + (m[2] or "")) if m else ""


def tasks_on_node(tasks_per_node: str, node: int) -> int | None:
  """Tasks on node `node` from SLURM's compressed list ('2(x3),1' = 2, 2, 2, 1); None if unreadable."""
  counts: list[int] = []
  for part in tasks_per_node.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not m:
      return None
    counts += [int(m[1])] * int(m[2] or 1)
  return counts[node] if 0 <= node < len(counts) else None


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
  """SLURM's tasks on this node (the step's list, else the job's), None if unreadable."""
  per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
  node = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else 0
  return tasks_on_node(per_node, node)


def _mpi_local_size(env: Mapping[str, str]) -> int | None:
  """OpenMPI's ranks on this node, None where it does not say."""
  local_size = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
  return int(local_size) if local_size.isdigit() else None


def processes_on_node(env: Mapping[str, str]) -> int:
  """This run's processes on this node, which share its RAM: SLURM's tasks on this node (under srun), OpenMPI's
  local size (under mpirun), else 1 (one process, or an explicit launch, which does not say)."""
  if _mpi_local_size(env) is not None:
    return max(1, _mpi_local_size(env))
  return (_slurm_tasks_here(env) or 1) if all(v in env for v in SLURM_VARS) else 1


def _int(env: Mapping[str, str], name: str) -> int:
  try:
    return int(env[name])
  except ValueError:
    raise ConfigError(f"distributed: the launcher set {name}={env[name]!r}, not a number") from None


def _batch_shell_error(env: Mapping[str, str]) -> ConfigError | None:
  """The trainer runs in an sbatch/salloc shell of a multi-task job, not inside an srun step."""
  if "SLURM_JOB_ID" not in env or "SLURM_STEP_NODELIST" in env:
    return None
  tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1"
  if not tasks.isdigit() or int(tasks) <= 1:
    return None
  return ConfigError(f"distributed: started in the batch shell of SLURM job {env['SLURM_JOB_ID']} ({tasks} "
                     f"tasks) without srun, so only one process would run: launch the trainer with "
                     f"`srun python -m maxlm.train ...` (launch/slurm/train.sbatch does), or set "
                     f"distributed.mode=off to run one process on purpose")


def _slurm(env: Mapping[str, str]) -> tuple[str, int, int, int, int | None]:
  """(coordinator, process count, process id, local rank, tasks on this node) from an srun task."""
  missing = [v for v in SLURM_VARS if v not in env]
  if missing:
    err = _batch_shell_error({**env, "SLURM_NTASKS": env.get("SLURM_NTASKS", "2")})
    raise err or ConfigError(f"distributed.mode=slurm, but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not set: start the trainer with srun")
  port = env.get("JAX_COORDINATOR_PORT") or str(PORT_BASE + _int(env, "SLURM_JOB_ID") % PORT_SPAN)
  return (f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}", _int(env, "SLURM_NTASKS"),
          _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), _slurm_tasks_here(env))


def _mpi(env: Mapping[str, str], coordinator: str) -> tuple[str, int, int, int, int | None]:
  """The same from an OpenMPI rank; the coordinator host is mpirun's (as JAX derives it)."""
  if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
    raise ConfigError("distributed.mode=mpi, but OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK are not set: "
                      "start the trainer with OpenMPI's mpirun")
  if not coordinator:
    uri = env.get(OMPI_URI, "")
    m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    if not m:
      raise ConfigError(f"distributed: cannot find the coordinator from OpenMPI ({OMPI_URI} is "
                        f"{'not set, as in OpenMPI 5' if not uri else f'unreadable: {uri!r}'}); set "
                        f"distributed.coordinator_address=host:port (a host every rank can reach)")
    host = m[1] or m[2]
    job = int(uri.split(".", 1)[0]) // 4096 if uri.split(".", 1)[0].isdigit() else 0
    port = env.get("JAX_COORDINATOR_PORT") or str(PORT_BASE + job % PORT_SPAN)
    coordinator = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
  return (coordinator, _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK"),
          int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") or 0), _mpi_local_size(env))


def _devices(text: str, launcher: str, local_rank: int, local_size: int | None,
             env: Mapping[str, str]) -> tuple[int, ...] | None:
  """`distributed.local_device_ids` resolved. "" under a launcher: every visible GPU when this is the
  node's only process or when the launcher bound exactly one GPU to the task (`--gpus-per-task=1`);
  else the GPU numbered by the local rank (one process per GPU, JAX's convention)."""
  ids = local_device_ids(text)
  if ids is not None or text.strip() == "all" or launcher == "explicit":
    return ids
  visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
  if local_size == 1 or len(visible) == 1:
    return None
  return (local_rank,)


def resolve(d: DistributedConfig, env: Mapping[str, str], host: str | None = None) -> Launch | None:
  """The launch for `d` in environment `env`; None when this is the only process."""
  if d.mode == "off":
    return None
  launcher = d.mode
  if launcher == "auto":
    if "OMPI_COMM_WORLD_SIZE" in env:
      launcher = "mpi"
    elif all(v in env for v in SLURM_VARS):
      launcher = "slurm"
    elif (err := _batch_shell_error(env)) is not None:
      raise err
    elif d.coordinator_address or d.num_processes > 1:
      launcher = "explicit"
    else:
      return None
  if launcher == "slurm":
    coordinator, count, pid, local_rank, local_size = _slurm(env)
  elif launcher == "mpi":
    coordinator, count, pid, local_rank, local_size = _mpi(env, d.coordinator_address)
  else:
    unset = {"coordinator_address": not d.coordinator_address, "num_processes": d.num_processes == 0,
             "process_id": d.process_id < 0}
    if any(unset.values()):
      raise ConfigError(f"distributed: explicit launch needs "
                        f"{', '.join('distributed.' + k for k, v in unset.items() if v)} (e.g. "
                        f"distributed.coordinator_address=host0:1234 distributed.num_processes=2 "
                        f"distributed.process_id=0 on the first process)")
    coordinator, count, pid, local_rank, local_size = "", 0, -1, 0, None  # all three keys are set
  coordinator = d.coordinator_address or coordinator  # explicit keys override what the launcher says
  count = d.num_processes or count
  pid = d.process_id if d.process_id >= 0 else pid
  if not 0 <= pid < count:
    raise ConfigError(f"distributed: process id {pid} is not below the process count {count} ({launcher})")
  if count == 1:
    return None
  devices = _devices(d.local_device_ids, launcher, local_rank, local_size, env)
  return Launch(launcher, coordinator, count, pid, devices, host or host_name())


# --- initialization --------------------------------------------------------------------------------

def _reachable(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
      return True
  except (OSError, ValueError):
    return False


def _not_joined(launch: Launch, timeout_s: int) -> str:
  """The line for a coordinator that not every process reached within the timeout."""
  addr, n = launch.coordinator_address, launch.num_processes
  limit = f"within {timeout_s} s (distributed.initialization_timeout_s)"
  if launch.process_id == 0:
    return (f"distributed: this process hosts the coordinator {addr}, but not all {n} processes joined "
            f"{limit}; check that every process started and can reach it")
  if _reachable(addr):
    return f"distributed: the coordinator {addr} answers, but not all {n} processes joined {limit}"
  return (f"distributed: cannot reach the coordinator {addr} (process 0) {limit}: is process 0 running, "
          f"and can {launch.host} reach that address?")


class _Watchdog:
  """Calls `on_timeout(message())` unless the block ends within `seconds` (JAX calls that can block)."""

  def __init__(self, seconds: float, message: Callable[[], str], on_timeout: Callable[[str], None]):
    self._done = threading.Event()
    watch = lambda: self._done.wait(seconds) or on_timeout(message())  # noqa: E731
    self._thread = threading.Thread(target=watch, daemon=True, name="maxlm-distributed-watchdog")

  def __enter__(self):
    self._thread.start()

  def __exit__(self, *exc) -> None:
    self._done.set()


def _heartbeat(cfg: Config, num_processes: int) -> dict:
  seconds = watchdog.jax_heartbeat_s(cfg.train, num_processes)
  return {} if seconds is None else {"heartbeat_timeout_seconds": seconds}


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def initialize(cfg: Config, on_timeout: Callable[[str], None],
               env: Mapping[str, str] | None = None, devices: bool = True) -> Launch | None:
  """Start jax.distributed for this process (see the module docstring); None for a one-process run.
  `on_timeout(line)` must end the process (called from a watchdog thread). devices=False leaves out the comparison
  of the local device counts, which asks JAX for them and so starts the backend (on a GPU: takes its memory): the
  train command makes it with `check_devices` once it holds the run's lock (maxlm/checkpoint/run_lock.py), so a
  duplicate run is refused with the GPUs untouched."""
  import jax  # noqa: PLC0415 - resolving the launch and its errors need no JAX
  from jax._src import distributed as jax_distributed  # noqa: PLC0415 - the coordinator's client (key-value store)

  d = cfg.distributed
  if jax_distributed.global_state.client is not None:  # initialized by the caller (a test launcher)
    launch = Launch("external", jax_distributed.global_state.coordinator_address or "",
                    jax.process_count(), jax.process_index(), None, host_name())
    if launch.num_processes == 1:
      return None
    prefix_output(launch.prefix)
  else:
    launch = resolve(d, os.environ if env is None else env)
    if launch is None:
      return None
    prefix_output(launch.prefix)
    with _Watchdog(d.initialization_timeout_s, lambda: _not_joined(launch, d.initialization_timeout_s),
                   on_timeout):
      try:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator_address, num_processes=launch.num_processes,
            process_id=launch.process_id,
            local_device_ids=list(launch.local_device_ids) if launch.local_device_ids is not None else None,
            cluster_detection_method="deactivate",
            initialization_timeout=d.initialization_timeout_s + JAX_TIMEOUT_MARGIN_S,
            # with the hang watchdog on, a stopped peer is the watchdog's to report (exit 76, requeued)
            **_heartbeat(cfg, launch.num_processes))
      except jax.errors.JaxRuntimeError as e:  # e.g. process 0 cannot listen on the coordinator's port
        hint = "; is its port in use?" if launch.process_id == 0 else ""
        raise ConfigError(f"distributed: starting process {launch.process_id}/{launch.num_processes} with "
                          f"coordinator {launch.coordinator_address} failed: {_first_line(e)}{hint}"
                          ) from None
  late = (f"distributed: not all {launch.num_processes} processes reached the start-up check within "
          f"{d.initialization_timeout_s} s (distributed.initialization_timeout_s)")
  with _Watchdog(d.initialization_timeout_s, lambda: late, on_timeout):
    check_processes(cfg, launch, jax_distributed.global_state.client,
                    jax.local_device_count() if devices else None, d.initialization_timeout_s)
  return launch


def check_devices(launch: Launch | None, timeout_s: int) -> None:
  """The processes' local device counts compared (`initialize(devices=False)` left it out): ConfigError, the same
  line on every process, when they differ. Starts JAX's backend. Nothing for one process (launch None)."""
  import jax  # noqa: PLC0415 - lazy as in `initialize`: resolving a launch needs no JAX
  from jax._src import distributed as jax_distributed  # noqa: PLC0415 - the coordinator's client (key-value store)
  if launch is None:
    return
  client = jax_distributed.global_state.client
  me = {"host": launch.host, "local_devices": jax.local_device_count()}
  client.key_value_set(f"maxlm/startup/devices/{launch.process_id}", json.dumps(me))
  try:
    client.wait_at_barrier("maxlm/startup/devices", timeout_s * 1000)
  except jax.errors.JaxRuntimeError:  # DEADLINE_EXCEEDED: a process stopped between the lock and here
    raise ConfigError(f"distributed: not all {launch.num_processes} processes reached the device check within "
                      f"{timeout_s} s (distributed.initialization_timeout_s)") from None
  rows = client.key_value_dir_get("maxlm/startup/devices/")
  message = device_mismatch({int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in rows})
  if message:
    raise ConfigError(message)


# --- do the processes agree? ---------------------------------------------------------------------

def config_text(cfg: Config) -> str:
  """The resolved config as canonical JSON of dotted keys, without the keys that differ per process."""
  flat = {}

  def walk(node, prefix):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, f"{prefix}{k}.")
      elif f"{prefix}{k}" not in PER_PROCESS_KEYS:
        flat[f"{prefix}{k}"] = v
  walk(to_dict(cfg), "")
  return json.dumps(flat, sort_keys=True, separators=(",", ":"))


def _who(i: int, procs: Mapping[int, dict], n: int) -> str:
  return f"process {i}/{n} on {procs[i]['host']}"


def config_mismatch(procs: Mapping[int, dict], fetch_config: Callable[[int], str]) -> str | None:
  """One line naming the processes whose config differs from process 0's and the keys; else None."""
  n = len(procs)
  odd = sorted(i for i, p in procs.items() if p["config"] != procs[0]["config"])
  if not odd:
    return None
  ours, theirs = json.loads(fetch_config(0)), json.loads(fetch_config(odd[0]))
  keys = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
  shown = ", ".join(f"{k}={theirs.get(k)!r} vs {ours.get(k)!r}" for k in keys[:4])
  more = f" and {len(keys) - 4} more keys" if len(keys) > 4 else ""
  others = f" (and {len(odd) - 1} more processes)" if len(odd) > 1 else ""
  return (f"distributed: processes resolved different configs: {_who(odd[0], procs, n)}{others} differs "
          f"from {_who(0, procs, n)} in {shown}{more}; give every process the same config file and key=value "
          f"arguments")


def device_mismatch(procs: Mapping[int, dict]) -> str | None:
  """One line naming the processes that see another number of local devices than most; else None."""
  n = len(procs)
  counts = collections.Counter(p["local_devices"] for p in procs.values())
  if len(counts) == 1:
    return None
  usual = procs[0]["local_devices"]  # the most common count; process 0's among equals
  if counts[usual] < max(counts.values()):
    usual = counts.most_common(1)[0][0]
  odd = sorted(i for i, p in procs.items() if p["local_devices"] != usual)
  shown = "; ".join(f"{_who(i, procs, n)} sees {procs[i]['local_devices']}" for i in odd[:4])
  more = f" (and {len(odd) - 4} more)" if len(odd) > 4 else ""
  return (f"distributed: processes see different numbers of local devices: {shown}{more}, the others "
          f"{usual}; every process must drive as many (check CUDA_VISIBLE_DEVICES, the job's GPUs per "
          f"node and task, and distributed.local_device_ids)")


def check_processes(cfg: Config, launch: Launch, client, local_devices: int | None, timeout_s: int) -> None:
  """Exchange (host, local devices, config hash) through the coordinator; raise ConfigError, with the
  same message on every process, when the processes disagree."""
  text = config_text(cfg)
  me = {"host": launch.host, "config": hashlib.sha256(text.encode()).hexdigest()}
  if local_devices is not None:  # None: compared later (check_devices)
    me["local_devices"] = local_devices
  client.key_value_set(f"maxlm/startup/config/{launch.process_id}", text)
  client.key_value_set(f"maxlm/startup/process/{launch.process_id}", json.dumps(me))
  client.wait_at_barrier("maxlm/startup", (timeout_s + JAX_TIMEOUT_MARGIN_S) * 1000)  # watchdog fires first
  rows = client.key_value_dir_get("maxlm/startup/process/")
  procs = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in rows}
  # every config was set before the barrier: no waiting
  fetch = lambda i: client.blocking_key_value_get(f"maxlm/startup/config/{i}", 1000)  # noqa: E731
  message = config_mismatch(procs, fetch) or (device_mismatch(procs) if local_devices is not None else None)
  if message:
    raise ConfigError(message)
