"""Train a model: `maxlm train [config=FILE] [key=value ...]` (= `python -m maxlm.train`).

Exit codes: 0 done, 1 run-time failure (e.g. non-finite loss with train.nonfinite=stop, or out of device
memory: one line naming the levers, XLA's sizes and the next lever to try), 2 bad
configuration or input (one-line message, nothing written), 3 checkpoint error (none usable, or a
save failed; earlier checkpoints stay intact), 75 preempted by SIGTERM (a checkpoint of the last
step was saved when checkpointing is on; rerun the same command to resume), 76 hung: the watchdog
saw a phase of the run take far longer than its steps do (train.watchdog; one line names the phase and
the file with every thread's stack; rerun to resume from the last checkpoint), 130 interrupted (SIGINT)
before the first step.

`--help` lists every config key with its type, default and meaning; `--help SECTION` one section.
`--dry-run` sizes the run without building it (config, mesh, parameters, FLOPs, memory per device,
data; `--json`, `--devices N`, `--nodes M`, `--device-memory-gb G`; see maxlm/cli/dryrun.py) and exits 0.
`plan.mode=auto` chooses the memory levers by compiling the step ahead of time first (`maxlm plan`,
maxlm/plan/__init__.py) and prints the choice in one line.
`--compile-only` traces and compiles the train step for the configured mesh on the devices at hand, on
abstract shapes (no train state is allocated), prints the trace-and-lower and compile times and XLA's memory
analysis per device, and exits 0. Its one lasting effect is the compiled step in the persistent compilation
cache (`compile.cache_dir`, maxlm/runtime/compile_cache.py): the real run with the same config and devices then
loads it instead of compiling. It creates nothing in the run directory (not even the directory) and reads
no checkpoint; it opens the data inputs to check them, as the run would.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import jax

from maxlm import data as data_lib
from maxlm import plan
from maxlm import trainer as trainer_lib
from maxlm.checkpoint import EXIT_PREEMPTED, Preemption, run_lock
from maxlm.cli import dryrun
from maxlm.cli.grammar import parse_options
from maxlm.config import Config, ConfigError, help_text, load_config
from maxlm.errors import EXIT_BAD_INPUT, MaxlmError, report
from maxlm.metrics import echo
from maxlm.tables import human_bytes
from maxlm.runtime import compile_cache, distributed, peers, startup, watchdog
from maxlm.runtime.devices import is_oom
from maxlm.runtime.startup import Startup
from maxlm.trainer import Trainer

FLAGS = ("--dry-run", "--compile-only")  # and --help [SECTION]; the dry run's own: maxlm/cli/dryrun.py FLAGS


def _fail(msg: str, code: int) -> int:
  print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)
  return code


def _exit_distributed_timeout(msg: str) -> None:
  """`distributed.initialize`'s watchdog: the processes did not all meet in time; end this one now."""
  os._exit(_fail(msg, EXIT_BAD_INPUT))


def run(cfg: Config, t_start: float | None = None, compile_only: bool = False) -> int:
  """Train `cfg` (or with compile_only, only compile its train step), mapping the one-line error types to
  their exit codes."""
  t_start = time.perf_counter() if t_start is None else t_start
  preemption = Preemption()  # first: a signal while the model is built or compiled exits at once
  wd, held, lost = watchdog.OFF, None, peers.Off()
  try:
    try:
      for line in startup.begin(cfg):  # XLA flags, memory share, compilation cache: before the backend starts
        echo(f"maxlm: {line}")
      # Before anything asks JAX about devices. From here on (for the rest of the process: tracebacks
      # too) every output line of a multi-process run carries `[process i/N host]`.
      # the device counts compared after the lock (check_devices): asking JAX for them starts the backend
      launch = distributed.initialize(cfg, on_timeout=_exit_distributed_timeout, devices=False)
      # the start-up is watched from here to the first step (maxlm/runtime/watchdog.py: its phases and limits);
      # the launch's process index, not jax.process_index(): that would start the backend (and take a GPU)
      pi, pc = (launch.process_id, launch.num_processes) if launch else (0, 1)
      wd = watchdog.start(cfg.train, cfg.run_dir, pi, pc, "start-up: run directory")
      if not compile_only:  # the lock first: a duplicate run stops here, before the planner, data or devices
        held = run_lock.take(cfg, pi, wd, watchdog.start_up_limit(cfg.train))
      distributed.check_devices(launch, cfg.distributed.initialization_timeout_s)  # the backend starts here
    except MaxlmError as e:
      return report(e)
    lost = peers.start(launch, wd)  # a lost process ends this one: one line, exit 76 (maxlm/runtime/peers.py)
    wd.arm("start-up: plan", limit=watchdog.start_up_limit(cfg.train))
    return _planned(cfg, t_start, compile_only, preemption, wd, held, lost)
  finally:
    lost.stop()
    if held is not None:
      held.release()  # after a bad start, with the directory it created
    wd.stop()
    preemption.close()


def _planned(cfg: Config, t_start: float, compile_only: bool, preemption: Preemption, wd,
             held: run_lock.Held | None, lost) -> int:
  """plan.mode decided once, before the trainer is built (maxlm/plan/__init__.py `for_run`: process 0 decides for
  every process), then the run (or its compile) with the decided config, in the run directory `held` (None with
  compile_only). A failure is reported once `lost` has settled: a collective or a save that failed because a peer
  is gone ends in the peer's line and exit 76 instead."""
  marks = Startup(t_start)
  jax.devices()  # the backend starts here at the latest
  marks.mark("backend")
  how, trainer = "", None
  try:
    cfg = dataclasses.replace(cfg, data=data_lib.resolve_type(cfg.data))  # data.type=auto made concrete
    cfg, how = plan.for_run(cfg, echo if jax.process_index() == 0 else None, wd)
    marks.mark("plan")  # its compiles: a part of the time to the first step
    wd.arm("start-up: data and state", limit=watchdog.start_up_limit(cfg.train))
    trainer = Trainer(cfg)
    if compile_only:
      return compile_step_only(trainer, t_start)
    return EXIT_PREEMPTED if trainer_lib.run(trainer, preemption, marks, wd, held).preempted else 0
  except MaxlmError as e:  # every error a user can cause (maxlm/errors.py): one line, its exit code
    lost.settle()
    return report(e)
  except Exception as e:
    lost.settle()
    if not is_oom(e):
      raise
    compiled_gb = getattr(getattr(trainer, "jitted_train_step", None), "compiled_memory_gb", None)
    return _fail(plan.oom_message(cfg, how, compiled_gb, e), 1)
  finally:
    if trainer is not None:
      trainer.close()  # its data's prefetch threads: a process that goes on after the run keeps none reading


def compile_step_only(trainer: Trainer, t_start: float) -> int:
  """`--compile-only`: the run's checks and its train step, compiled on abstract shapes (see the module doc)."""
  trainer.build(abstract=True)
  hit = trainer.compile_train_step()
  step = trainer.jitted_train_step
  if jax.process_index() == 0:
    m = plan.size(trainer.cfg, compiled=step.executable).measured  # XLA's bytes of the step it compiled
    parts = ", ".join(f"{k} {human_bytes(m[k])}" for k in ("argument", "output", "temp", "alias"))
    host = f"; in host memory {human_bytes(m['host'])}" if m["host"] else ""
    echo(f"maxlm: --compile-only: {trainer.cfg.model.name} on {jax.device_count()} x "
         f"{jax.devices()[0].device_kind}, mesh {dict(trainer.mesh.shape)}: traced and lowered in "
         f"{step.lower_s:.1f} s, compiled in {step.compile_s:.1f} s; XLA's memory per device "
         f"{human_bytes(m['device'])} ({parts}){host}; {time.perf_counter() - t_start:.1f} s in all")
    echo(f"maxlm: {compile_cache.step_line(hit, step.compile_s, step.loaded, step.background_s)}")
  return 0


def main(argv: list[str] | None = None) -> int:
  t_start = startup.process_start()  # the process's start: the time to the first step counts the imports
  argv = sys.argv[1:] if argv is None else argv
  opts, words = parse_options(argv, FLAGS, optional=("--help",))
  if "help" in opts:  # `--help [SECTION]` anywhere
    return _help(opts["help"])
  if opts.get("dry_run"):  # abstract shapes only: nothing allocated, nothing written
    return dryrun.main(argv)
  logging.basicConfig(level=os.environ.get("MAXLM_LOG", "WARNING"), format="%(name)s: %(message)s")
  try:
    cfg = load_config(words)
  except ConfigError as e:
    return _fail(str(e), EXIT_BAD_INPUT)
  return run(cfg, t_start, opts.get("compile_only", False))  # --compile-only: no train state, no run directory


def _help(section: str | None) -> int:
  """`--help`: this doc and every config key; `--help SECTION`: that section's keys."""
  try:
    keys = help_text(section)
  except ConfigError as e:
    return _fail(str(e), EXIT_BAD_INPUT)
  try:
    if section is None:
      print(__doc__.strip() + "\n\nExample: python -m maxlm.train config=llama8b.yml train.steps=100\n")
    print(keys, flush=True)
  except BrokenPipeError:  # `--help | head`: the reader left; exit quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  return 0


if __name__ == "__main__":
  sys.exit(main())
