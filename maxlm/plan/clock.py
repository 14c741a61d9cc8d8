"""How long the planner's next compile should take, from the compiles it has made: what the start-up watchdog's limit
of each planner compile is derived from (maxlm/plan/__init__.py `for_run`, maxlm/runtime/watchdog.py
`planned_compile_limit`).

XLA's compile of an unrolled decoder grows with its depth (each layer is its own code), a scanned one's does not
(one layer's body, whatever the count). So a compile is expected to take what the slowest compile at least as deep
took; where only shallower ones were made (the shallow probes at 4 and 8 layers, maxlm/plan/probe.py), their time
scaled by the depth ratio. The scaling counts each probe's fixed part (tracing, the embedding and head, the
optimizer) once per layer as well, so it errs long: a limit derived from it kills no compile that progresses as the
ones before it did. Nothing compiled yet: no expectation (the caller's floor applies)."""

from __future__ import annotations

import dataclasses

from maxlm.config import Config


def depth(cfg: Config) -> int:
  """The layers XLA compiles one by one: all of an unrolled model's, one of a scanned one's."""
  return 1 if cfg.model.scan_layers else cfg.model.n_layers


@dataclasses.dataclass
class CompileClock:
  seen: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (depth, seconds) of each compile

  def expect(self, cfg: Config) -> float | None:
    """Seconds `cfg`'s compile is expected to take (module doc); None before any compile."""
    if not self.seen:
      return None
    d = depth(cfg)
    deep = [s for k, s in self.seen if k >= d]
    return max(deep) if deep else max(s * d / k for k, s in self.seen)

  def add(self, cfg: Config, seconds: float) -> None:
    self.seen.append((depth(cfg), seconds))
