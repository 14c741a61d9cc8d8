"""The training loop's services behind one door: `Hooks` called at fixed points with the `Run` they share
(hooks.py), and the services that subscribe (services.py: watchdog, profiler, metrics, preemption, non-finite
checks, checkpointing). The loop itself is `maxlm.trainer._train`."""

from maxlm.loop.hooks import POINTS, Hooks, Run
from maxlm.loop.services import RunError, subscribe

__all__ = ["POINTS", "Hooks", "Run", "RunError", "subscribe"]
