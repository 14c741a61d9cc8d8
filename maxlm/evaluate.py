"""The one evaluation loop: a token-weighted loss over batches, used by the trainer's periodic eval and by
`maxlm eval`.

`token_weighted(run_batch, batches, max_batches, on_batch)` runs each batch through `run_batch` (a jitted eval
step that returns the summed token loss `loss_sum` and the token count `tokens`), adds them up, and returns the
sums: the loss is sum of token losses / number of tokens, never a mean of batch means. `on_batch(batch)` lets a
caller count something more per batch (`maxlm eval` counts the bytes of the text for bits per byte).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import jax


@dataclasses.dataclass(frozen=True)
class Sums:
  loss_sum: float
  tokens: float
  batches: int

  @property
  def loss(self) -> float:
    return self.loss_sum / self.tokens

  @property
  def perplexity(self) -> float:
    return math.exp(min(self.loss, 700.0))


def token_weighted(run_batch: Callable[[dict], dict], batches: Iterable[dict], max_batches: int = 0,
                   on_batch: Callable[[dict], None] | None = None) -> Sums:
  """Sums of the token losses and tokens over `batches` (at most `max_batches`; 0 = all)."""
  loss_sum, tokens, n = 0.0, 0.0, 0
  for batch in batches:
    if max_batches and n >= max_batches:
      break
    out = jax.device_get(run_batch(batch))
    loss_sum += float(out["loss_sum"])
    tokens += float(out["tokens"])
    if on_batch is not None:
      on_batch(batch)
    n += 1
  return Sums(loss_sum, tokens, n)
