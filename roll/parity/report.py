"""roll-parity's report: two runs' ``train_log.jsonl`` paired by step, relative differences, the table and
the verdict. Pure functions on plain values (no subprocess, no config), so tests call them on literal logs.
"""

from __future__ import annotations

import math
import os
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
DEFAULT_EVAL_TOLERANCE = 1e-4
"""Relative eval_loss difference allowed at every step both runs evaluated."""
DEFAULT_WEIGHTS_TOLERANCE = 1e-2
"""||mca - standard|| / ||standard - start|| allowed for the exported weights. Measured in fp32 (2026-11-25): on
real weights (SmolLM2-135M-Instruct, full sft, lr 2e-5; scripts/measure_real_parity.py) 1.5e-3 after 2 steps and
1.3e-3 after 8 (Adam gives near-zero, noisy gradients of the tied embedding a full step of either sign); on the
tiny models of the parity sweep 1.2e-4 at most (its cases keep their own, tighter bounds: roll/parity/cases.py).
An export that misses the last of N updates is about 1/N off."""


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
    names: tuple[str, str] = ("standard", "mca")
    """What the two columns are (a row's ``standard`` is the first, its ``mca`` the second): roll-parity's two
    backends, or LLaMA-Factory and a roll backend (roll.parity.llamafactory)."""

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
                missing = [name for name, value in zip(self.names, (row.standard, row.mca)) if value is None]
                out.append(f"step {row.step} missing from the {' and '.join(missing)} log")
            elif not row.ok:
                out.append(f"step {row.step} rel diff {row.rel_diff:.2e} > {row.tolerance:g}")
        return out


def compare(standard: dict[int, float], mca: dict[int, float], *, steps: int | None = None,
            tolerance: float = DEFAULT_TOLERANCE, first_step_tolerance: float = DEFAULT_FIRST_STEP_TOLERANCE,
            names: tuple[str, str] = ("standard", "mca")) -> Comparison:
    """Pair the two logs by step (and expect steps 1..``steps`` when given); the first step is held to
    ``first_step_tolerance``, every step to ``tolerance``; the relative difference is taken against the first
    log. ``names``: the two logs' names in the table and the failures."""
    all_steps = sorted(set(standard) | set(mca) | set(range(1, (steps or 0) + 1)))
    rows = []
    for index, step in enumerate(all_steps):
        a, b = standard.get(step), mca.get(step)
        limit = min(tolerance, first_step_tolerance) if index == 0 else tolerance
        rel = None if a is None or b is None else relative_difference(a, b)
        rows.append(StepRow(step, a, b, rel, limit))
    return Comparison(tuple(rows), tolerance, first_step_tolerance, names)


def format_table(comparison: Comparison) -> str:
    """``step | standard loss | mca loss | rel diff`` (the comparison's names), one row per step,
    over-tolerance rows marked."""
    def loss(value: float | None) -> str:
        return "-" if value is None else f"{value:.8f}"

    first, second = (f"{name} loss" for name in comparison.names)
    width = max(14, len(first), len(second))
    lines = [f"{'step':>4} | {first:>{width}} | {second:>{width}} | rel diff",
             f"{'-' * 4}-+-{'-' * width}-+-{'-' * width}-+-{'-' * 9}"]
    for row in comparison.rows:
        rel = "-" if row.rel_diff is None else f"{row.rel_diff:.2e}"
        mark = "" if row.ok else ("  (missing)" if row.rel_diff is None else f"  (over {row.tolerance:g})")
        lines.append(f"{row.step:>4} | {loss(row.standard):>{width}} | {loss(row.mca):>{width}} | {rel}{mark}")
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


# --- eval_loss and exported weights ------------------------------------------------------------------


def read_evals(output_dir: str) -> dict[int, float]:
    """``{step: eval_loss}`` of a run's train_log.jsonl."""
    return dict(read_curve(output_dir).eval)


@dataclass(frozen=True)
class EvalComparison:
    """eval_loss of the two runs at each step either evaluated; a step only one of them evaluated fails."""

    rows: tuple[StepRow, ...]
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(row.ok for row in self.rows)

    @property
    def max_rel_diff(self) -> float | None:
        gaps = [row.rel_diff for row in self.rows if row.rel_diff is not None]
        return max(gaps) if gaps else None

    def failures(self) -> list[str]:
        out = []
        for row in self.rows:
            if row.rel_diff is None:
                which = "standard" if row.standard is None else "mca"
                out.append(f"eval_loss at step {row.step} missing from the {which} log")
            elif not row.ok:
                out.append(f"eval_loss at step {row.step} rel diff {row.rel_diff:.2e} > {row.tolerance:g}")
        return out


def compare_evals(standard: dict[int, float], mca: dict[int, float], tolerance: float) -> EvalComparison:
    rows = []
    for step in sorted(set(standard) | set(mca)):
        a, b = standard.get(step), mca.get(step)
        rel = None if a is None or b is None else relative_difference(a, b)
        rows.append(StepRow(step, a, b, rel, tolerance))
    return EvalComparison(tuple(rows), tolerance)


@dataclass(frozen=True)
class WeightGap:
    """How far apart the two runs' exported weights are, relative to how far training moved them:
    ``||mca - standard|| / ||standard - start||`` over every exported tensor (a tensor the start model lacks,
    e.g. a LoRA adapter's, counts from zero)."""

    rel_diff: float
    diff_norm: float
    update_norm: float
    tolerance: float
    mismatched: tuple[str, ...] = ()
    """Tensor names only one export has, or whose shapes differ."""

    @property
    def passed(self) -> bool:
        return not self.mismatched and self.rel_diff <= self.tolerance

    def failures(self) -> list[str]:
        if self.mismatched:
            return [f"the exports differ in tensors: {', '.join(self.mismatched[:5])}"]
        if self.rel_diff > self.tolerance:
            return [f"exported weights rel diff {self.rel_diff:.2e} > {self.tolerance:g}"]
        return []


def weight_gap(start: dict, standard: dict, mca: dict, tolerance: float) -> WeightGap:
    """``start``/``standard``/``mca``: ``{name: tensor}`` (torch tensors; compared in float64)."""
    mismatched = sorted(set(standard) ^ set(mca))
    mismatched += [name for name in set(standard) & set(mca) if standard[name].shape != mca[name].shape]
    diff = update = 0.0
    for name in sorted(set(standard) & set(mca)):
        if name in mismatched:
            continue
        ours, theirs = standard[name].double(), mca[name].double()
        before = start.get(name)
        diff += float((theirs - ours).pow(2).sum())
        moved = ours if before is None or before.shape != ours.shape else ours - before.double()
        update += float(moved.pow(2).sum())
    diff, update = math.sqrt(diff), math.sqrt(update)
    rel = diff / update if update > 0 else (0.0 if diff == 0 else math.inf)
    return WeightGap(rel, diff, update, tolerance, tuple(sorted(mismatched)))


def read_weights(model_dir: str) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``model_dir`` (an HF model or a PEFT adapter)."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


# --- roll-parity --json ---------------------------------------------------------------------------------


def to_json(verdicts: list, pairs: list) -> dict:
    """The comparison as one JSON-ready object (a missing value is null; nan / inf are strings): the first
    pair's losses at the top, every pair (a resumed case has two) under "pairs"."""
    each = [_pair_json(verdict, pair) for verdict, pair in zip(verdicts, pairs)]
    failures = [failure for verdict in verdicts for failure in verdict.failures]
    return {**each[0], "passed": not failures, "failures": failures, "pairs": each}


def _pair_json(verdict, pair) -> dict:
    rows, evals, weights = verdict.losses.rows, verdict.evals.rows, verdict.weights
    return {
        "label": verdict.label,
        "passed": verdict.passed,
        "max_rel_diff": _number(verdict.losses.max_rel_diff),
        "tolerance": verdict.losses.tolerance,
        "first_step_tolerance": verdict.losses.first_step_tolerance,
        "steps": [row.step for row in rows],
        "losses": {"standard": [_number(row.standard) for row in rows],
                   "mca": [_number(row.mca) for row in rows]},
        "rel_diff": [_number(row.rel_diff) for row in rows],
        "eval": {"steps": [row.step for row in evals], "standard": [_number(row.standard) for row in evals],
                 "mca": [_number(row.mca) for row in evals],
                 "rel_diff": [_number(row.rel_diff) for row in evals],
                 "tolerance": verdict.evals.tolerance},
        "weights": None if weights is None else {"rel_diff": _number(weights.rel_diff),
                                                 "tolerance": weights.tolerance,
                                                 "mismatched": list(weights.mismatched)},
        "learning_rate_max_rel_diff": _number(verdict.lr_gap),
        "failures": verdict.failures,
        "runs": {run.backend: {"description": run.description, "command": run.display()}
                 for run in (pair.standard, pair.mca)},
    }


def _number(value: float | None) -> float | str | None:
    """Strict JSON has no nan / inf."""
    return value if value is None or math.isfinite(value) else str(value)
