"""``loss.png``: the training-loss curve of a run (and eval_loss points), drawn from ``train_log.jsonl``.

Every roll-train run writes one at the end, in ``output_dir`` (global rank 0, both backends, from the
same log file both backends write). A plot is a convenience: when matplotlib is missing or drawing
fails, roll warns once and the run goes on. matplotlib is used through its Agg canvas only (no pyplot,
no display, no global backend switch).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from roll.logging import TRAIN_LOG_FILE, warn_once

logger = logging.getLogger(__name__)

LOSS_PLOT_FILE = "loss.png"


@dataclass
class Curve:
    """One run's logged losses: ``[(step, loss), ...]`` for training and for evaluation."""

    train: list[tuple[int, float]] = field(default_factory=list)
    eval: list[tuple[int, float]] = field(default_factory=list)


def parse_curve(lines: Iterable[str]) -> Curve:
    """``train_log.jsonl`` lines -> the training losses and eval_loss points, by step (a step logged twice,
    e.g. by a resumed run, keeps its last value)."""
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        record = json.loads(line)
        if "step" not in record:
            continue
        step = int(record["step"])
        if "loss" in record:
            train[step] = float(record["loss"])
        if "eval_loss" in record:
            evals[step] = float(record["eval_loss"])
    return Curve(sorted(train.items()), sorted(evals.items()))


def read_curve(output_dir: str) -> Curve:
    """The curve of the run in ``output_dir`` (empty when it has no train_log.jsonl)."""
    path = os.path.join(output_dir, TRAIN_LOG_FILE)
    if not os.path.isfile(path):
        return Curve()
    with open(path, encoding="utf-8") as fh:
        return parse_curve(fh)


def plot_losses(curves: Mapping[str, Curve], path: str, title: str) -> str:
    """Draw every curve (label -> Curve) on one plot and save it as PNG at ``path``; returns ``path``.
    Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    styles = ("-", "--", "-.", ":")
    for index, (label, curve) in enumerate(curves.items()):
        if curve.train:
            steps, losses = zip(*curve.train)
            axes.plot(steps, losses, styles[index % len(styles)], marker="." if len(steps) <= 30 else None,
                      label=f"{label} loss" if label else "training loss")
        if curve.eval:
            steps, losses = zip(*curve.eval)
            axes.plot(steps, losses, "o", label=f"{label} eval_loss" if label else "eval_loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    if axes.lines:
        axes.legend()
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, format="png")
    return path


def write_loss_plot(output_dir: str, title: str) -> str | None:
    """``OUTPUT_DIR/loss.png`` from ``OUTPUT_DIR/train_log.jsonl``; returns its path, or None (with one
    warning) when there is nothing to plot, matplotlib is missing or drawing fails. Never raises."""
    try:
        curve = read_curve(output_dir)
        if not curve.train and not curve.eval:
            return None
        return plot_losses({"": curve}, os.path.join(output_dir, LOSS_PLOT_FILE), title)
    except ImportError:
        warn_once(logger, "loss.png not written: matplotlib is not installed (pip install matplotlib).")
    except Exception as exc:  # a plot never fails a training run
        warn_once(logger, f"loss.png not written: {type(exc).__name__}: {exc}")
    return None
