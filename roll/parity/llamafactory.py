"""One recipe under LLaMA-Factory and under roll (standard backend, then ``--use-mca``), their losses step by step
(issue 30 item 6): ``python scripts/llamafactory_parity.py RECIPE.yaml``.

LLaMA-Factory is never a roll dependency: it runs from a virtual environment of its own
(``bash scripts/llamafactory_venv.sh lf``), as its own ``llamafactory-cli train`` process on a config written
from the recipe; each roll side is a ``roll-train`` process planned as roll-parity plans its runs
(``roll.parity.cli.Run``). The comparison, table and verdict are roll-parity's (``roll.parity.report``), with
LLaMA-Factory's loss as the reference of the relative difference. The default bars are issue 30's for a
full-parameter recipe: step 1 within 1e-5, every step within 1e-4.

What the tool adds to each side (both read it alike; they are HF TrainingArguments underneath): ``max_steps``
(``--steps``), ``logging_steps: 1``, no checkpoints, no report_to, a fresh ``output_dir`` under the tool's
output directory. On LLaMA-Factory's side also ``do_train``, ``plot_loss: false`` and, when ``dataset`` is a
file, a ``dataset_info.json`` that registers it (LLaMA-Factory 0.9.5 reads datasets by registered name only).
``--sequential`` asks both for the file's order (LLaMA-Factory's ``disable_shuffling: true``, roll's
``shuffle: false``); without it both draw the HF Trainer's seeded order (roll.data.order).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import yaml

from roll.errors import ConfigError, RollError
from roll.parity.report import Comparison, compare, format_table, format_verdict, read_log

LLAMAFACTORY_LOG = "trainer_log.jsonl"
"""LLaMA-Factory's per-step log in its output_dir (llamafactory/extras/constants.py TRAINER_LOG): one JSON line
per logged step, ``{"current_steps": N, "loss": ..., "lr": ..., ...}``, and a last line without a loss."""
INSTALL = "bash scripts/llamafactory_venv.sh lf"
DEFAULT_STEPS = 5
TOLERANCE = 1e-4
"""Every step (issue 30's bar for roll's standard backend against LLaMA-Factory 0.9.5, full-parameter sft)."""
FIRST_STEP_TOLERANCE = 1e-5
"""Step 1: the same weights on the same batch (issue 30's bar)."""
BACKENDS_TOLERANCE = 1e-3
"""roll standard against roll mca on the same recipe, every step (issue 30's bar for LLaMA-Factory's examples)."""
BACKENDS = ("standard", "mca")
NAMES = {"llamafactory": "LLaMA-Factory", "standard": "roll standard", "mca": "roll mca"}
RESERVED = ("max_steps", "logging_steps", "save_strategy", "save_hf_model", "report_to", "output_dir", "use_mca",
            "do_train", "overwrite_output_dir")
"""Keys the tool sets on every side; a command-line override of one is refused."""


def parse_llamafactory_log(lines: Iterable[str]) -> dict[int, float]:
    """LLaMA-Factory's ``trainer_log.jsonl`` lines -> ``{step: loss}`` (the last record of a step wins; records
    without a loss, e.g. the closing one, are skipped)."""
    losses: dict[int, float] = {}
    for line in lines:
        if line.strip():
            record = json.loads(line)
            if record.get("loss") is not None and "current_steps" in record:
                losses[int(record["current_steps"])] = float(record["loss"])
    return losses


def read_llamafactory_log(output_dir: str) -> dict[int, float]:
    path = os.path.join(output_dir, LLAMAFACTORY_LOG)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return parse_llamafactory_log(fh)


def compare_sides(reference: dict[int, float], sides: dict[str, dict[int, float]], steps: int,
                  tolerance: float = TOLERANCE, first_step_tolerance: float = FIRST_STEP_TOLERANCE,
                  ) -> dict[str, Comparison]:
    """LLaMA-Factory's losses against each roll side's (``{backend: {step: loss}}``), steps 1..``steps``."""
    return {name: compare(reference, losses, steps=steps, tolerance=tolerance,
                          first_step_tolerance=first_step_tolerance,
                          names=(NAMES["llamafactory"], NAMES[name])) for name, losses in sides.items()}


def format_report(comparisons: dict[str, Comparison], between: Comparison | None = None) -> str:
    """Per roll side: roll-parity's table and verdict; ``between``: roll's two backends' (mca against standard);
    then one overall PASS or FAIL line (against LLaMA-Factory)."""
    blocks = [f"-- {NAMES['llamafactory']} vs {NAMES[name]} --\n{format_table(c)}\n{format_verdict(c)}"
              for name, c in comparisons.items()]
    if between is not None:
        blocks.append(f"-- {NAMES['standard']} vs {NAMES['mca']} --\n{format_table(between)}\n"
                      f"{format_verdict(between)}")
    failed = [NAMES[name] for name, c in comparisons.items() if not c.passed]
    blocks.append("FAIL: " + ", ".join(failed) + " beyond tolerance" if failed else
                  "PASS: " + " and ".join(NAMES[name] for name in comparisons) + " train as LLaMA-Factory does")
    return "\n\n".join(blocks)


# --- the command line -------------------------------------------------------------------------------


@dataclass
class Options:
    recipe: str
    steps: int = DEFAULT_STEPS
    tolerance: float = TOLERANCE
    first_step_tolerance: float = FIRST_STEP_TOLERANCE
    output_dir: str = "outputs/llamafactory_parity"
    llamafactory_cli: str = ""
    backends: tuple[str, ...] = BACKENDS
    sequential: bool = False
    overrides: dict[str, str] = field(default_factory=dict)
    """``key -> value text`` on every side."""
    llamafactory_keys: dict[str, str] = field(default_factory=dict)
    """``--lf key=value``: on LLaMA-Factory's side only (e.g. a key roll does not read yet)."""
    roll_keys: dict[str, str] = field(default_factory=dict)
    """``--roll key=value``: on roll's sides only."""
    case: str = ""
    """``--case NAME``: one of LLaMA-Factory's examples (roll.parity.llamafactory_cases), run from
    ``llamafactory_dir``."""
    llamafactory_dir: str = ""
    list_cases: bool = False


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def parse_command_line(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="llamafactory_parity.py", description=__doc__.split("\n\n")[0],
                                     epilog="exit status: 0 within tolerance, 1 beyond it or when a run fails, "
                                            "2 for a mistake on the command line or without LLaMA-Factory.")
    parser.add_argument("recipe", nargs="?", default="", help="an LLaMA-Factory style recipe both read")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="a recipe key on every side")
    parser.add_argument("--case", default="", help="one of LLaMA-Factory's examples by name (--list-cases), "
                                                   "instead of a recipe")
    parser.add_argument("--list-cases", action="store_true", help="the cases, one a line")
    parser.add_argument("--llamafactory-dir", default="",
                        help="with --case: an LLaMA-Factory checkout (its examples/ and data/; default "
                             "$LLAMAFACTORY_DIR); the runs start there, as LLaMA-Factory's do")
    parser.add_argument("--steps", type=_positive(int), default=None, help=f"default {DEFAULT_STEPS} (a case: 3)")
    parser.add_argument("--tolerance", type=_positive(float), default=None,
                        help=f"largest relative loss difference at any step (default {TOLERANCE:g}; a case: its own)")
    parser.add_argument("--first-step-tolerance", type=_positive(float), default=None,
                        help=f"at step 1 (default {FIRST_STEP_TOLERANCE:g}; a case: its own)")
    parser.add_argument("--output-dir", default=Options.output_dir, help="each side's run in DIR/SIDE")
    parser.add_argument("--llamafactory-cli", default="",
                        help="default: $LLAMAFACTORY_CLI, llamafactory-cli on PATH, else lf/bin/llamafactory-cli")
    parser.add_argument("--backends", default="", help="roll's sides: standard, mca or both (default both; a "
                                                      "case: its own)")
    parser.add_argument("--lf", action="append", default=[], metavar="key=value",
                        help="a key on LLaMA-Factory's side only (repeatable)")
    parser.add_argument("--roll", action="append", default=[], metavar="key=value",
                        help="a key on roll's sides only (repeatable)")
    parser.add_argument("--sequential", action="store_true",
                        help="the file's order on every side (disable_shuffling / shuffle: false)")
    args = parser.parse_args(argv)
    if args.list_cases:
        return Options("", list_cases=True)
    if args.case:
        return _case_options(args)
    if not args.recipe:
        raise ConfigError("give a recipe, or --case NAME (--list-cases lists them).")
    if not os.path.isfile(args.recipe):
        raise ConfigError(f"no recipe at {args.recipe!r}.")
    return Options(args.recipe, args.steps or DEFAULT_STEPS, args.tolerance or TOLERANCE,
                   args.first_step_tolerance or FIRST_STEP_TOLERANCE, args.output_dir, args.llamafactory_cli,
                   _backends(args.backends or ",".join(BACKENDS)), args.sequential, _key_values(args.overrides),
                   _key_values(args.lf), _key_values(args.roll))


def _backends(text: str) -> tuple[str, ...]:
    backends = tuple(b for b in text.split(",") if b)
    if not backends or set(backends) - set(BACKENDS):
        raise ConfigError(f"--backends takes standard and/or mca, got {text!r}.")
    return backends


def _case_options(args) -> Options:
    """A case's recipe (in the LLaMA-Factory checkout), its overrides and bars; the command line's win."""
    from roll.parity.llamafactory_cases import CASES, MODELS

    case = CASES.get(args.case)
    if case is None:
        raise ConfigError(f"no case {args.case!r}; the cases: {', '.join(CASES)}.")
    if args.recipe:  # argparse reads the first key=value as the recipe
        args.overrides.insert(0, args.recipe)
    checkout = os.path.abspath(args.llamafactory_dir or os.environ.get("LLAMAFACTORY_DIR", ""))
    recipe = os.path.join(checkout, case.recipe)
    if not (args.llamafactory_dir or os.environ.get("LLAMAFACTORY_DIR")) or not os.path.isfile(recipe):
        raise ConfigError(f"case {case.name} runs {case.recipe} of an LLaMA-Factory checkout, with its data/: give "
                          "--llamafactory-dir (or $LLAMAFACTORY_DIR), e.g. a clone of "
                          "https://github.com/hiyouga/LLaMA-Factory (measured at commit ff6d4d12e); "
                          f"not found: {recipe}.")
    overrides = _key_values(case.arguments(case.model))
    model = os.path.abspath(overrides["model_name_or_path"])
    if not os.path.isdir(model):
        raise ConfigError(f"case {case.name} trains the tiny model {case.model}, not built yet: "
                          f"{MODELS[case.model]} (from roll's checkout).")
    overrides["model_name_or_path"] = model
    return Options(recipe, args.steps or case.steps, args.tolerance or case.tolerance,
                   args.first_step_tolerance or case.first_step_tolerance, os.path.abspath(args.output_dir),
                   args.llamafactory_cli, _backends(args.backends or ",".join(case.backends)), args.sequential,
                   {**overrides, **_key_values(args.overrides)}, _key_values(args.lf),
                   {**_key_values(case.roll), **_key_values(args.roll)}, case=case.name, llamafactory_dir=checkout)


def _key_values(tokens: list[str]) -> dict[str, str]:
    out = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"overrides are key=value, got {token!r}.")
        if key in RESERVED:
            raise ConfigError(f"'{key}' is set by the tool on every side; use --steps / --output-dir instead.")
        out[key] = value
    return out


def find_cli(given: str) -> str | None:
    """The llamafactory-cli that runs (``llamafactory-cli version``), or None."""
    from roll.bench.side_by_side import llamafactory_version

    candidates = [given] if given else [os.environ.get("LLAMAFACTORY_CLI", ""), "llamafactory-cli",
                                        os.path.join("lf", "bin", "llamafactory-cli")]
    for candidate in filter(None, candidates):
        path = shutil.which(candidate) or candidate
        if os.path.isfile(path) and llamafactory_version(path) is not None:
            return os.path.abspath(path)
    return None


# --- the configs ------------------------------------------------------------------------------------


def _dataset_entry(path: str, stage: str) -> dict:
    """LLaMA-Factory's dataset_info.json entry for a data file roll reads (alpaca, or sharegpt with
    ``messages`` / ``conversations``; pt: the ``text`` column)."""
    entry: dict = {"file_name": os.path.abspath(path)}
    if stage == "pt":
        return {**entry, "columns": {"prompt": "text"}}
    with open(path, encoding="utf-8") as fh:
        head = fh.read(1 << 16).lstrip()
    column = next((c for c in ("messages", "conversations") if f'"{c}"' in head), None)
    if column == "messages":
        return {**entry, "formatting": "sharegpt", "columns": {"messages": "messages"},
                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                         "assistant_tag": "assistant", "system_tag": "system"}}
    if column == "conversations":
        return {**entry, "formatting": "sharegpt"}
    return entry


def llamafactory_config(recipe: dict, options: Options, output_dir: str, data_dir: str) -> dict:
    """The config ``llamafactory-cli train`` reads: the recipe, the overrides and the tool's keys; a dataset
    given as a file is registered in ``data_dir/dataset_info.json``."""
    keys = {**options.overrides, **options.llamafactory_keys}
    config = {**recipe, **{k: yaml.safe_load(v) for k, v in keys.items()}}
    if options.sequential:
        config.pop("shuffle", None)
        config["disable_shuffling"] = True
    registry = {}
    for key in ("dataset", "eval_dataset"):
        value = config.get(key)
        if isinstance(value, str) and os.path.isfile(value):
            name = f"roll_{key}"
            registry[name] = _dataset_entry(value, str(config.get("stage", "sft")))
            config[key] = name
    if registry:
        os.makedirs(data_dir, exist_ok=True)
        with open(os.path.join(data_dir, "dataset_info.json"), "w", encoding="utf-8") as fh:
            json.dump(registry, fh, indent=1)
        config["dataset_dir"] = data_dir
    return {**config, "do_train": True, "output_dir": output_dir, "overwrite_output_dir": True,
            "max_steps": options.steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "plot_loss": False}


def roll_overrides(options: Options, output_dir: str) -> dict[str, str]:
    """roll-train's command-line keys for one roll side."""
    keys = {**options.overrides, **options.roll_keys, "max_steps": str(options.steps), "logging_steps": "1", "save_strategy": "no",
            "save_hf_model": "false", "report_to": "none", "overwrite_output_dir": "true",
            "output_dir": output_dir}
    return {**keys, "shuffle": "false"} if options.sequential else keys


# --- the command ------------------------------------------------------------------------------------


def run_llamafactory(cli: str, config_path: str, log_path: str, cache_dir: str) -> int:
    """``llamafactory-cli train CONFIG`` in LLaMA-Factory's venv (none of roll's PYTHONPATH), offline."""
    from roll.bench.side_by_side import Settings, environment
    from roll.launch import run_child

    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    env = environment("llamafactory", Settings(threads=threads), cache_dir)
    signals: list[int] = []
    with open(log_path, "w", encoding="utf-8") as log:
        code = run_child([cli, "train", config_path], on_signal=signals.append, env=env,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    if signals:
        raise KeyboardInterrupt
    return code


def _roll_only(options: Options, out: Callable[[str], object], err: Callable[[str], object]) -> int:
    """A case LLaMA-Factory runs through mcore_adapter only: roll's two backends compared by roll-parity."""
    from roll.parity.cli import main as roll_parity

    argv = [options.recipe, "--steps", str(options.steps), "--tolerance", str(options.tolerance),
            "--first-step-tolerance", str(options.first_step_tolerance), "--output-dir", options.output_dir,
            *(f"{k}={v}" for k, v in {**options.overrides, **options.roll_keys}.items())]
    return roll_parity(argv, out, err)


def main(argv: list[str] | None = None, out: Callable[[str], object] | None = None,
         err: Callable[[str], object] | None = None) -> int:
    from roll.parity.cli import Run, RunFailed, execute, log_tail

    out, err = out or sys.stdout.write, err or sys.stderr.write
    try:
        options = parse_command_line(list(sys.argv[1:] if argv is None else argv))
        if options.list_cases:
            from roll.parity.llamafactory_cases import format_cases

            out(format_cases() + "\n")
            return 0
        if options.case:
            from roll.parity.llamafactory_cases import CASES

            os.chdir(options.llamafactory_dir)  # dataset_dir: data, as LLaMA-Factory runs its examples
            if not CASES[options.case].llamafactory:
                return _roll_only(options, out, err)
        cli = find_cli(options.llamafactory_cli)
        if cli is None:
            err("llamafactory_parity: LLaMA-Factory is not installed (no llamafactory-cli that runs `version`: "
                f"{options.llamafactory_cli or '$LLAMAFACTORY_CLI, llamafactory-cli on PATH, lf/bin'}). Install "
                f"it in a venv of its own, never in roll's: `{INSTALL}` (about 4 minutes), then pass "
                "--llamafactory-cli lf/bin/llamafactory-cli.\n")
            return 2
        with open(options.recipe, encoding="utf-8") as fh:
            recipe = yaml.safe_load(fh) or {}
        if not isinstance(recipe, dict):
            raise ConfigError(f"{options.recipe}: a recipe is a mapping of keys to values.")
        root = os.path.abspath(options.output_dir)
        lf_dir = os.path.join(root, "llamafactory")
        shutil.rmtree(lf_dir, ignore_errors=True)
        config = llamafactory_config(recipe, options, lf_dir, os.path.join(root, "llamafactory_data"))
        config_path = os.path.join(root, "llamafactory.yaml")
        os.makedirs(root, exist_ok=True)  # a recipe of registered names writes no dataset_info.json first
        with open(config_path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh, sort_keys=False)
        runs = [Run(b, NAMES[b], options.recipe, roll_overrides(options, os.path.join(root, b)))
                for b in options.backends]
        out(f"llamafactory_parity: {options.recipe}, {options.steps} steps"
            + (", the file's order" if options.sequential else "") + "\n"
            + f"  LLaMA-Factory: {cli} train {config_path}\n"
            + "".join(f"  {NAMES[run.backend]}: {run.display()}\n" for run in runs) + "\n")
        log_path = os.path.join(root, "llamafactory.log")
        err(f"llamafactory_parity: training LLaMA-Factory ... (log: {log_path})\n")
        start = time.monotonic()
        code = run_llamafactory(cli, config_path, log_path, os.path.join(root, "cache"))
        if code != 0:
            err(f"llamafactory_parity: the LLaMA-Factory run failed (exit {code}): {cli} train {config_path}\n"
                "--- the end of its log ---\n" + "\n".join(log_tail(log_path)) + "\n")
            return 1
        err(f"llamafactory_parity: LLaMA-Factory done in {time.monotonic() - start:.1f} s\n")
        execute(runs, root, err, tool="llamafactory_parity")
        comparisons = compare_sides(read_llamafactory_log(lf_dir),
                                    {run.backend: read_log(run.output_dir) for run in runs}, options.steps,
                                    options.tolerance, options.first_step_tolerance)
        between = None
        if len(runs) == 2:  # issue 30: an example trains alike on roll's two backends (1e-3)
            between = compare(read_log(runs[0].output_dir), read_log(runs[1].output_dir), steps=options.steps,
                              tolerance=BACKENDS_TOLERANCE, first_step_tolerance=BACKENDS_TOLERANCE,
                              names=(NAMES["standard"], NAMES["mca"]))
        out(format_report(comparisons, between) + "\n")
        passed = all(c.passed for c in comparisons.values()) and (between is None or between.passed)
        return 0 if passed else 1
    except RollError as exc:
        err(f"llamafactory_parity: error: {exc}\n")
        return 2
    except RunFailed as exc:
        err(f"llamafactory_parity: {exc}: {exc.run.display()}\n--- the end of its log ---\n"
            + "\n".join(exc.tail) + "\n")
        return 1
    except KeyboardInterrupt:
        err("llamafactory_parity: interrupted\n")
        return 130
