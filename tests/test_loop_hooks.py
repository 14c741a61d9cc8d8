"""The loop's one door (`maxlm.loop.hooks`): subscribers are called at the points they name, in the order given;
`step` is `dispatch` then the `step` contexts around the block; `end` runs every `end` and `closed` even when one
raises, and raises the first error; `save_due` follows checkpointing, the signal, the last step and
checkpoint.every. The services behind it run in every trainer test (tests/test_trainer.py and the others)."""

import contextlib

import pytest

from maxlm.config import Config
from maxlm.loop import POINTS, Hooks, Run


class Recorder:
  """Records (name, point, step) for every point it subscribes to."""

  def __init__(self, name, log, points, fail=()):
    self.name, self.log, self.fail = name, log, fail
    for p in points:
      if p == "step":
        setattr(self, p, self._context)
      else:
        setattr(self, p, lambda run, p=p: self._record(p, run))

  def _record(self, point, run):
    self.log.append((self.name, point, run.done))
    if point in self.fail:
      raise RuntimeError(f"{self.name} {point}")

  @contextlib.contextmanager
  def _context(self, run):
    self.log.append((self.name, "step enter", run.done))
    yield
    self.log.append((self.name, "step exit", run.done))


def test_subscribers_are_called_at_their_points_in_order():
  log = []
  a = Recorder("a", log, ["begin", "dispatch", "step", "step_end", "end"])
  b = Recorder("b", log, ["begin", "step", "write", "closed"])
  hooks, run = Hooks(a, object(), b), Run(Config(), trainer=None, is_main=True)
  hooks.begin(run)
  with hooks.step(run):
    log.append(("loop", "train_step", run.done))
    run.done = 1
  hooks.step_end(run)
  hooks.save(run)  # nobody subscribes: nothing happens
  hooks.write(run)
  hooks.end(run)
  assert log == [("a", "begin", 0), ("b", "begin", 0),
                 ("a", "dispatch", 0), ("a", "step enter", 0), ("b", "step enter", 0), ("loop", "train_step", 0),
                 ("b", "step exit", 1), ("a", "step exit", 1),
                 ("a", "step_end", 1), ("b", "write", 1), ("a", "end", 1), ("b", "closed", 1)]


def test_every_point_has_a_method_and_end_runs_all_then_raises_the_first_error():
  assert all(callable(getattr(Hooks, p)) for p in POINTS if p not in ("dispatch", "closed"))
  log = []
  subs = [Recorder(n, log, ["end", "closed"], fail=f) for n, f in (("a", ()), ("b", ("end",)), ("c", ("end",)))]
  with pytest.raises(RuntimeError, match="^b end$"):
    Hooks(*subs).end(Run(Config(), trainer=None, is_main=True))
  assert [(n, p) for n, p, _ in log] == [("a", "end"), ("b", "end"), ("c", "end"),
                                          ("a", "closed"), ("b", "closed"), ("c", "closed")]


class Every:
  def __init__(self, n):
    self.n = n

  def due(self, step):
    return step % self.n == 0


@pytest.mark.parametrize("ckpt,stop,last,done,due", [
    (None, True, True, 4, False),  # checkpointing off: never
    (Every(4), False, False, 4, True), (Every(4), False, False, 5, False),
    (Every(4), True, False, 5, True), (Every(4), False, True, 5, True)])
def test_a_save_is_due_at_every_n_at_a_signal_and_at_the_last_step(ckpt, stop, last, done, due):
  run = Run(Config(), trainer=None, is_main=True, done=done, stop=stop, last=last, ckpt=ckpt)
  assert run.save_due is due
