"""roll-parity: train one recipe for N steps on both backends and compare the losses step by step.

The two runs consume the same global batch each step: the mca run keeps the recipe's layout, the
standard run is one process without DeepSpeed whose gradient accumulation covers the mca run's
data-parallel ranks too (the per-token mean over the global batch does not depend on how the batch is
split; docs/design.md). Each run is a real ``roll-train`` subprocess; roll-parity reads their
``train_log.jsonl`` files. The pure pieces (command line, run plan) are separate functions, and the
log parsing, comparison and table live in ``roll.parity.report``, so tests call them on literal inputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roll.errors import ConfigError, RollError
from roll.launch import inside_launcher, run_child
from roll.parity.report import (DEFAULT_EVAL_TOLERANCE, DEFAULT_FIRST_STEP_TOLERANCE, DEFAULT_TOLERANCE,
                                DEFAULT_WEIGHTS_TOLERANCE)

if TYPE_CHECKING:  # roll.config imports transformers; --help and the pure pieces do not need it
    from roll.config import RunConfig

DEFAULT_STEPS = 10
LOG_TAIL_LINES = 30

USAGE = f"""usage: roll-parity RECIPE.yaml [--steps N] [--tolerance T] [--first-step-tolerance T1]
                   [--eval-tolerance TE] [--weights-tolerance TW] [--output-dir DIR [--save-models]] [--json]
                   [key=value | --key value ...]
       roll-parity --case NAME [options] [key=value ...]
       roll-parity --list-cases

Train RECIPE for N steps on the standard backend (one process, no DeepSpeed) and on the mca backend
(--use-mca, with the recipe's parallel layout), both on the same global batch each step, and compare
their losses step by step, eval_loss wherever both evaluated, and, with --save-models, the exported
weights. Overrides (key=value) apply to both runs, as on roll-train.

With --case NAME, run a case of the parity sweep (tests/parity, roll/parity/cases.py) instead of a
recipe: its key set and layout on a tiny model built on the spot, its steps and its bounds (the
options below override them), both models exported and compared.

options:
  --steps N                 steps to train and compare (default {DEFAULT_STEPS})
  --tolerance T             largest relative loss difference allowed at any step (default {DEFAULT_TOLERANCE:g})
  --first-step-tolerance T1 largest relative difference allowed at step 1 (default {DEFAULT_FIRST_STEP_TOLERANCE:g})
  --eval-tolerance TE       largest relative eval_loss difference (default {DEFAULT_EVAL_TOLERANCE:g})
  --weights-tolerance TW    largest ||mca - standard|| / ||standard - start|| of the exported weights
                            (default {DEFAULT_WEIGHTS_TOLERANCE:g})
  --output-dir DIR          keep both runs (DIR/standard, DIR/mca and their .log files);
                            default: a temporary directory, deleted at the end
  --save-models             with --output-dir: also export each run's final model (HF format) to
                            DIR/standard and DIR/mca, and compare them (--case always does)
  --case NAME               run the parity-sweep case NAME (no recipe)
  --list-cases              the parity-sweep cases, one a line: name, layout, key set
  --json                    print one JSON object instead of the table
  --help                    this text

exit status: 0 within tolerance, 1 beyond it or when a training run fails, 2 for a mistake in the
recipe or command line.
"""

_OPTIONS = {"steps": int, "tolerance": float, "first_step_tolerance": float, "eval_tolerance": float,
            "weights_tolerance": float, "output_dir": str, "case": str}
"""roll-parity's own options that take a value: --steps N, --steps=N or steps=N (dashes or underscores).
output_dir is one of them, so --output-dir / output_dir=DIR mean the same as on roll-train: where to write."""

RESERVED = {
    "use_mca": "roll-parity runs both backends",
    "max_steps": "use --steps N",
    "logging_steps": "roll-parity logs every step",
    "save_strategy": "roll-parity saves no checkpoints",
    "save_hf_model": "roll-parity exports no model; --save-models --output-dir DIR keeps both",
    "report_to": "roll-parity reads train_log.jsonl only",
}
"""Keys roll-parity sets on both runs itself; a user override of one is refused (with what to do instead)."""


@dataclass
class ParityOptions:
    """What the roll-parity command line asked for."""

    recipe: str | None = None
    steps: int = DEFAULT_STEPS
    tolerance: float = DEFAULT_TOLERANCE
    first_step_tolerance: float = DEFAULT_FIRST_STEP_TOLERANCE
    eval_tolerance: float = DEFAULT_EVAL_TOLERANCE
    weights_tolerance: float = DEFAULT_WEIGHTS_TOLERANCE
    output_dir: str | None = None
    case: str | None = None
    """A parity-sweep case to run instead of a recipe."""
    list_cases: bool = False
    given: set[str] = field(default_factory=set)
    """The options the command line gave (a case's own steps and bounds yield to them)."""
    json: bool = False
    save_models: bool = False
    """Export each run's final HF-format model into its output directory (needs output_dir)."""
    help: bool = False
    overrides: dict[str, str] = field(default_factory=dict)
    """``key -> value text`` for both runs, exactly as roll-train would read them."""


def parse_command_line(argv: list[str]) -> ParityOptions:
    """Take roll-parity's own options out of ``argv``; the rest is a roll-train recipe + overrides."""
    options, rest, i = ParityOptions(), [], 0
    while i < len(argv):
        token = argv[i]
        i += 1
        key, sep, value = token.partition("=")
        name, dashed = key.lstrip("-").replace("-", "_"), token.startswith("-")
        if dashed and name in ("help", "h"):
            options.help = True
        elif dashed and name == "json":
            options.json = True
        elif dashed and name == "save_models":
            options.save_models = True
        elif dashed and name == "list_cases":
            options.list_cases = True
        elif name in _OPTIONS and (dashed or sep):
            if not sep:
                if i >= len(argv):
                    raise ConfigError(f"roll-parity option '--{name.replace('_', '-')}' needs a value.")
                value, i = argv[i], i + 1
            setattr(options, name, _option_value(name, value))
            options.given.add(name)
        else:
            rest.append(token)
    if options.help or options.list_cases:
        return options
    if options.save_models and options.output_dir is None:
        raise ConfigError("roll-parity option '--save-models' needs --output-dir DIR (where the models go).")
    from roll.config.parser import split_command_line  # imports transformers: not for --help

    cli, options.overrides = split_command_line(rest)
    switch = next((s for s in ("print_config", "dry_run", "version") if getattr(cli, s)), None)
    if switch:
        raise ConfigError(f"'--{switch.replace('_', '-')}' is a roll-train switch; roll-parity takes --steps, "
                          "--tolerance, --first-step-tolerance, --output-dir and --json.")
    if options.case is not None:
        if cli.recipe is not None:
            raise ConfigError(f"roll-parity takes a recipe or --case NAME, not both (got {cli.recipe!r} and "
                              f"--case {options.case}).")
    elif cli.recipe is None:
        raise ConfigError("roll-parity needs a recipe: roll-parity RECIPE.yaml [key=value ...] (or --case "
                          "NAME; roll-parity --list-cases lists them).")
    options.recipe = cli.recipe
    for key in options.overrides:
        if key in RESERVED:
            raise ConfigError(f"'{key}' is set by roll-parity on both runs ({RESERVED[key]}); drop it from the "
                              "command line.")
    return options


def _option_value(name: str, text: str) -> int | float | str:
    kind = _OPTIONS[name]
    flag = "--" + name.replace("_", "-")
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"roll-parity option '{flag}' takes {'an integer' if kind is int else 'a number'}, "
                          f"got {text!r}.") from None
    if kind is str and not value:
        raise ConfigError(f"roll-parity option '{flag}' needs a value.")
    if kind is not str and not value > 0:
        raise ConfigError(f"roll-parity option '{flag}' must be > 0, got {text!r}.")
    return value


# --- the two runs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One roll-train run of the comparison."""

    backend: str
    """'standard' or 'mca'."""
    description: str
    """What it is, in words: processes, layout, gradient accumulation."""
    recipe: str
    overrides: dict[str, str]
    """Command-line ``key -> value`` (output_dir included); the mca run adds --use-mca."""
    name: str = ""
    """Its log's name (ROOT/NAME.log); default: the backend's."""

    @property
    def label(self) -> str:
        return self.name or self.backend

    @property
    def output_dir(self) -> str:
        return self.overrides["output_dir"]

    @property
    def args(self) -> list[str]:
        """roll-train's arguments."""
        switch = ["--use-mca"] if self.backend == "mca" else []
        return [self.recipe, *switch, *(f"{key}={value}" for key, value in self.overrides.items())]

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "roll.cli", *self.args]

    def display(self) -> str:
        """The command as a user would type it."""
        return "roll-train " + shlex.join(self.args)

    def config_overrides(self) -> dict[str, str]:
        """The overrides as roll's parser reads this run's command line."""
        return {**self.overrides, "use_mca": "true"} if self.backend == "mca" else dict(self.overrides)


def plan_runs(options: ParityOptions, recipe: dict, mca_config: RunConfig, root: str) -> tuple[Run, Run]:
    """The standard and mca runs, given the recipe and the config it resolves to with use_mca on."""
    layout, training = mca_config.layout, mca_config.training
    gas, dp = training.gradient_accumulation_steps, layout.dp
    common = {**options.overrides, "max_steps": str(options.steps), "logging_steps": "1", "save_strategy": "no",
              "save_hf_model": "true" if options.save_models else "false", "report_to": "none",
              "overwrite_output_dir": "true"}  # DIR/standard and DIR/mca are roll-parity's: a rerun replaces
    if training.resume_from_checkpoint:
        common["resume_from_checkpoint"] = "null"  # both runs start from model_name_or_path
    standard = {**common, "nproc_per_node": "1", "gradient_accumulation_steps": str(gas * dp)}
    if "use_mca" in recipe:
        standard["use_mca"] = "false"
    if training.deepspeed:
        standard["deepspeed"] = "null"
    processes = "1 process" if layout.world_size == 1 else f"{layout.world_size} processes"
    split = f" (= {gas} x dp {dp})" if dp > 1 else ""
    std = Run("standard", f"1 process, no DeepSpeed, gradient_accumulation_steps {gas * dp}{split}",
              options.recipe, {**standard, "output_dir": os.path.join(root, "standard")})
    mca = Run("mca", f"{processes}, {layout.describe()}; gradient_accumulation_steps {gas}",
              options.recipe, {**common, "output_dir": os.path.join(root, "mca")})
    return std, mca


def resolve_runs(options: ParityOptions, root: str) -> tuple[Run, Run, RunConfig]:
    """Plan both runs from the recipe's Megatron layout (roll's own parser, use_mca on), then resolve
    each run's exact command line. Raises RollError (a user mistake) before anything trains.
    Returns (standard run, mca run, the mca run's config)."""
    from roll.config.parser import load_recipe, resolve

    recipe = load_recipe(options.recipe)
    probe = resolve(recipe, {**options.overrides, "max_steps": str(options.steps), "use_mca": "true"},
                    options.recipe)
    if probe.training.nnodes > 1:
        raise ConfigError("roll-parity runs on one node; set nnodes=1 (the layout may use every local process).")
    from roll.preflight import check_model_paths

    check_model_paths(probe)  # the Hub-or-missing-model message here, not in both runs' logs
    std, mca = plan_runs(options, recipe, probe, root)
    resolve(recipe, std.config_overrides(), options.recipe)
    return std, mca, resolve(recipe, mca.config_overrides(), options.recipe)


def run_training(run: Run, log_path: str) -> int:
    """Run ``run`` with its output in ``log_path``; return its exit code. Ctrl-C / SIGTERM reach it (and
    its ranks) and raise KeyboardInterrupt here once it has stopped."""
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    signals: list[int] = []
    with open(log_path, "w", encoding="utf-8") as log:
        code = run_child(run.command, on_signal=signals.append, env=env, stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT)
    if signals:
        raise KeyboardInterrupt
    return code


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a run's log; tqdm redraws (carriage returns) keep their last state."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:  # keep tqdm's \r
            text = fh.read()
    except OSError:
        return []
    return [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")[-lines:]]


def format_header(options: ParityOptions, std: Run, mca: Run, mca_config: RunConfig) -> str:
    """What the two runs are, and the global batch they share."""
    t, dp = mca_config.training, mca_config.layout.dp
    batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
    return "\n".join([
        f"roll-parity: {options.recipe}, {options.steps} steps, global batch {batch} samples per step "
        f"(per_device_train_batch_size {t.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{t.gradient_accumulation_steps} x dp {dp})",
        f"  standard: {std.description}",
        f"            {std.display()}",
        f"  mca:      {mca.description}",
        f"            {mca.display()}",
    ])


# --- the command -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_logs():
    """roll's and the backends' loggers at ERROR for the duration (restored after)."""
    loggers = [logging.getLogger(name) for name in ("roll", "backends")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class RunFailed(Exception):
    def __init__(self, run: Run, returncode: int, tail: list[str]) -> None:
        super().__init__(f"the {run.backend} run failed (exit {returncode})")
        self.run, self.returncode, self.tail = run, returncode, tail


def execute(runs: Iterable[Run], root: str, err: Callable[[str], object], tool: str = "roll-parity") -> None:
    """Train each run in turn (its log in ROOT/BACKEND.log); raises RunFailed for the first that fails."""
    for run in runs:
        log_path = os.path.join(root, f"{run.label}.log")
        err(f"{tool}: training {run.label} ... (log: {log_path})\n")
        start = time.monotonic()
        code = run_training(run, log_path)
        if code != 0:
            raise RunFailed(run, code, log_tail(log_path))
        err(f"{tool}: {run.label} done in {time.monotonic() - start:.1f} s\n")


def main(argv: list[str] | None = None, out: Callable[[str], object] | None = None,
         err: Callable[[str], object] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout.write
    err = err or sys.stderr.write
    root, temporary = None, False
    try:
        options = parse_command_line(argv)
        if options.help:
            out(USAGE)
            return 0
        if inside_launcher():
            raise ConfigError("roll-parity starts its own processes; run it directly, not under a launcher.")
        if options.list_cases:
            from roll.parity.cases import format_cases

            out(format_cases() + "\n")
            return 0
        from roll.parity.report import to_json
        from roll.parity.sweep import plan

        temporary = options.output_dir is None
        root = tempfile.mkdtemp(prefix="roll-parity-") if temporary else os.path.abspath(options.output_dir)
        with _quiet_logs():  # the config's warnings belong in the runs' own logs
            title, pairs, check = plan(options, root)  # roll.parity.sweep
        if not options.json:
            out(title + "\n\n")
        os.makedirs(root, exist_ok=True)
        verdicts = []
        for pair in pairs:
            execute((pair.standard, pair.mca), root, err)
            verdicts.append(check(pair))
        if options.json:
            out(json.dumps(to_json(verdicts, pairs)) + "\n")
        else:
            out("\n\n".join(verdict.report() for verdict in verdicts) + "\n")
        return 0 if all(verdict.passed for verdict in verdicts) else 1
    except RollError as exc:
        err(f"roll-parity: error: {exc}\n")
        return 2
    except RunFailed as exc:
        err(f"roll-parity: {exc}: {exc.run.display()}\n--- the end of its log ---\n" + "\n".join(exc.tail) + "\n")
        if options.json:
            out(json.dumps({"passed": False, "error": str(exc), "run": exc.run.backend,
                            "command": exc.run.display(), "log_tail": exc.tail}) + "\n")
        return 1
    except KeyboardInterrupt:
        err("roll-parity: interrupted\n")
        return 130
    finally:
        if temporary and root is not None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
