"""A progress line at least every EVERY seconds while the planner waits on one compile (XLA:GPU compiles the 70B for
64 compile-only GPUs in 10 to 60 s on a 2-core machine; without it `maxlm plan` could stay silent for minutes).

`beating(say, what)`: for the length of the with-block a thread says `plan: <what> (<s> s so far)` every EVERY
seconds; on leaving it (also on an exception) the thread is stopped and joined before the block's outcome goes on,
so no line follows an error's line and no thread outlives the compile. `say=None`: nothing at all.
"""

from __future__ import annotations

import contextlib
import threading
import time

EVERY = 30.0  # seconds between two lines (issue 55: a progress line at least every 30 s)


def candidate(cfg) -> str:
  """What is compiled, in the planner's words: the levers, the mesh's axes over 1, and the depth."""
  levers = (f"remat={cfg.model.remat}, grad_accum={cfg.train.grad_accum}, offload={cfg.optim.offload}, "
            f"mu_dtype={cfg.optim.mu_dtype}, nu_dtype={cfg.optim.nu_dtype}")
  axes = " x ".join(f"{k} {v if v > 0 else 'rest'}" for k, v in vars(cfg.mesh).items()
                    if isinstance(v, int) and v != 1)  # -1: the devices the other axes leave
  return f"{levers}; mesh {axes or '1'}; {cfg.model.n_layers} layers"


@contextlib.contextmanager
def beating(say, what: str, every: float = EVERY, clock=time.monotonic):
  """Within: `say(f"plan: {what} ({n} s so far)")` every `every` seconds from a thread, stopped and joined on
  leaving. say=None or every <= 0: no thread, no line."""
  if say is None or every <= 0:
    yield
    return
  stop, start = threading.Event(), clock()

  def beat() -> None:
    while not stop.wait(every):
      try:
        say(f"plan: {what} ({clock() - start:.0f} s so far)")
      except OSError:  # the output is gone (a closed pipe): the compile goes on without its lines
        return
  thread = threading.Thread(target=beat, name="maxlm-plan-heartbeat", daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join()
