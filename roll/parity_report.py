"""roll-parity's report: two runs' ``train_log.jsonl`` paired by step, relative differences, the table and
the verdict. Pure functions on plain values (no subprocess, no config), so tests call them on literal logs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from roll.plot import parse_curve, read_curve

DEFAULT_TOLERANCE = 1e-4
"""Relative loss difference allowed at every step. Measured on real weights (SmolLM2-135M-Instruct, fp32, CPU,
sft on alpaca_en_demo, cutoff 256, 2 x 2 samples per step, lr 2e-5 cosine; scripts/measure_real_parity.py):
largest over 8 steps 8.0e-6 at TP1 and at PP2 (growing by about 1e-6 a step: Adam gives near-zero gradients a
full step of either sign; docs/mca-training.md "Real weights"); tiny random models about 1e-7. 1e-4 leaves ~10x
for 10 steps and deeper models; a wrong loss, mask or shift moves losses by 1e-2 and more."""
DEFAULT_FIRST_STEP_TOLERANCE = 1e-6
"""Relative difference allowed at step 1 (same weights, same batch: only the forward's rounding differs, the
loss arithmetic being one, roll.loss). Measured on the same real model: 2.5e-8 (alpaca), 4.7e-8 (the repo's
arithmetic data); 6.7e-6 before both backends shared roll.loss, which this catches."""


def parse_log(lines: Iterable[str]) -> dict[int, float]:
    """``train_log.jsonl`` lines -> ``{step: loss}`` of the training records (the one log parser, in roll.plot)."""
    return dict(parse_curve(lines).train)


def read_log(output_dir: str) -> dict[int, float]:
    return dict(read_curve(output_dir).train)


def relative_difference(reference: float, other: float) -> float:
    """|a - b| / max(|a|, 1e-12), with a the standard backend's loss; inf when either is not finite."""
    if not (math.isfinite(reference) and math.isfinite(other)):
        return math.inf
    return abs(reference - other) / max(abs(reference), 1e-12)


@dataclass(frozen=True)
class StepRow:
    step: int
    standard: float | None
    mca: float | None
    rel_diff: float | None
    """None when the step is missing from a log."""
    tolerance: float
    """The tolerance this step is held to (the first step's is tighter)."""

    @property
    def ok(self) -> bool:
        return self.rel_diff is not None and self.rel_diff <= self.tolerance


@dataclass(frozen=True)
class Comparison:
    rows: tuple[StepRow, ...]
    tolerance: float
    first_step_tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(row.ok for row in self.rows)

    @property
    def worst(self) -> StepRow | None:
        """The row with the largest relative difference (None when no step is in both logs)."""
        compared = [row for row in self.rows if row.rel_diff is not None]
        return max(compared, key=lambda row: row.rel_diff) if compared else None

    @property
    def max_rel_diff(self) -> float | None:
        return None if self.worst is None else self.worst.rel_diff

    def failures(self) -> list[str]:
        """One phrase per failing step, for the FAIL line."""
        if not self.rows:
            return ["no training step was logged"]
        out = []
        for row in self.rows:
            if row.rel_diff is None:
                missing = [name for name in ("standard", "mca") if getattr(row, name) is None]
                out.append(f"step {row.step} missing from the {' and '.join(missing)} log")
            elif not row.ok:
                out.append(f"step {row.step} rel diff {row.rel_diff:.2e} > {row.tolerance:g}")
        return out


def compare(standard: dict[int, float], mca: dict[int, float], *, steps: int | None = None,
            tolerance: float = DEFAULT_TOLERANCE, first_step_tolerance: float = DEFAULT_FIRST_STEP_TOLERANCE,
            ) -> Comparison:
    """Pair the two logs by step (and expect steps 1..``steps`` when given); the first step is held to
    ``first_step_tolerance``, every step to ``tolerance``."""
    all_steps = sorted(set(standard) | set(mca) | set(range(1, (steps or 0) + 1)))
    rows = []
    for index, step in enumerate(all_steps):
        a, b = standard.get(step), mca.get(step)
        limit = min(tolerance, first_step_tolerance) if index == 0 else tolerance
        rel = None if a is None or b is None else relative_difference(a, b)
        rows.append(StepRow(step, a, b, rel, limit))
    return Comparison(tuple(rows), tolerance, first_step_tolerance)


def format_table(comparison: Comparison) -> str:
    """``step | standard loss | mca loss | rel diff``, one row per step, over-tolerance rows marked."""
    def loss(value: float | None) -> str:
        return "-" if value is None else f"{value:.8f}"

    lines = [f"{'step':>4} | {'standard loss':>14} | {'mca loss':>14} | rel diff",
             f"{'-' * 4}-+-{'-' * 14}-+-{'-' * 14}-+-{'-' * 9}"]
    for row in comparison.rows:
        rel = "-" if row.rel_diff is None else f"{row.rel_diff:.2e}"
        mark = "" if row.ok else ("  (missing)" if row.rel_diff is None else f"  (over {row.tolerance:g})")
        lines.append(f"{row.step:>4} | {loss(row.standard):>14} | {loss(row.mca):>14} | {rel}{mark}")
    return "\n".join(lines)


def format_verdict(comparison: Comparison) -> str:
    """The largest relative difference, then PASS or FAIL naming the tolerances."""
    worst = comparison.worst
    lines = ["max rel diff: " + ("-" if worst is None else f"{worst.rel_diff:.2e} (step {worst.step})")]
    limits = f"step 1 within {comparison.first_step_tolerance:g}, every step within {comparison.tolerance:g}"
    if comparison.passed:
        lines.append(f"PASS: {limits}")
    else:
        lines.append(f"FAIL ({limits}): " + "; ".join(comparison.failures()))
    return "\n".join(lines)
