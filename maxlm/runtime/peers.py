"""Lost peers: in a run of several processes, a process that is gone (a dead node, an OOM-killed or SIGKILLed
rank, a frozen host) ends every other process with one line and exit 76, which the launch templates requeue.

Without this, the survivors of a lost process do not end usefully: a collective on the lost process fails at once
when its sockets were closed (Gloo: "Connection reset by peer", a traceback), or blocks when the host vanished;
then Python's exit path calls `jax.distributed.shutdown()`, which waits JAX's shutdown timeout (300 s) for the
lost process and aborts with a C++ stack (exit -6, seen on CPU: issue 58). Neither is an exit code a launcher
requeues on, and the checkpoint before the loss would have been a fine place to resume from.

Every process writes a heartbeat into the key-value store of JAX's coordination service (the service runs inside
process 0) every HEARTBEAT_S (5 s), `maxlm/peers/<i>`: a counter, its host and where its loop is (the hang
watchdog's phase and step), and reads everyone's. A peer whose counter has not advanced for LOST_S is lost:

  LOST_S = 2 x HEARTBEAT_S + 2 x EXCHANGE_S = 30 s

A live peer's counter, as this process sees it, advances at least once per its own write interval plus this
process's read interval (2 x 5 s) plus the time of one key-value exchange on each side, each allowed EXCHANGE_S
(10 s: they take milliseconds, and a coordinator on a loaded host may answer slowly). The silence counts from the
exchange that read the lost process's last heartbeat, which it wrote before it died and which is read within one
heartbeat (and an exchange) of being written: the loss is reported 25 to 36 s after the death (LOST_S - HEARTBEAT_S
to HEARTBEAT_S + LOST_S + POLL_S, the judge checking once a second; 31 s measured on CPU). That is well under what
else would end the survivors (JAX's shutdown wait of 300 s; its heartbeat timeout, a day while the hang watchdog is
on: maxlm/runtime/watchdog.py HEARTBEAT_S), and under srun's `--wait` in launch/slurm (MAXLM_TASK_WAIT_S, 60 s),
after which srun kills the tasks that remain and the job's exit code would no longer say 76.

The line, from a thread ("maxlm-peers-judge") that checks once a second:

  maxlm: error: process 1/2 (host h) was lost: no heartbeat for 30.2 s (limit 30 s: ...); its last was at step 31
  (step dispatch); exiting with code 76 for the launcher to requeue the job, which resumes from the last checkpoint

and the process ends with os._exit(76): no traceback, no exit handlers (no shutdown wait); an asynchronous save in
flight is left uncommitted (Orbax writes `<step>.orbax-checkpoint-tmp`, renamed only once complete and removed at
the next start), so the resume takes the checkpoint before it. A process other than 0 whose exchanges have all
failed or hung for LOST_S says that process 0, the coordinator, was lost (a frozen process 0; when process 0's
sockets close instead, JAX's own client aborts the others at once, before anything here can run: seen on CPU).

A failure on the main thread (a collective that failed because its peer is gone, a save that failed with it) is
not reported until the peers are settled: `settle()` returns once every peer has shown a heartbeat since it was
called (the failure is this process's own: its line or traceback follows), or the judge ends the process first
(a peer is lost: its line, exit 76). A process that ends by itself (done, preempted, a one-line error) marks its
heartbeat as ended (`stop()`), so that the processes still finishing are not ended by its silence.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_LOST = 76  # the hang watchdog's code (maxlm/runtime/watchdog.py EXIT_HUNG): the templates requeue on it
HEARTBEAT_S = 5.0  # a heartbeat written and the others read this often
EXCHANGE_S = 10.0  # what one key-value exchange may take on a loaded coordinator
LOST_S = 2 * HEARTBEAT_S + 2 * EXCHANGE_S  # the derivation: module doc
POLL_S = 1.0  # the judge checks this often
KEY = "maxlm/peers/"


class Peers:
  """Started with the object (two daemon threads); `settle()` after a failure, `stop()` at the end. `client`: the
  coordination service's client (key_value_set, key_value_dir_get); `watch`: an object whose `phase` (name, step)
  says where this process is (the hang watchdog), or None; `exit` and the times are for tests."""

  def __init__(self, client, process_id: int, num_processes: int, host: str, watch=None, *,
               heartbeat_s: float = HEARTBEAT_S, exchange_s: float = EXCHANGE_S, exit: Callable = os._exit,
               poll_s: float = POLL_S):
    self.client, self.process_id, self.num_processes, self.host = client, process_id, num_processes, host
    self.heartbeat_s, self.exchange_s, self.poll_s = heartbeat_s, exchange_s, poll_s
    self.lost_s = 2 * heartbeat_s + 2 * exchange_s
    self._watch, self._exit = watch, exit
    self._count = 0
    now = time.monotonic()
    # per peer: the last heartbeat read (a dict), when it last advanced; the last exchange that completed
    self._seen: dict[int, dict] = {}
    self._advanced = {i: now for i in range(num_processes) if i != process_id}
    self._exchanged, self._began = now, now  # the last exchange that completed: its end and its start
    self._done = threading.Event()
    self._fired = threading.Lock()
    self._changed = threading.Condition()
    self._beat = threading.Thread(target=self._beating, name="maxlm-peers-beat", daemon=True)
    self._judge = threading.Thread(target=self._judging, name="maxlm-peers-judge", daemon=True)
    self._beat.start()
    self._judge.start()

  # --- the heartbeat ------------------------------------------------------------------------------

  def _record(self, ended: bool = False) -> str:
    phase = getattr(self._watch, "phase", None)
    self._count += 1
    return json.dumps({"n": self._count, "host": self.host, "ended": ended,
                       "step": getattr(phase, "step", None), "phase": getattr(phase, "name", None)})

  def exchange(self) -> None:
    """Write this process's heartbeat, read everyone's (one round; the beat thread calls it)."""
    began = time.monotonic()
    self.client.key_value_set(f"{KEY}{self.process_id}", self._record(), allow_overwrite=True)
    rows = self.client.key_value_dir_get(KEY)
    now = time.monotonic()
    with self._changed:
      for key, value in rows:
        i = int(key.rsplit("/", 1)[1])
        if i == self.process_id or i not in self._advanced:
          continue
        beat = json.loads(value)
        if beat != self._seen.get(i):
          self._seen[i], self._advanced[i] = beat, now
      self._exchanged, self._began = now, began
      self._changed.notify_all()

  def _beating(self) -> None:
    while not self._done.is_set():
      try:
        self.exchange()
      except Exception:  # noqa: BLE001 - the store unreachable (JaxRuntimeError and the like): the judge decides
        pass
      self._done.wait(self.heartbeat_s)

  # --- the judge ----------------------------------------------------------------------------------

  def lost(self, now: float | None = None) -> tuple[int, float, str] | None:
    """(the lost process, for how long its heartbeat has not advanced, a note), or None while every peer is alive or
    ended. A heartbeat advances only through an exchange, so a store that stops answering (the coordination
    service, inside process 0) shows as process 0's heartbeat stopping, with the note saying so."""
    now = time.monotonic() if now is None else now
    with self._changed:
      for i, t in sorted(self._advanced.items()):
        if not self._seen.get(i, {}).get("ended") and now - t > self.lost_s:
          unanswered = now - self._exchanged
          note = (f"; its coordination service has not answered this process for {unanswered:.1f} s"
                  if i == 0 and unanswered > self.heartbeat_s + self.exchange_s else "")
          return i, now - t, note
    return None

  def message(self, process: int, silent_s: float, note: str = "") -> str:
    beat = self._seen.get(process, {})
    host = f"host {beat['host']}" if beat.get("host") else "host unknown: no heartbeat seen"
    coordinator = ", the coordinator" if process == 0 else ""
    where = ""
    if beat.get("step") is not None:
      where = f"; its last was at step {beat['step']}" + (f" ({beat['phase']})" if beat.get("phase") else "")
    return (f"maxlm: error: process {process}/{self.num_processes} ({host}{coordinator}) was lost: no heartbeat for "
            f"{silent_s:.1f} s (limit {self.lost_s:g} s: 2 x {self.heartbeat_s:g} s heartbeat + 2 x "
            f"{self.exchange_s:g} s key-value exchange){note}{where}; exiting with code {EXIT_LOST} for the launcher "
            f"to requeue the job, which resumes from the last checkpoint")

  def _judging(self) -> None:
    while not self._done.wait(self.poll_s):
      found = self.lost()
      if found is not None:
        self._fire(*found)
        return

  def _fire(self, process: int, silent_s: float, note: str) -> None:
    if not self._fired.acquire(blocking=False):
      return
    prefix = getattr(sys.stderr, "prefix", "")  # `[process i/N host] ` (maxlm.runtime.process_output)
    os.write(2, f"{prefix}{self.message(process, silent_s, note)}\n".encode())
    flusher = threading.Thread(target=sys.stdout.flush, daemon=True)  # never wait on a stuck stdout for long
    flusher.start()
    flusher.join(1.0)
    self._exit(EXIT_LOST)

  # --- the main thread ----------------------------------------------------------------------------

  def settle(self) -> None:
    """After a failure on this process: return once every peer has written a heartbeat since the call (or has
    ended); a lost peer makes the judge end the process first. A heartbeat read after the call may have been written
    before it (by a peer that died since): the first exchange that begins after the call gives each peer's
    heartbeat then, and only a later one proves the peer alive (about 2 heartbeats). A dead peer's last heartbeat
    is read at most one heartbeat and one exchange after the call, and the judge reports it LOST_S after that read:
    settle gives up (and the failure is reported as this process's own) only past that, HEARTBEAT_S + EXCHANGE_S +
    LOST_S + 2 polls after the call."""
    start = time.monotonic()
    end = start + self.heartbeat_s + self.exchange_s + self.lost_s + 2 * self.poll_s
    with self._changed:
      while self._began <= start and time.monotonic() < end:
        self._changed.wait(self.poll_s)
      then = dict(self._seen)
      while time.monotonic() < end and not all(self._seen.get(i) != then.get(i) or self._seen.get(i, {}).get("ended")
                                               for i in self._advanced):
        self._changed.wait(self.poll_s)

  def stop(self) -> None:
    """This process ends by itself: mark its heartbeat ended (waiting at most one exchange for the store)."""
    if self._done.is_set():
      return
    self._done.set()
    self._beat.join(self.exchange_s)  # its last write must not come after the one that says ended
    record = self._record(ended=True)
    writer = threading.Thread(target=lambda: self.client.key_value_set(f"{KEY}{self.process_id}", record,
                                                                       allow_overwrite=True), daemon=True)
    writer.start()
    writer.join(self.exchange_s)


class Off:
  """One process: no peers to watch."""

  def settle(self) -> None:
    pass

  def stop(self) -> None:
    pass



def start(launch, watch=None) -> Peers | Off:
  """The monitor of a multi-process run (`launch` from maxlm.runtime.distributed.initialize; None: one process,
  Off), on the coordination service's client that initialize started."""
  if launch is None:
    return Off()
  # lazy: Peers itself needs no JAX (its tests give it a store of their own); private: the key-value store's client
  from jax._src import distributed as jax_distributed  # noqa: PLC0415
  return Peers(jax_distributed.global_state.client, launch.process_id, launch.num_processes, launch.host, watch)
