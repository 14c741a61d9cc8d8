"""The pipeline schedules' tables: which micro-batch each stage works on at each tick, and the bubble they leave.

GPipe and circular (maxlm/parallel/pipelining.py): one phase per tick, every stage applying a chunk of layers
forward; the backward is the tick loop differentiated (every forward, then every backward).

1F1B (maxlm/parallel/onefoneb.py): each tick has a forward phase and a backward phase, every stage taking part in
both (lockstep SPMD). Micro-batch i runs forward on stage s at tick i + s, and backward on stage s at tick
i + 2 (S - 1) - s: the last stage's backward of i follows its forward in the same tick, then the cotangent moves
back one stage per tick. A phase no stage works in is not run (the first S - 1 ticks have no backward, the last
S - 1 no forward), so the step is M + S - 1 forward phases and as many backward phases, and each stage idles in
S - 1 of each: the bubble is GPipe's (S - 1) / (M + S - 1) whatever the phases' lengths. Stage s holds the input
of micro-batch i from its forward (tick i + s) to its backward (tick i + 2 S - 2 - s): at most 2 (S - s) - 1
micro-batches, so 2 S - 1 on stage 0 however many micro-batches there are (GPipe: all M).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SCHEDULES = ("gpipe", "circular", "1f1b")


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The share of a step a stage waits: (S - 1) / (V M + S - 1) (V = 1: GPipe's, and 1F1B's); 0 without a
  pipeline."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def in_flight(schedule: str, stages: int, microbatches: int) -> int:
  """The most micro-batches whose activations one stage holds at once: M for gpipe and circular (every forward
  before any backward), min(M, 2 S - 1) for 1f1b (stage 0's, see above); 0 without a pipeline."""
  if stages == 1:
    return 0
  return min(microbatches, 2 * stages - 1) if schedule == "1f1b" else microbatches


def assignment(t, stage, microbatches: int, repeats: int = 1):
  """(micro-batch, repeat, busy) of `stage` at tick t (ints or arrays): what the GPipe / circular tick loop runs.
  Idle (not busy) stages get a clipped micro-batch and repeat, whose results are never read."""
  work = jnp.clip(t - stage, 0, repeats * microbatches - 1)
  busy = (t - stage >= 0) & (t - stage < repeats * microbatches)
  return work % microbatches, work // microbatches, busy


def schedule_table(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
  """[ticks, S, 2]: the (micro-batch, repeat) each stage works on at each tick, (-1, -1) where it idles."""
  t = np.arange(repeats * microbatches + stages - 1)[:, None]
  mb, rep, busy = map(np.asarray, assignment(t, np.arange(stages)[None, :], microbatches, repeats))
  return np.where(busy[..., None], np.stack([mb, rep], axis=-1), -1)


def forward_tick(stage, microbatch, stages: int):
  """1F1B: the tick of micro-batch `microbatch`'s forward on `stage`."""
  del stages
  return microbatch + stage


def backward_tick(stage, microbatch, stages: int):
  """1F1B: the tick of micro-batch `microbatch`'s backward on `stage`."""
  return microbatch + 2 * (stages - 1) - stage


def onefoneb_table(stages: int, microbatches: int) -> np.ndarray:
  """[2 (S + M - 1) phases, S, 3]: per phase that runs, in the order 1f1b runs them, and per stage: (the
  micro-batch it works on, -1 idle; the phase's kind, 0 forward or 1 backward; its tick). The forward phases of
  the S - 1 warm-up ticks, then a forward and a backward phase for each of the M steady ticks, then the backward
  phases of the S - 1 cool-down ticks."""
  s = np.arange(stages)
  rows = []
  for t in range(microbatches + 2 * stages - 2):
    fwd, bwd = t - s, t - 2 * (stages - 1) + s  # inverses of forward_tick and backward_tick
    if t < microbatches + stages - 1:
      rows.append(np.stack([np.where((fwd >= 0) & (fwd < microbatches), fwd, -1), 0 * s, 0 * s + t], axis=-1))
    if t >= stages - 1:
      rows.append(np.stack([np.where((bwd >= 0) & (bwd < microbatches), bwd, -1), 0 * s + 1, 0 * s + t], axis=-1))
  return np.stack(rows)
