"""One decision for every process of a run: process 0 decides, every other process receives its decision.

In a run of several processes, anything that decides the program (the planner's levers), or that only one
process may do (create the run directory), is done by process 0 alone; the others wait for its answer and
apply it, so that every process runs the same program even where their own views differ. `decide(name, make)`
runs `make()` on process 0 and hands its value (anything `json` can carry) to every process, through the key-value
store of JAX's coordination service (`maxlm/decided/<name>`): no device collective, and a wait that can be
watched. An error that `make()` raises as a `MaxlmError` (a config that fits nowhere, a run directory that holds
another run) reaches every process as the same one line and exit code, so no process is left waiting for an
answer that will not come.

Waiting is watched: process 0 calls `progress(name)` at each step of a long decision (the planner: before each
compile); a waiting process re-arms its start-up watchdog phase (maxlm/runtime/watchdog.py) at each step it sees,
so that a process 0 that stopped (SIGSTOP, a frozen node) ends the waiting processes with the watchdog's one line
and exit 76, within the phase's limit of process 0's last sign of life.

`barrier(name)` makes every process wait for all the others, watched the same way (the first step: processes that
compiled from scratch and one that loaded from the cache start its collectives together).

One process (no jax.distributed) decides alone; nothing is exchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax

from maxlm.errors import MaxlmError

PREFIX = "maxlm/decided/"
POLL_MS = 500  # a waiting process looks for process 0's answer and progress this often


def _client():
  """The coordination service's client, or None when this process is alone."""
  from jax._src import distributed as jax_distributed  # noqa: PLC0415 - private: the key-value store's client
  client = jax_distributed.global_state.client
  return client if client is not None and jax.process_count() > 1 else None


class Decided(MaxlmError):
  """Process 0's one-line error, raised on every other process with process 0's exit code."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


def progress(name: str) -> None:
  """Process 0: one more step of decision `name` has begun (what waiting processes watch)."""
  client = _client()
  if client is not None and jax.process_index() == 0:
    client.key_value_increment(f"{PREFIX}{name}/progress", 1)


def _try_get(client, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except jax.errors.JaxRuntimeError:  # NOT_FOUND: not there yet
    return None


def _wait(client, name: str, watch, phase: str, limit) -> str:
  """Process 0's answer to `name`; the watchdog phase is re-armed whenever process 0 shows progress (a stopped
  process 0 stops answering even these calls: its coordination service stops with it, and the phase runs out)."""
  key, seen = f"{PREFIX}{name}", None
  watch.arm(f"{phase} (waiting for process 0)", limit=limit)
  while True:
    steps = _try_get(client, f"{key}/progress")
    if steps is not None and steps != seen:
      seen = steps
      watch.arm(f"{phase} (waiting for process 0, which has begun step {steps})", limit=limit)
    try:
      return client.blocking_key_value_get(key, POLL_MS)
    except jax.errors.JaxRuntimeError:  # DEADLINE_EXCEEDED: not yet
      continue


def decide(name: str, make: Callable[[], Any], watch, phase: str, limit) -> Any:
  """`make()` on process 0, its value on every process (see the module doc). `watch` (a watchdog, or its off
  twin) is armed with `phase` and `limit` (a `watchdog.Limit`: seconds and their derivation) while this process
  decides or waits."""
  client = _client()
  watch.arm(phase, limit=limit)
  if client is None:
    return make()
  key = f"{PREFIX}{name}"
  if jax.process_index() == 0:
    try:
      value = make()
    except MaxlmError as e:
      client.key_value_set(key, json.dumps({"error": str(e), "exit_code": e.exit_code}))
      raise
    client.key_value_set(key, json.dumps({"value": value}))
    return value
  got = json.loads(_wait(client, name, watch, phase, limit))
  if "error" in got:
    raise Decided(got["error"], got["exit_code"])
  return got["value"]


def barrier(name: str, watch, phase: str, limit) -> None:
  """Every process waits here for all the others (nothing when alone), under `watch`'s `phase`: the watchdog ends
  the wait at `limit` (a `watchdog.Limit`) with its line; the barrier's own timeout comes later (a minute more)."""
  client = _client()
  if client is None:
    return
  watch.arm(phase, limit=limit)
  client.wait_at_barrier(f"{PREFIX}{name}", int((limit.seconds + 60) * 1000))
