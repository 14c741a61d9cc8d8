"""Where things are in a run's checkpoints: the only module that knows the on-disk layout of a step.

  <run_dir>/checkpoints/<step>/{params,state,data,config,meta}/   (maxlm/checkpoint/manager.py writes them)
  <tree>/{params/, model.yml}                                     (`maxlm convert hf-to-maxlm` writes them)

`step_dir(path)` finds the newest complete step from a run directory, a checkpoints directory or a step
directory; `step_config` reads the resolved run config a step (or a converted tree) carries; `step_arrays` the
shapes, dtypes and checksums its `meta` item records; `step_number` the step a directory holds, if any.
"""

from __future__ import annotations

import json
from pathlib import Path

from maxlm.checkpoint.manager import CheckpointError, complete_steps
from maxlm.config import Config, from_dict, load_config


def step_dir(path: Path) -> Path | None:
  """The newest complete step directory at or under `path` (a step, checkpoints or run directory; a converted
  tree counts as a step), or None."""
  path = Path(path)
  if (path / "params").is_dir():
    return path
  for ckpts in (path / "checkpoints", path):
    steps = complete_steps(ckpts)
    if steps:
      return ckpts / str(steps[-1])
  return None


def step_number(directory: Path) -> int | None:
  """The step a checkpoint step directory holds; None for a converted tree (or any other name)."""
  name = Path(directory).name
  return int(name) if name.isdigit() else None


def step_config(directory: Path) -> Config:
  """The resolved run config saved in a checkpoint step (its `config` item), or the model.yml that
  `maxlm convert hf-to-maxlm` writes beside its parameter tree."""
  item = directory / "config" / "metadata"
  if not item.is_file() and (directory / "model.yml").is_file():
    return load_config([f"config={directory / 'model.yml'}"])
  try:
    data = json.loads(item.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{item}: cannot read the run config of this checkpoint ({e})") from None
  return from_dict(data)


def step_arrays(directory: Path) -> dict | None:
  """{path: {shape, dtype, checksum}} of every array of a step, as its `meta` item records them; None when it
  has no `meta` (a converted tree)."""
  meta_file = directory / "meta" / "metadata"
  if not meta_file.is_file():
    return None
  try:
    return json.loads(meta_file.read_text())["arrays"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{meta_file}: unreadable ({e})") from None
