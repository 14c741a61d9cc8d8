"""Who may use a run directory `<output_dir>/<run_name>`.

A run directory belongs to one run. A run starts in it when it is absent or holds no run yet (no logged
step and no checkpoint: at most what a start that failed before its first step left). A directory that
holds a run is used again only by that run: to resume it (checkpoints on and a checkpoint there; the restore
then checks that the checkpoint fits this model), or, when there is no checkpoint to resume (an attempt
killed before its first save), to start it over with exactly the config it recorded. A command that names
other starting weights (`checkpoint.load_params`) than the run started from is another run. Anything else is
refused in one line before anything is written, so a second run never cuts the metrics of the first or
replaces its config.yml.

The config history: `config.yml` is the config of the latest start. A resume with changed keys first keeps the
previous one as `config.to-step-<N>.yml` (it produced the steps up to N, the checkpoint resumed from) and appends
a line to `config_history.jsonl` ({"step", "time", "changes", "kept"}), so the directory says which settings
produced which steps (`record_config`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from maxlm.checkpoint.manager import CheckpointError, complete_steps, config_changes
from maxlm.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Previous:
  """What an earlier run left in a run directory."""
  rows: int  # metrics.jsonl rows
  last_step: int | None  # the step of the last row
  checkpoints: tuple[int, ...]  # complete checkpoint steps
  config: Any = None  # the resolved config it recorded (config.yml), None when absent or unreadable

  @property
  def holds_run(self) -> bool:
    return bool(self.rows or self.checkpoints)

  def describe(self) -> str:
    parts = [f"{self.rows} logged step(s)" + (f", the last step {self.last_step}" if self.last_step else "")]
    parts.append(f"checkpoint steps {', '.join(map(str, self.checkpoints[-3:]))}" if self.checkpoints
                 else "no checkpoint")
    return "; ".join(parts)


def _metrics_rows(path: Path) -> tuple[int, int | None]:
  try:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
  except OSError:
    return 0, None
  last = None
  for line in reversed(lines):
    try:
      last = int(json.loads(line)["step"])
      break
    except (ValueError, KeyError, TypeError):
      continue
  return len(lines), last


def compile_times(run_dir: Path) -> list[float]:
  """The train step's trace, lower and compile seconds of each earlier start of the run, as the first metrics row
  of each start records them (metrics.jsonl); [] when none is recorded."""
  try:
    lines = (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines()
  except OSError:
    return []
  out = []
  for line in lines:
    if '"compile_s"' not in line:  # only a start's first row has it: the others are not parsed
      continue
    try:
      row = json.loads(line)
      out.append(float(row["lower_s"]) + float(row["compile_s"]))
    except (ValueError, KeyError, TypeError):
      continue
  return out


def _recorded_config(path: Path):
  try:
    return yaml.safe_load(path.read_text())
  except (OSError, yaml.YAMLError, UnicodeDecodeError):
    return None


def previous(run_dir: Path) -> Previous:
  rows, last = _metrics_rows(run_dir / "metrics.jsonl")
  return Previous(rows, last, tuple(complete_steps(run_dir / "checkpoints")), _recorded_config(run_dir / "config.yml"))


def _load_params(config) -> str:
  c = config.get("checkpoint") if isinstance(config, dict) else None
  return str(c.get("load_params") or "") if isinstance(c, dict) else ""


def _check_same_start(run_dir: Path, prev: Previous, config: dict) -> None:
  """A resume keeps the run's own weights, so a command naming other starting weights
  (checkpoint.load_params) is another run: e.g. fine-tunes of two converted models whose runs would share a
  name. Leaving load_params out, or naming the run's own, resumes."""
  new, old = _load_params(config), _load_params(prev.config)
  if prev.config is None or not new or new == old or (old and Path(new).resolve() == Path(old).resolve()):
    return  # nothing recorded to compare with, no starting weights named, or the run's own
  started = f"started from checkpoint.load_params={old}" if old else "started from a fresh initialization"
  raise ConfigError(f"run directory {run_dir} holds a run that {started} ({prev.describe()}), and resuming it "
                    f"would ignore checkpoint.load_params={new}; give this run its own run_name=..., or leave "
                    f"checkpoint.load_params out to resume that run")


def claim(run_dir: Path, config: dict, checkpoint_enabled: bool) -> Previous:
  """What the run directory holds, after checking that this run (resolved `config`, as config.yml records
  it) may use it (ConfigError if not)."""
  prev = previous(run_dir)
  if not prev.holds_run:
    return prev
  if checkpoint_enabled and prev.checkpoints:
    _check_same_start(run_dir, prev, config)
    return prev
  if prev.config == config:  # the same run again, with nothing to resume: it starts over
    return prev
  why = ("it has no checkpoint to resume from" if checkpoint_enabled
         else "this run has checkpoints off (checkpoint.enabled=false), so it cannot resume it")
  why += " (and its config.yml differs from this run's config)"
  raise ConfigError(f"run directory {run_dir} already holds another run ({prev.describe()}) and {why}; "
                    f"give this run its own run_name=..., or remove {run_dir} to start over")


def record_config(run_dir: Path, text: str, step: int) -> Path | None:
  """Write `text` (the resolved config this start trains with, YAML) as `run_dir`/config.yml. When config.yml holds
  another config (a resume at `step` with changed keys), keep that one first as config.to-step-<step>.yml (unless
  that file exists: an attempt since then saved no checkpoint, so the steps it trained were dropped) and append
  the changes to config_history.jsonl. Returns the file kept, or None."""
  path = run_dir / "config.yml"
  old, new = _recorded_config(path), yaml.safe_load(text)
  kept = None
  if isinstance(old, dict) and old != new:
    kept = run_dir / f"config.to-step-{step}.yml"
    if not kept.exists():
      os.replace(path, kept)
    entry = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changes": config_changes(old, new),
             "kept": kept.name}
    with open(run_dir / "config_history.jsonl", "a") as f:
      f.write(json.dumps(entry) + "\n")
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)  # a reader never sees half a config.yml
  return kept


def _check_writable(run_dir: Path) -> None:
  """Stop with one line when the run directory cannot be created or written (read-only output_dir)."""
  probe = run_dir if run_dir.exists() else next(p for p in run_dir.parents if p.exists())
  try:
    probe_file = probe / f".maxlm-write-test-{os.getpid()}"
    probe_file.write_bytes(b"")
    probe_file.unlink()
  except OSError as e:
    raise ConfigError(f"output_dir: cannot write the run directory {run_dir} ({e.strerror or e} in "
                      f"{probe}); set output_dir to a writable place") from None


def create(cfg: Config) -> Path | None:
  """Create this run's directory, after checking that checkpoint.load_params exists and output_dir is writable;
  the topmost directory created here (the run directory, or output_dir or a parent of it when they were absent),
  None when the run directory was there. Process 0's alone in a run of several (maxlm/checkpoint/run_lock.py
  `take`, which then locks it; the trainer then `claim`s it)."""
  run_dir = cfg.run_dir
  if cfg.checkpoint.load_params and not Path(cfg.checkpoint.load_params).exists():
    raise CheckpointError(f"checkpoint.load_params={cfg.checkpoint.load_params}: no such file or directory")
  absent = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
  _check_writable(run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  return absent[-1] if absent else None


def remove_new(run_dir: Path, top: Path) -> None:
  """Remove the run directory and its parents up to `top` (what `create` made), each only while it is empty."""
  for p in (run_dir, *run_dir.parents):
    try:
      p.rmdir()
    except OSError:  # not empty (or already gone): what is above it stays
      if p.exists():
        return
    if p == top:
      return
