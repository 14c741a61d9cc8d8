"""Orbax checkpoints of a run: async saves, auto-resume, verification, parameter-only loads.

`<run_dir>/checkpoints/<step>/` holds five items:
  params/  the parameters (also what `checkpoint.load_params=<path>` reads)
  state/   the rest of the TrainState: step, opt_state, model_state (TE `fp8_metas`), rng, nonfinite_steps,
           and under model.precision=fp16 loss_scale (scale, good_steps, overflow_steps)
  data/    the data-iterator position of every stream (global batch row), JSON; it restores onto any
           process count that divides the batch
  config/  the resolved run configuration, JSON
  meta/    shape, dtype and a sharding-independent checksum of every array, and a sha256 of the
           data and config items, JSON
plus `maxlm_files.json` (the size of every item file). Orbax writes `<step>.orbax-checkpoint-tmp`
and renames it once complete, so a killed save leaves no `<step>` directory (the temporary one is
removed at the next start). Restoring checks file sizes, array checksums and the data/config
digests; a damaged checkpoint is reported in one line, moved to `checkpoints.corrupt/`, and the
previous one is used. A state holding NaN/Inf is never saved. docs/checkpoint_format.md describes
the format for readers without maxlm.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from maxlm.checkpoint.disk import SlowStorage, footprint, short_of_space, state_bytes
from maxlm.checkpoint.targets import cast_like, saved_dtypes
from maxlm.checkpoint.verify import (Corrupt, OrbaxNoise, check_files, describe, fingerprint, json_digest,
                                     mismatches, quiet, reason, write_manifest, wrong_checksums)
from maxlm.config import CheckpointConfig
from maxlm.data import merge_states
from maxlm.tables import human_bytes
from maxlm.errors import CheckpointFailure
from maxlm.metrics import echo

ITEMS = ("params", "state", "data", "config", "meta")
# 3: the `data` item holds one state per stream (global batch row), and `meta` the sha256 of the data and config
# items. Only format 3 is read (the earlier ones were never released).
FORMAT = 3


class CheckpointError(CheckpointFailure, RuntimeError):
  """A checkpoint cannot be saved, restored or loaded; the message is one line."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any  # TrainState
  data: Any  # the data-iterator state to restore (DataIterator.set_state picks this process's rows)
  config: dict
  path: Path


def _split(state) -> tuple[Any, dict]:
  rest = {"step": state.step, "opt_state": state.opt_state, "model_state": state.model_state,
          "rng": state.rng, "nonfinite_steps": state.nonfinite_steps}
  if state.loss_scale is not None:  # fp16 runs only, so other checkpoints are unchanged
    rest["loss_scale"] = state.loss_scale
  return state.params, rest


def _encode(obj):
  """JSON-safe copy of an iterator state (bytes -> base64, numpy scalars -> Python)."""
  if isinstance(obj, bytes):
    return {"__bytes__": base64.b64encode(obj).decode()}
  if isinstance(obj, dict):
    return {str(k): _encode(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_encode(v) for v in obj]
  if isinstance(obj, np.generic):
    return obj.item()
  return obj


def _decode(obj):
  if isinstance(obj, dict):
    if set(obj) == {"__bytes__"}:
      return base64.b64decode(obj["__bytes__"])
    return {k: _decode(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_decode(v) for v in obj]
  return obj


def gather_json(obj) -> list:
  """Every process's JSON-able object, in process order (a collective when there are several)."""
  if jax.process_count() == 1:
    return [obj]
  raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  n = int(np.max(multihost_utils.process_allgather(np.array([raw.size]))))
  buf = np.zeros(n, np.uint8)
  buf[:raw.size] = raw
  rows = multihost_utils.process_allgather(buf)  # [P, n]
  return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def _data_item(states: list) -> dict:
  """The `data` item from every process's data-iterator state (in process order): one state per stream,
  merged."""
  return {"process_count": len(states), **merge_states(states)}


def _data_state(data: dict, step: int):
  """The data-iterator state this process restores from a `data` item (its rows are picked by set_state)."""
  try:
    return {k: data[k] for k in ("streams", "batches", "rows")}
  except (KeyError, TypeError):
    raise Corrupt(f"the data item of step {step} holds no stream positions") from None


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_changes(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: {a!r} -> {b!r}")
  return out


def complete_steps(directory: Path) -> list[int]:
  """Steps with a committed checkpoint directory (temporary `<step>.orbax-checkpoint-tmp` excluded)."""
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _primary() -> bool:
  return jax.process_index() == 0


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


class Checkpointer:
  """One run's checkpoint directory: `save` (async), `poll`/`wait`, `restore_latest`, `close`."""

  def __init__(self, directory: Path, cfg: CheckpointConfig, slow_storage: SlowStorage | None = None):
    self.cfg = cfg
    self.directory = Path(directory).absolute()
    self.latest: int | None = None  # last step saved (or being saved) or restored
    self.last_write_s: float | None = None  # the last finished save's time, its start to its files written
    self._slow_storage = slow_storage  # tests: a storage slow or stuck on purpose (maxlm/checkpoint/disk.py)
    self._bytes = 0  # the state bytes of the save in flight
    self._pending: int | None = None  # step of the save in flight
    self._failed = False
    self._t0 = self._blocked = 0.0
    self._written: dict[int, int] = {}  # step -> bytes, from the finalization callback
    self._noise = OrbaxNoise()
    self._noise.install()
    # Directories are created in save() itself: when that fails (a read-only or full file system)
    # save() raises at once. Created in the background, the failure would leave Orbax's writer
    # threads waiting 300 s for a "directories created" signal that never comes.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep or None, keep_period=cfg.keep_period or None, create=True,
        cleanup_tmp_directories=True, enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._on_finalized,
                                       create_directories_asynchronously=False))
    try:
      self._mngr = ocp.CheckpointManager(str(self.directory), options=options, item_names=ITEMS)
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      raise CheckpointError(f"cannot open checkpoint directory {self.directory}: {reason(e)}") from None

  def due(self, step: int) -> bool:
    return self.cfg.every > 0 and step % self.cfg.every == 0

  # --- saving ---------------------------------------------------------------------------------

  @property
  def in_flight(self) -> bool:
    """A save was started and not yet waited for (it may have finished in the background)."""
    return self._pending is not None

  def _on_finalized(self) -> None:
    """Orbax's save thread, once every item is written (before `<step>` is renamed into place)."""
    step = self._pending
    if step is None:
      return
    if self._slow_storage is not None:
      self._slow_storage(self._bytes)
    self.last_write_s = time.perf_counter() - self._t0
    if not _primary():
      return
    found = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*")) or [self.directory / str(step)]
    try:
      self._written[step] = write_manifest(found[0], ITEMS)
    except OSError as e:  # the checkpoint stays usable, only without file sizes to check
      echo(f"maxlm: warning: could not list the files of checkpoint step {step}: {e}")

  def save(self, step: int, state, data_state, config: dict) -> None:
    """Start saving `state` (TrainState), this process's `data_state` and `config` as `step`.

    Returns once the arrays are copied off the devices; the files are written in the background
    (with `checkpoint.async_save=false`, before returning). Raises CheckpointError when the state
    holds NaN/Inf (nothing is written) or when this or the previous save failed.
    """
    self.wait()
    t0 = self._t0 = time.perf_counter()
    self._bytes = state_bytes(state)
    self._check_space(step)
    sums, finite, paths = fingerprint(state)
    if not finite.all():
      bad = [p for p, ok in zip(paths, finite) if not ok]
      raise CheckpointError(f"refusing to save checkpoint step {step}: non-finite values in {len(bad)} "
                            f"array(s) ({', '.join(bad[:3])}); {self._kept()}")
    data = _data_item(gather_json(_encode(data_state)))
    meta = {"format": FORMAT, "step": step, "time": time.time(), "process_count": jax.process_count(),
            "arrays": describe(state, sums, paths),
            "digests": {"data": json_digest(data), "config": json_digest(config)}}
    params, rest = _split(state)
    args = ocp.args.Composite(params=ocp.args.StandardSave(params), state=ocp.args.StandardSave(rest),
                              data=ocp.args.JsonSave(data), config=ocp.args.JsonSave(config),
                              meta=ocp.args.JsonSave(meta))
    self._pending = step
    try:
      with quiet():
        self._mngr.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      self._pending = None
      raise self._save_error(step, e) from None
    self._blocked = time.perf_counter() - t0
    self.latest = step
    if not self.cfg.async_save:
      self.wait()

  def _check_space(self, step: int) -> None:
    """CheckpointError, before anything is written, when the save does not fit in the free space (sized as the
    latest checkpoint's footprint on disk, before any as the state's arrays: maxlm/checkpoint/disk.py). Every
    process agrees (each may write to a disk of its own)."""
    steps = complete_steps(self.directory)
    size = footprint(self.directory / str(steps[-1])) if steps else self._bytes
    short = [m for m in gather_json(short_of_space(self.directory, size)) if m]
    if short:
      self._failed = True
      raise CheckpointError(f"not enough disk space to save checkpoint step {step} in {self.directory}: {short[0]}; "
                            f"{self._kept()}; free space there (or resume in a copy of the run directory on "
                            f"another disk: output_dir=...)")

  def _kept(self) -> str:
    steps = complete_steps(self.directory)
    if not steps:
      return "there is no earlier checkpoint"
    return f"earlier checkpoints are intact (latest: step {steps[-1]} in {self.directory})"

  def _save_error(self, step: int, e: BaseException) -> CheckpointError:
    self._failed = True
    return CheckpointError(f"saving checkpoint step {step} to {self.directory} failed: {reason(e)}; "
                           f"{self._kept()}")

  def poll(self) -> None:
    """Report a finished background save (raising if it failed) without blocking. With several
    processes this waits for the next save instead, so that all of them raise at the same step."""
    if self._pending is not None and jax.process_count() == 1 and not self._mngr.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Block until the save in flight is complete; raise CheckpointError if it failed."""
    if self._pending is None:
      return
    step = self._pending
    try:
      with quiet():
        self._mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      raise self._save_error(step, e) from None
    finally:
      self._pending = None
    size = self._written.pop(step, None)
    if size is not None:
      echo(f"maxlm: checkpoint step {step} written: {human_bytes(size)} in {time.perf_counter() - self._t0:.1f} s, "
           f"training blocked {self._blocked:.2f} s ({self.directory / str(step)})")

  def close(self) -> None:
    """Wait for the save in flight (raising if it failed) and release the manager."""
    try:
      self.wait()
    finally:
      try:
        with quiet():
          self._mngr.close()
      except Exception as e:  # noqa: BLE001 - a failed save surfaces again here: report it once
        if not self._failed:
          self._failed = True
          raise CheckpointError(f"closing the checkpoints in {self.directory} failed: {reason(e)}; "
                                f"{self._kept()}") from None
      finally:
        self._noise.remove(self._failed)

  # --- restoring ------------------------------------------------------------------------------

  def restore_latest(self, target, config: dict) -> Restored | None:
    """Restore the newest usable checkpoint onto `target` (a TrainState of ShapeDtypeStructs with
    shardings, for any mesh). A damaged checkpoint is reported in one line and moved aside. Returns
    None without checkpoints; raises CheckpointError when none is usable or they do not fit the model.
    """
    self.wait()
    self._mngr.reload()
    bad: list[tuple[int, str]] = []
    for step in sorted(self._mngr.all_steps(), reverse=True):
      try:
        restored = self._restore(step, target, config)
      except Corrupt as e:
        echo(f"maxlm: checkpoint step {step} is unusable ({e}); trying the previous one")
        bad.append((step, str(e)))
        continue
      if bad:
        self._quarantine([s for s, _ in bad])
      self.latest = step
      return restored
    if bad:
      raise CheckpointError(f"no usable checkpoint in {self.directory}: "
                            + "; ".join(f"step {s}: {msg}" for s, msg in bad))
    return None

  def _restore(self, step: int, target, config: dict) -> Restored:
    path = self.directory / str(step)
    problems = check_files(path)
    if problems:
      raise Corrupt(problems)
    try:
      with quiet():
        head = self._mngr.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(), data=ocp.args.JsonRestore()))
      arrays = head["meta"]["arrays"]
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      raise Corrupt(f"meta/config/data: {reason(e)}") from None
    _check_digests(head, path)
    if target.loss_scale is not None and not any(k.startswith(".loss_scale") for k in arrays):
      target = target.replace(loss_scale=None)  # saved without one (not fp16): the caller starts a fresh one
    wrong = mismatches(arrays, target)
    if wrong:
      changes = config_changes(head["config"] or {}, config)
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} does not fit this model/optimizer: "
          f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}"
          + (f" (config changes since: {', '.join(changes[:6])})" if changes else ""))
    as_saved = saved_dtypes(arrays, target)  # read as written: every checksum is checked, then cast
    params, rest = _split(as_saved)
    try:
      with quiet():
        out = self._mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params), state=ocp.args.StandardRestore(rest)))
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types; each becomes one line
      raise Corrupt(reason(e)) from None
    state = as_saved.replace(params=out["params"], **out["state"])
    bad = wrong_checksums(arrays, state)
    if bad:
      raise Corrupt(f"{len(bad)} array(s) differ from their saved checksums ({', '.join(bad[:3])}) "
                    f"in {path}/params or {path}/state")
    return Restored(step, cast_like(state, target), _decode(_data_state(head["data"], step)), head["config"],
                    path)

  def _quarantine(self, steps: list[int]) -> None:
    if _primary():
      dest = self.directory.parent / f"{self.directory.name}.corrupt"
      dest.mkdir(parents=True, exist_ok=True)
      for s in steps:
        to = dest / f"{s}-{int(time.time())}"
        shutil.move(str(self.directory / str(s)), str(to))
        echo(f"maxlm: moved unusable checkpoint step {s} to {to}")
    _sync("maxlm_checkpoint_quarantine")
    self._mngr.reload()


def _check_digests(head: dict, path: Path) -> None:
  """Raise Corrupt when the data or config item differs from the sha256 saved in `meta`."""
  digests = head["meta"].get("digests")
  if digests is None:
    raise Corrupt(f"{path}/meta has no digests of the data and config items")
  for item in ("data", "config"):
    if json_digest(head[item]) != digests.get(item):
      raise Corrupt(f"{path}/{item} differs from its saved sha256 (in {path}/meta)")
