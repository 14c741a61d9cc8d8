"""Lost peers (`maxlm.runtime.peers`) against a key-value store of the test's own (a dict behind a lock, the calls
JAX's coordination client has): a peer that stops beating is reported in one line within the limit, one that
ended is not, a store that stops answering is a lost coordinator, and `settle()` waits for the peers' verdict.
The 2-process kills (the real store, os._exit, the resume): tests/test_resume_multiprocess.py."""

import json
import re
import threading
import time

import pytest

from maxlm.runtime import peers

H, X = 0.2, 0.3  # heartbeat and exchange allowance of these tests: limit 2 x 0.2 + 2 x 0.3 = 1 s
LIMIT = 2 * H + 2 * X
SLACK = 1.0  # thread wake-ups late on a loaded 2-core machine


class Store:
  """The coordination service's key-value store: set (overwrite allowed) and directory reads; `block` makes every
  call wait until released (a frozen coordinator)."""

  def __init__(self):
    self.rows, self.lock, self.block = {}, threading.Lock(), threading.Event()
    self.block.set()

  def key_value_set(self, key, value, allow_overwrite=False):
    self.block.wait()
    with self.lock:
      assert allow_overwrite or key not in self.rows
      self.rows[key] = value

  def key_value_dir_get(self, prefix):
    self.block.wait()
    with self.lock:
      return [(k, v) for k, v in self.rows.items() if k.startswith(prefix)]


class Phase:
  """What the hang watchdog's `phase` holds (name, step)."""

  def __init__(self, name, step):
    self.name, self.step = name, step


class Watch:
  def __init__(self, name, step):
    self.phase = Phase(name, step)


def _monitor(store, pid, n=2, watch=None):
  codes = []
  return peers.Peers(store, pid, n, f"host{pid}", watch, heartbeat_s=H, exchange_s=X, poll_s=0.05,
                     exit=codes.append), codes


def test_the_limit_is_derived_from_the_heartbeat_and_the_exchange():
  # independent numbers: a 5 s heartbeat, 10 s for one exchange; twice each (the peer's write, this process's read)
  assert (peers.HEARTBEAT_S, peers.EXCHANGE_S, peers.LOST_S) == (5.0, 10.0, 30.0)
  assert peers.LOST_S + peers.POLL_S < 60  # srun --wait in launch/slurm (MAXLM_TASK_WAIT_S default)
  assert peers.EXIT_LOST == 76
  monitor = _monitor(Store(), 0)[0]
  monitor.stop()
  assert monitor.lost_s == pytest.approx(LIMIT)


def test_a_peer_that_stops_beating_is_reported_once_within_the_limit(capfd):
  store = Store()
  p0, codes0 = _monitor(store, 0, watch=Watch("metrics fetch", 12))
  p1, codes1 = _monitor(store, 1, watch=Watch("step dispatch", 31))
  try:
    time.sleep(4 * LIMIT)  # both alive: nobody is reported
    assert codes0 == codes1 == [] and p0.lost() is None and p1.lost() is None
    p1._done.set()  # process 1 dies: its threads stop, it writes nothing more (no `ended`)
    died = time.monotonic()
    while not codes0 and time.monotonic() < died + 10 * LIMIT:
      time.sleep(0.01)
    took = time.monotonic() - died
  finally:
    p0.stop()
  assert codes0 == [76]
  # silence counts from process 0's last read of a new heartbeat, at most H + one exchange before the death
  assert LIMIT - H - X <= took <= LIMIT + 0.05 + SLACK, took  # + one poll, + slack for a loaded machine
  err = capfd.readouterr().err
  lines = [ln for ln in err.splitlines() if "maxlm:" in ln]
  assert len(lines) == 1, err
  m = re.fullmatch(r"maxlm: error: process 1/2 \(host host1\) was lost: no heartbeat for ([\d.]+) s \(limit 1 s: "
                   r"2 x 0\.2 s heartbeat \+ 2 x 0\.3 s key-value exchange\); its last was at step 31 \(step "
                   r"dispatch\); exiting with code 76 for the launcher to requeue the job, which resumes from the "
                   r"last checkpoint", lines[0])
  assert m and LIMIT - 0.05 <= float(m[1]) < LIMIT + SLACK, lines[0]  # printed to 0.1 s


def test_a_peer_that_ended_is_not_lost_and_its_record_says_so():
  store = Store()
  p0, codes0 = _monitor(store, 0)
  p1, codes1 = _monitor(store, 1)
  time.sleep(2 * H)
  p1.stop()  # process 1 finished first: process 0 still saves
  assert json.loads(store.rows["maxlm/peers/1"])["ended"] is True
  time.sleep(3 * LIMIT)
  p0.stop()
  assert codes0 == codes1 == []


def test_a_store_that_stops_answering_is_a_lost_coordinator(capfd):
  store = Store()
  p0, _ = _monitor(store, 0)
  p1, codes = _monitor(store, 1)
  time.sleep(3 * H)
  store.block.clear()  # process 0 frozen: its coordination service answers nothing, the calls hang
  frozen = time.monotonic()
  while not codes and time.monotonic() < frozen + 10 * LIMIT:
    time.sleep(0.01)
  took = time.monotonic() - frozen
  store.block.set()
  p0.stop()
  assert codes == [76] and LIMIT - H - X <= took <= LIMIT + SLACK, (codes, took)
  # process 0's monitor, which the test's frozen store blocks too, has its own line: only process 1's is looked at
  line = [ln for ln in capfd.readouterr().err.splitlines() if "maxlm: error: process 0/2" in ln]
  assert len(line) == 1, line
  m = re.fullmatch(r"maxlm: error: process 0/2 \(host host0, the coordinator\) was lost: no heartbeat for ([\d.]+) s "
                   r"\(limit 1 s: .*\); its coordination service has not answered this process for ([\d.]+) s; "
                   r"exiting with code 76 .*", line[0])
  assert m and LIMIT - 0.05 <= float(m[1]) and H + X < float(m[2]) <= float(m[1]) + 0.05, line


def test_settle_returns_once_every_peer_beat_and_ends_in_the_line_when_one_is_lost():
  store = Store()
  p0, codes0 = _monitor(store, 0, n=3)
  p1, _ = _monitor(store, 1, n=3)
  p2, _ = _monitor(store, 2, n=3)
  time.sleep(2 * H)
  t = time.monotonic()
  p0.settle()  # every peer alive: one exchange begun after the call, then a new heartbeat of each
  assert time.monotonic() - t < 2 * (H + X) and codes0 == []
  # process 2 dies just after its last heartbeat, which process 0 has not read yet: reading it after the failure
  # proves nothing (a settle that took it as a sign of life returned at once, and the failure's traceback followed)
  p2._done.set()
  p2._beat.join()
  store.key_value_set("maxlm/peers/2", json.dumps({"n": 10**6, "host": "host2", "ended": False, "step": 7,
                                                   "phase": "metrics fetch"}), allow_overwrite=True)
  t = time.monotonic()
  p0.settle()  # the judge reports process 2 (here its exit only records the code), then settle gives up
  took = time.monotonic() - t
  p0.stop()
  p1.stop()
  assert codes0 == [76] and LIMIT - 2 * H <= took <= H + X + LIMIT + 0.05 + SLACK, took


def test_off_for_one_process():
  off = peers.start(None)
  assert isinstance(off, peers.Off)
  off.settle()
  off.stop()
