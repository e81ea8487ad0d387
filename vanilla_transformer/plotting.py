"""Training curves as a PNG, drawn headless (matplotlib's Agg canvas, no pyplot state)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

LOSS_KEYS = {"train_loss": "train", "val_loss": "validation"}


def _series(history: Sequence[Mapping[str, float]], key: str) -> tuple[list[float], list[float]]:
    """Steps and values of the entries that record `key` (non-finite values become gaps)."""
    steps, values = [], []
    for entry in history:
        value = entry.get(key)
        if value is None:
            continue
        value = float(value)
        steps.append(float(entry["step"]))
        values.append(value if math.isfinite(value) else math.nan)
    return steps, values


def plot_training_curves(history: Sequence[Mapping[str, float]], path: str | Path) -> Path:
    """Plot losses, validation BLEU and the learning rate against the step; save a PNG at `path`.

    Each history entry has a "step" and any of "train_loss", "val_loss", "val_bleu", "lr". Training and
    validation loss share the first panel; validation BLEU (best value marked) and the learning rate get
    panels of their own when recorded. Uses a standalone `Figure` on an Agg canvas, so it needs no
    display and does not touch pyplot's global state. Returns the path written.
    """
    if not history:
        raise ValueError("`history` is empty: there is nothing to plot.")
    for index, entry in enumerate(history):
        if "step" not in entry:
            raise ValueError(f"history[{index}] has no 'step': {dict(entry)}.")

    losses = {label: _series(history, key) for key, label in LOSS_KEYS.items()}
    losses = {label: series for label, series in losses.items() if series[0]}
    bleu = _series(history, "val_bleu")
    lr = _series(history, "lr")
    panels = [name for name, present in (("loss", losses), ("bleu", bleu[0]), ("lr", lr[0])) if present]
    if not panels:
        raise ValueError("`history` records none of 'train_loss', 'val_loss', 'val_bleu', 'lr'.")

    from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported here: it slows every start
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 2.6 * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "loss":
            for label, (steps, values) in losses.items():
                ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
            ax.set_ylabel("loss")
            ax.legend()
        elif panel == "bleu":
            steps, values = bleu
            ax.plot(steps, values, color="tab:green", marker="o", markersize=3, label="validation BLEU")
            finite = [(v, s) for s, v in zip(steps, values, strict=True) if not math.isnan(v)]
            if finite:
                best, best_step = max(finite)
                ax.annotate(
                    f"best {best:.2f} (step {best_step:g})",
                    (best_step, best),
                    textcoords="offset points",
                    xytext=(0, -14),
                    ha="center",
                    fontsize=8,
                )
                ax.plot([best_step], [best], marker="*", color="tab:red", markersize=10, linestyle="none")
            ax.set_ylabel("BLEU")
        else:
            steps, values = lr
            # Marked where few points: one alone (a short run logs once) was drawn as nothing.
            ax.plot(steps, values, color="tab:purple", marker="o" if len(steps) < 30 else None, markersize=3)
            ax.set_ylabel("learning rate")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title("Training curves")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)
    return path


__all__ = ["plot_training_curves"]
