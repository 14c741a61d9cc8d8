"""Checkpoints of a run: Orbax saves and restores (`manager`), integrity checks (`verify`), starting a
run from checkpoints (`resume`) and SIGTERM/SIGINT handling (`preemption`)."""

from maxlm.checkpoint.manager import (FORMAT, ITEMS, CheckpointError, Checkpointer, Restored, complete_steps,
                                      config_changes)
from maxlm.checkpoint.targets import abstract_like
from maxlm.checkpoint.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preemption
from maxlm.checkpoint.resume import load_params, start

__all__ = ["EXIT_INTERRUPTED", "EXIT_PREEMPTED", "FORMAT", "ITEMS", "CheckpointError", "Checkpointer",
           "Preemption", "Restored", "abstract_like", "complete_steps", "config_changes", "load_params",
           "start"]
