"""The config sections of the process and its tools (several processes, profiling, XLA flags, the planner,
compilation and its cache) and the model's mixture-of-experts subsection; maxlm/config/__init__.py holds the model and run sections,
the whole `Config`, and re-exports these."""

from __future__ import annotations

import dataclasses

from maxlm.config.schema import option

# The planner's memory levers (maxlm/plan/levers.py): the config keys plan.levers may hand it, in search order.
LEVERS = ("model.remat", "train.grad_accum", "optim.offload", "optim.mu_dtype", "optim.nu_dtype")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Mixture of experts (Mixtral-style, maxlm/layers/moe.py): `experts` SwiGLU experts of width model.ffn_dim in
  place of the MLP of every `every`-th decoder block, each token routed to `top_k` of them."""
  experts: int = option(0, "experts per MoE layer (E); 0 = a dense model", within="[0, 2**31-1]")
  top_k: int = option(2, "experts each token is routed to (k <= experts); their router probabilities, softmax "
                      "over all experts, renormalized to sum to 1 (Mixtral)", within="[1, 2**31-1]")
  every: int = option(1, "blocks N-1, 2N-1, ... (counted from 0) are MoE, the others dense; 1 = every block "
                      "(Mixtral); above 1 needs model.scan_layers=false", within="[1, 2**31-1]")
  aux_loss_coef: float = option(0.01, "weight of the load-balancing loss (Switch: E * sum_e f_e P_e, 1 when "
                                "balanced; the mean over the MoE layers) in the training loss", within="[0, inf)")
  z_loss_coef: float = option(0.0, "weight of the router z-loss (ST-MoE: mean logsumexp(logits)^2; the mean over "
                              "the MoE layers) in the training loss; 0 = off", within="[0, inf)")
  capacity_factor: float = option(0.0, "0 = dropless (every assignment computed); c > 0: each expert takes at "
                                  "most ceil(c * tokens * k / E) assignments, the rest dropped (rate logged)",
                                  within="[0, inf)")
  kernel: str = option("grouped", "the experts' computation: grouped (jax.lax.ragged_dot over the tokens "
                       "sorted by expert) or dense (every expert on every token, masked: E/k times the work, "
                       "a reference)", choices=("grouped", "dense"))


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  """A profiling window (see maxlm/profiling.py): an XProf trace in <run_dir>/profile, NVTX ranges around
  every step and cudaProfilerStart/Stop around the window for `nsys --capture-range=cudaProfilerApi`."""
  start_step: int = option(0, "first step to profile, counted from 1 as in the progress lines (step 1 also "
                           "pays first-run costs; the train step is compiled before it); 0 = no profiling", within="[0, inf)")
  num_steps: int = option(3, "steps in the window; it must end by train.steps", within="[1, inf)")
  xprof: bool = option(True, "write the XProf trace (process 0); set false under nsys (both use CUPTI)")


@dataclasses.dataclass(frozen=True)
class XlaConfig:
  """XLA compiler flags: a preset (maxlm/runtime/xla_presets.py) merged under XLA_FLAGS before the backend starts."""
  preset: str = option("auto", "auto = hopper on H100/H200, blackwell on B200/B300, none on CPU and other GPUs "
                       "(from nvidia-smi); a flag you set in XLA_FLAGS wins over the preset's",
                       choices=("auto", "none", "hopper", "blackwell"))
  mem_fraction: float = option(0.0, "share of each GPU's memory XLA's allocator may use (sets "
                               "XLA_CLIENT_MEM_FRACTION before the backend starts; yours wins); 0 = auto: 0.95 on "
                               "an NVIDIA GPU (XLA's own default 0.75 leaves 35 GiB of an H200 unused), unset "
                               "on CPU", within="[0, 1]")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """The memory planner (maxlm/plan/__init__.py, `maxlm plan`): it compiles the train step ahead of time for
  settings of the memory levers and reads XLA's memory analysis of each (nothing is allocated)."""
  mode: str = option("fit", "fit = on the GPUs at hand, keep the config when its measured peak fits, else plan as "
                     "auto; auto = before building, choose the fastest setting of plan.levers whose measured "
                     "peak fits the device (printed in one line); off = the config as given",
                     choices=("fit", "auto", "off"))
  levers: str = option("auto", "the config keys the planner may set, comma-separated; auto = the levers you did "
                       "not write (on the command line or in your own config file; the shipped configs' values "
                       "count as defaults), so a lever key you set is kept as written; all = every lever ("
                       + ",".join(LEVERS) + "); none = no lever")
  budget_s: float = option(300.0, "seconds the search may spend once a candidate fits: past them it compiles no "
                           "further candidate, and times none once one is timed; the choice is among those "
                           "(the line says so); 0 = no limit", within="[0, 86400]")
  timed: int = option(3, "on the GPUs at hand (one process), time this many of the candidates that fit, the "
                      "fastest by the roofline estimate first, for a few steps each, and take the fastest measured; "
                      "0 = take the first that fits by the estimate (as on simulated devices)", within="[0, 64]")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
  """JAX's persistent compilation cache (maxlm/runtime/compile_cache.py): compiled programs, and on a GPU XLA's
  autotuning results, kept on disk so that a restart, a resume or the next job of a sweep skips compiling."""
  cache: bool = option(True, "keep compiled programs on disk and reuse them (a restart finds its train step "
                       "compiled); false = compile everything every time")
  cache_dir: str = option("", "the cache directory; \"\" = JAX's (JAX_COMPILATION_CACHE_DIR) when set, else "
                          "$XDG_CACHE_HOME/maxlm/xla (~/.cache/maxlm/xla). On a cluster: a shared directory "
                          "(the launch/ templates use <output_dir>/.xla-cache)")
  min_compile_s: float = option(-1.0, "cache only programs that took at least this long to compile; -1 = "
                                "JAX's setting (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, else 1 s)",
                                within="[0, 86400] or -1")
  warm_start: bool = option(True, "with the cache on, also keep the planner's decision and the serialized "
                            "executables of the init and the train step (maxlm/runtime/warm_start.py), so that a restart "
                            "of the same run skips planning, tracing and compiling (one process only)")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Several processes (jax.distributed; see maxlm/runtime/distributed.py and launch/README.md): found from
  the launcher (SLURM srun, OpenMPI 4 mpirun) or set explicitly (any other launcher)."""
  mode: str = option("auto", "auto = initialize when launched by srun or mpirun (or when coordinator_address "
                     "is set); off = one process; slurm / mpi / explicit = insist on that source",
                     choices=("auto", "off", "slurm", "mpi", "explicit"))
  coordinator_address: str = option("", "host:port of process 0's coordinator; \"\" = from the launcher "
                                    "(first node of the SLURM step / the mpirun host)")
  num_processes: int = option(0, "processes in the run; 0 = from the launcher", within="[0, 2**31-1]")
  process_id: int = option(-1, "this process's index; -1 = from the launcher (differs per process)",
                           within="[0, 2**31-1] or -1")
  local_device_ids: str = option("", "GPUs this process drives: \"\" = all when it is the node's only "
                                 "process, else the one numbered by its local rank; all; or e.g. 0,1")
  initialization_timeout_s: int = option(300, "seconds to wait for every process to reach the coordinator "
                                         "and to agree on the config, before stopping with an error",
                                         within="[1, 86400]")
