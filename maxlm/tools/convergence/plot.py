"""loss_curves.png: one panel per case, the golden band shaded, the run overlaid, failures marked.

matplotlib is imported lazily (by `draw`) on purpose: it is the `viz` extra, and the CLI checks for it
up front so a missing install is a one-line setup error.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PANEL_W, PANEL_H, DPI = 5.0, 3.6, 100  # inches, dots per inch: a panel is 500 x 360 pixels
MAX_COLS = 3


def grid(n: int) -> tuple[int, int]:
  """(rows, cols) of the panel grid for n cases."""
  cols = min(MAX_COLS, max(1, n))
  return math.ceil(max(1, n) / cols), cols


def draw(path: Path, panels: list[dict[str, Any]], title: str) -> Path:
  """panels: [{case, golden (metric -> curve with steps/lo/hi), run (metric -> {step: value}), failures:
  [(metric, step, value)], failed: bool, limits: [(y, label)] (optional horizontal lines)}]; loss_smooth is
  drawn solid, eval_loss dashed with dots."""
  import matplotlib  # noqa: PLC0415 (lazy on purpose, see the module docstring)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows, cols = grid(len(panels))
  fig, axes = plt.subplots(rows, cols, figsize=(PANEL_W * cols, PANEL_H * rows), dpi=DPI, squeeze=False)
  styles = {"loss_smooth": ("C0", "-"), "loss": ("C0", "-"), "eval_loss": ("C2", "--"), "grad_norm": ("C4", ":")}
  for ax, p in zip(axes.flat, panels):
    for metric in dict.fromkeys([*p["golden"], *p["run"]]):
      color, ls = styles.get(metric, ("C1", "-"))
      g = p["golden"].get(metric)
      if g and g["steps"]:
        ax.fill_between(g["steps"], g["lo"], g["hi"], color=color, alpha=0.25, lw=0, label=f"{metric} golden band")
      run = p["run"].get(metric, {})
      xs = sorted(run)
      ys = [run[s] if math.isfinite(run[s]) else float("nan") for s in xs]
      ax.plot(xs, ys, color=color, ls=ls, lw=1.2, marker="." if metric == "eval_loss" else None,
              label=f"{metric} run")
    for y, label in p.get("limits", []):
      ax.axhline(y, color="C3", ls="-.", lw=1, label=label)
    for metric, step, value in p["failures"]:
      y = value if value is not None and math.isfinite(value) else ax.get_ylim()[1]
      ax.plot([step], [y], "x", color="red", ms=10, mew=2.5)
    ax.set_title(p["case"] + ("  FAIL" if p["failed"] else "  pass"), color="red" if p["failed"] else "black")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the image is exactly rows*360 x cols*500 pixels
  plt.close(fig)
  return path
