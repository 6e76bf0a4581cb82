"""A parity case's runs (planned as roll-parity plans any recipe) and its verdict, read from their outputs.

``plan_case`` writes the case's recipe and returns the pairs of runs to compare (one pair; two for a
resumed case: the full runs that save mid-run, then the runs resumed from those checkpoints). Who trains
them is the caller's business: roll-parity starts one roll-train per run, tests/parity runs many per
process. ``check_pair`` then compares what the two runs wrote: the loss at every step, the logged
learning rate, eval_loss, the exported weights, and for a clipping case that the gradients were clipped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import yaml

from roll.errors import ConfigError
from roll.parity.cli import ParityOptions, Run, format_header, resolve_runs
from roll.parity.cases import Bounds, Case, build_model, get_case
from roll.parity.report import (Comparison, EvalComparison, WeightGap, compare, compare_evals, format_table,
                                format_verdict, read_evals, read_log, read_weights, relative_difference,
                                weight_gap)

LR_TOLERANCE = 1e-6
"""The logged learning_rate: both backends take it from HF's own schedule function (rounding apart)."""


@dataclass(frozen=True)
class Pair:
    standard: Run
    mca: Run
    start_model: str
    """The model both runs start from (the exported weights' update is measured from it)."""
    steps: tuple[int, ...]
    """The training steps both logs must hold."""
    label: str = ""
    """'' or 'resumed'."""


def plan_case(case: Case, root: str, model_dir: str, overrides: dict[str, str] | None = None) -> list[Pair]:
    """Write ROOT/recipe.yaml for ``case`` on the tiny model in ``model_dir`` and plan its runs in ROOT
    (``overrides``: command-line ``key -> value`` on top of the case, on both runs)."""
    os.makedirs(root, exist_ok=True)
    recipe = os.path.join(root, "recipe.yaml")
    with open(recipe, "w", encoding="utf-8") as fh:
        yaml.safe_dump(case.recipe(model_dir), fh, sort_keys=False)  # not JSON: YAML reads 1e-05 as a string
    options = ParityOptions(recipe=recipe, steps=case.steps, output_dir=root, save_models=True,
                            overrides=dict(overrides or {}))
    std, mca, _ = resolve_runs(options, root)
    steps = tuple(range(1, case.steps + 1))
    if case.resume_at is None:
        return [Pair(std, mca, model_dir, steps)]
    at = case.resume_at
    full = [replace(run, overrides={**run.overrides, "save_strategy": "steps", "save_steps": str(at)})
            for run in (std, mca)]
    resumed = [replace(run, name=f"{run.backend}_resumed", overrides={
        **run.overrides, "output_dir": os.path.join(root, f"{run.backend}_resumed"),
        "resume_from_checkpoint": os.path.join(run.output_dir, f"checkpoint-{at}")}) for run in full]
    return [Pair(*full, model_dir, steps), Pair(*resumed, model_dir, steps[at:], "resumed")]


@dataclass
class Verdict:
    """One pair's comparison; ``failures`` is empty when it holds within the bounds."""

    name: str
    label: str
    losses: Comparison
    evals: EvalComparison
    weights: WeightGap | None
    """None when the runs exported no model."""
    lr_gap: float
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def gaps(self) -> dict[str, float | None]:
        """The measured gaps, as Bounds names them (and the learning rate's)."""
        first = self.losses.rows[0].rel_diff if self.losses.rows else None
        return {"step1": first, "steps": self.losses.max_rel_diff, "eval": self.evals.max_rel_diff,
                "weights": None if self.weights is None else self.weights.rel_diff,
                "learning_rate": self.lr_gap}

    def report(self) -> str:
        """The loss table, eval_loss and weights lines, and PASS or FAIL with every failure."""
        lines = [f"-- {self.label} runs --"] if self.label else []
        lines.append(format_table(self.losses))
        lines += [f"eval_loss at step {row.step}: standard {_text(row.standard)}, mca {_text(row.mca)}, "
                  f"rel diff {_text(row.rel_diff, '.2e')}" for row in self.evals.rows]
        if self.weights is not None:
            lines.append("exported weights: ||mca - standard|| / ||standard - start|| = "
                         f"{self.weights.rel_diff:.2e} (within {self.weights.tolerance:g})")
        lines.append(format_verdict(self.losses).splitlines()[0])
        if self.passed:
            lines.append(f"PASS: step 1 within {self.losses.first_step_tolerance:g}, every step within "
                         f"{self.losses.tolerance:g}, eval_loss within {self.evals.tolerance:g}, "
                         "learning rates equal")
        else:
            lines.append("FAIL: " + "; ".join(self.failures))
        return "\n".join(lines)

    def summary(self) -> str:
        name = self.name + (f" ({self.label})" if self.label else "")
        gaps = ", ".join(f"{k} {'-' if v is None else f'{v:.1e}'}" for k, v in self.gaps().items())
        return f"{name}: {'PASS' if self.passed else 'FAIL'} ({gaps})" + "".join(
            f"\n  {failure}" for failure in self.failures)


def _text(value: float | None, spec: str = ".8f") -> str:
    return "-" if value is None else format(value, spec)


def check_pair(pair: Pair, bounds: Bounds, name: str = "", clip_limit: float | None = None) -> Verdict:
    """Compare the two runs of ``pair`` (both finished) within ``bounds``; with ``clip_limit`` also check that
    every logged gradient norm (before clipping) exceeded it, on both runs."""
    std_dir, mca_dir = pair.standard.output_dir, pair.mca.output_dir
    losses = compare(read_log(std_dir), read_log(mca_dir), tolerance=bounds.steps,
                     first_step_tolerance=bounds.step1)
    evals = compare_evals(read_evals(std_dir), read_evals(mca_dir), bounds.eval)
    exported = bounds.weights is not None and _has_weights(std_dir) and _has_weights(mca_dir)
    weights = weight_gap(read_weights(pair.start_model), read_weights(std_dir), read_weights(mca_dir),
                         bounds.weights) if exported else None
    std_records, mca_records = _records(std_dir), _records(mca_dir)
    lr_gap = max((relative_difference(std_records[s]["learning_rate"], mca_records[s]["learning_rate"])
                  for s in pair.steps if s in std_records and s in mca_records), default=0.0)
    failures = losses.failures() + evals.failures() + (weights.failures() if weights else [])
    logged = tuple(row.step for row in losses.rows)
    if logged != pair.steps:
        failures.append(f"logged steps {list(logged)}, expected {list(pair.steps)}")
    if lr_gap > LR_TOLERANCE:
        failures.append(f"learning_rate rel diff {lr_gap:.2e} > {LR_TOLERANCE:g}")
    failures += adapter_config_failures(std_dir, mca_dir)
    if clip_limit is not None:
        norms = [r.get("grad_norm") for records in (std_records, mca_records) for r in records.values()]
        if not norms or not all(n is not None and n > clip_limit for n in norms):
            failures.append(f"max_grad_norm {clip_limit} did not clip every step: grad norms {norms}")
    return Verdict(name, pair.label, losses, evals, weights, lr_gap, failures)


def check_case(case: Case, pair: Pair) -> Verdict:
    clip = float(case.overrides["max_grad_norm"]) if case.clips else None
    return check_pair(pair, case.bounds, case.name, clip)


ADAPTER_KEYS = ("r", "lora_alpha", "use_rslora", "target_modules")
"""The adapter_config.json fields that PEFT rebuilds a LoRA model from (rank, scaling, targets)."""


def adapter_config_failures(std_dir: str, mca_dir: str) -> list[str]:
    """A LoRA run's exported adapter loads into the same model on both backends: their adapter_config.json
    agree on ``ADAPTER_KEYS`` (equal adapter tensors under another scaling would be another model)."""
    standard, mca = _adapter_config(std_dir), _adapter_config(mca_dir)
    return [] if standard == mca else [f"adapter_config.json: standard {standard} vs mca {mca}"]


def _adapter_config(output_dir: str) -> dict | None:
    path = os.path.join(output_dir, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    return {key: sorted(config.get(key) or []) if key == "target_modules" else config.get(key)
            for key in ADAPTER_KEYS}


def _has_weights(output_dir: str) -> bool:
    return os.path.isdir(output_dir) and any(name.endswith(".safetensors") for name in os.listdir(output_dir))


def _records(output_dir: str) -> dict[int, dict]:
    """The training records of a run's train_log.jsonl, by step."""
    path = os.path.join(output_dir, "train_log.jsonl")
    records: dict[int, dict] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                record = json.loads(line) if line.strip() else {}
                if "loss" in record and "step" in record and math.isfinite(float(record["loss"])):
                    records[int(record["step"])] = record
    return records


# --- roll-parity's plan: a recipe or a case -----------------------------------------------------------


def plan(options: ParityOptions, root: str) -> tuple[str, list, Callable[[Pair], Verdict]]:
    """(the header, the pairs of runs to train and compare, pair -> Verdict) for a recipe or a sweep case."""
    if options.case is not None:
        return _plan_case(options, root)
    std, mca, mca_config = resolve_runs(options, root)
    bounds = _bounds(options, weights=options.save_models)
    pair = Pair(std, mca, mca_config.model.model_name_or_path, tuple(range(1, options.steps + 1)))
    return format_header(options, std, mca, mca_config), [pair], lambda p: check_pair(p, bounds)


def _bounds(options: ParityOptions, weights: bool, case_bounds=None):
    given = {"step1": options.first_step_tolerance, "steps": options.tolerance,
             "eval": options.eval_tolerance, "weights": options.weights_tolerance}
    names = {"step1": "first_step_tolerance", "steps": "tolerance", "eval": "eval_tolerance",
             "weights": "weights_tolerance"}
    if case_bounds is not None:  # the case's own bounds, unless the command line gave one
        given = {key: value if names[key] in options.given else getattr(case_bounds, key)
                 for key, value in given.items()}
    if not weights:
        given["weights"] = None
    return Bounds(**given)


def _plan_case(options: ParityOptions, root: str) -> tuple[str, list, Callable[[Pair], Verdict]]:
    case = get_case(options.case)
    if "steps" in options.given:
        if case.resume_at is not None and options.steps <= case.resume_at:
            raise ConfigError(f"case {case.name} resumes from step {case.resume_at}: give --steps above it.")
        case = replace(case, steps=options.steps)
    case = replace(case, bounds=_bounds(options, weights=True, case_bounds=case.bounds))
    pairs = plan_case(case, root, build_model(case.model, os.path.join(root, "models")), options.overrides)
    keys = " ".join(f"{k}={v}" for k, v in {**case.overrides, **options.overrides}.items()) or "(the base)"
    lines = [f"roll-parity: case {case.name}: {case.base} on the tiny {case.model} model, layout "
             f"{case.layout}, {case.steps} steps; keys: {keys}"]
    for pair in pairs:
        lines += [f"  {run.label}: {run.description}\n    {run.display()}"
                  for run in (pair.standard, pair.mca)]
    return "\n".join(lines), pairs, lambda p: check_case(case, p)
