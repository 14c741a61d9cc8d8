"""The `checkpoint=` argument of `maxlm generate` and `maxlm eval`: required, and loaded as `maxlm.Model.load`
does, with a checkpoint error naming the argument once (`maxlm: error: checkpoint=DIR: ...`)."""

from __future__ import annotations

from pathlib import Path

from maxlm.api import Model
from maxlm.checkpoint import CheckpointError
from maxlm.cli.grammar import UsageError


def required(own: dict) -> str:
  """The checkpoint= a command was given, or a UsageError."""
  if not own.get("checkpoint"):
    raise UsageError("checkpoint=<run, checkpoint or Hugging Face directory> is required")
  return own["checkpoint"]


def _named(e: CheckpointError, checkpoint: str) -> CheckpointError:
  """The error, naming the `checkpoint=` argument once."""
  msg, path = str(e).replace("checkpoint.load_params=", "checkpoint="), str(Path(checkpoint))
  if msg.startswith(f"{path}: "):
    msg = msg[len(path) + 2:]
  return CheckpointError(msg if msg.startswith("checkpoint=") else f"checkpoint={checkpoint}: {msg}")


def load_model(checkpoint: str, overrides: list[str]) -> Model:
  """`Model.load(checkpoint, overrides)`; its CheckpointError names `checkpoint=`."""
  try:
    return Model.load(checkpoint, overrides)
  except CheckpointError as e:
    raise _named(e, checkpoint) from None
