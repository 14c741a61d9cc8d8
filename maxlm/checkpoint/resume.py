"""Starting a run from checkpoints: resume the run's latest usable checkpoint (state and data
position), or initialize parameters from `checkpoint.load_params=<path>` (fine-tuning, converted
weights: a checkpoint step directory, a checkpoints directory, or a bare Orbax parameter tree)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from maxlm.checkpoint.disk import SlowStorage
from maxlm.checkpoint.manager import CheckpointError, Checkpointer, config_changes
from maxlm.checkpoint.targets import abstract_like
from maxlm.checkpoint.paths import step_dir
from maxlm.checkpoint.verify import mismatches, quiet, reason, wrong_checksums
from maxlm.config import to_dict
from maxlm.metrics import echo


def _params_dirs(path: Path) -> tuple[Path, Path | None]:
  """(params item dir, meta item dir or None) of a checkpoint step, checkpoints dir or bare params."""
  step = step_dir(path)
  if step is not None:
    return step / "params", (step / "meta") if (step / "meta").is_dir() else None
  if (path / "_METADATA").is_file():
    return path, None
  hf = ""
  if (path / "config.json").is_file() and any(path.glob("*.safetensors")):  # as maxlm.hf.files.is_hf_dir
    hf = (f"; it is a Hugging Face model: convert it first, `maxlm convert hf-to-maxlm src={path} out=DIR`, then "
          f"train with config=DIR/model.yml checkpoint.load_params=DIR")
  raise CheckpointError(f"checkpoint.load_params={path}: not a checkpoint (expected a step directory "
                        f"with params/, a checkpoints directory, or an Orbax parameter tree){hf}")


def load_params(path: str, target):
  """Parameters restored from `path` onto `target` (ShapeDtypeStructs of the params, with shardings)."""
  root = Path(path).absolute()
  if not root.exists():
    raise CheckpointError(f"checkpoint.load_params={path}: no such file or directory")
  params_dir, meta_dir = _params_dirs(root)
  arrays = None
  if meta_dir is not None:
    try:
      with quiet():
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(meta_dir, args=ocp.args.JsonRestore())
      arrays = meta["arrays"]
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      raise CheckpointError(f"checkpoint.load_params={path}: unreadable {meta_dir}: {reason(e)}") from None
    wrong = mismatches(arrays, target, prefix=".params")
    if wrong:
      raise CheckpointError(f"checkpoint.load_params={path} does not fit this model: {'; '.join(wrong[:3])}"
                            f"{' ...' if len(wrong) > 3 else ''}")
  try:
    with quiet():
      params = ocp.StandardCheckpointer().restore(params_dir, target)
  except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
    raise CheckpointError(f"checkpoint.load_params={path}: cannot restore {params_dir}: "
                          f"{reason(e)}") from None
  if arrays is not None:
    bad = wrong_checksums(arrays, params, prefix=".params")
    if bad:
      raise CheckpointError(f"checkpoint.load_params={path}: {len(bad)} array(s) differ from their saved "
                            f"checksums ({', '.join(bad[:3])}) in {params_dir}")
  return params


@dataclasses.dataclass
class Started:
  """What `start` found: the state to train from (restored, with loaded parameters, or the fresh one given) and
  the run's Checkpointer (None when checkpointing is off; the caller closes it)."""
  state: Any
  checkpointer: Checkpointer | None


def start(state, shardings, data, cfg, slow_storage: SlowStorage | None = None) -> Started:
  """The state a run starts from: its latest usable checkpoint's (state, and `data`'s position set to the
  checkpoint's), else the fresh `state` with `checkpoint.load_params`'s parameters, else `state` itself.
  `shardings`: the state's. Nothing of the caller's is changed but the data iterator's position. `slow_storage`:
  for tests (maxlm/checkpoint/disk.py)."""
  c = cfg.checkpoint
  ckpt = Checkpointer(cfg.run_dir / "checkpoints", c, slow_storage) if c.enabled else None
  try:
    return Started(_start(state, shardings, data, cfg, ckpt), ckpt)
  except BaseException:
    if ckpt is not None:
      ckpt.close()
    raise


def _start(state, shardings, data, cfg, ckpt: Checkpointer | None):
  c = cfg.checkpoint
  target = abstract_like(state, shardings)
  t0 = time.perf_counter()
  restored = ckpt.restore_latest(target, to_dict(cfg)) if ckpt else None
  if restored is not None:
    fresh_scale = state.loss_scale
    state = restored.state
    if restored.state.loss_scale is None and fresh_scale is not None:
      state = state.replace(loss_scale=fresh_scale)
      echo(f"maxlm: checkpoint step {restored.step} holds no fp16 loss scale (written by another precision or "
           f"an older maxlm); starting from model.fp16_initial_scale={cfg.model.fp16_initial_scale:g}")
    try:
      data.set_state(restored.data)
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      raise CheckpointError(f"checkpoint step {restored.step}: the data-iterator state does not fit "
                            f"this data config: {reason(e)}; to go on with other data settings, start a new run "
                            f"from its weights: run_name=... checkpoint.load_params={restored.path}") from None
    changes = config_changes(restored.config or {}, to_dict(cfg))
    echo(f"maxlm: resumed from checkpoint step {restored.step} ({restored.path}, "
         f"{time.perf_counter() - t0:.1f} s)"
         + (f"; config changes: {', '.join(changes)}" if changes else ""))
    if c.load_params:
      echo(f"maxlm: ignoring checkpoint.load_params={c.load_params} (resuming this run)")
  elif c.load_params:
    state = state.replace(params=load_params(c.load_params, target.params))
    echo(f"maxlm: loaded parameters from {c.load_params}")
  return state
