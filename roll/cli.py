"""roll-train: parse the recipe, launch processes if asked, call the stage router."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import typing

import yaml

from roll import __version__
from roll.errors import (EXIT_DIVERGED, EXIT_HUNG, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USAGE, Preempted,
                         RollError, TrainingStopped)
from roll.logging import get_rank

USAGE = """usage: roll-train [RECIPE.yaml] [key=value | --key value | --flag ...] [--use-mca]
                  [--print-config] [--dry-run [--json]] [--plan [--json] [gpu_memory_gb=80]]
                  [--prepare-data] [--sbatch] [--help]

Train a model with one recipe on either backend: the standard one (HF Trainer / TRL + DeepSpeed)
or, with --use-mca, Megatron-Core. Precedence: defaults < recipe < command line.

switches:
  --print-config   print the resolved config as YAML (with --use-mca, also its parallel layout) and exit;
                   loads nothing
  --dry-run        build tokenizer, dataset and collator, print a data summary and one example, exit
  --plan           print the per-rank GPU memory (parameters, gradients, optimizer states, activations) of this
                   layout and whether it fits gpu_memory_gb (a key, default 80); loads nothing (docs/planner.md)
  --prepare-data   tokenize (and pack) the data into tokenized_path and exit: on a CPU machine, before the
                   GPU job, which then loads it (docs/data.md, 'Preparing data once'); loads no model
  --sbatch         print an sbatch script that runs this command on SLURM, nnodes x nproc_per_node tasks (one
                   per GPU), saving and requeueing on SLURM's early warning (docs/slurm.md); loads nothing
  --json           with --dry-run, --plan or --prepare-data: print the summary / plan as one JSON object
  --help           this text
"""


def format_help() -> str:
    from roll.config import GROUPS
    from roll.config.coerce import describe
    from roll.config.docs import field_doc

    lines = [USAGE]
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        lines.append(f"{group} arguments ({cls.__name__}):")
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            default = f.default if f.default is not dataclasses.MISSING else "(computed)"
            lines.append(f"  --{f.name} {describe(hints.get(f.name, str))}  (default: {default})")
            doc = field_doc(cls, f) or "(no description)"
            lines.extend(textwrap.wrap(doc, width=100, initial_indent="      ", subsequent_indent="      "))
        lines.append("")
    lines.append("LLaMA-Factory's other keys (read under the names above, without effect, or refused naming what "
                 "to use): docs/keys.md, docs/llamafactory.md.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from roll import redact

    argv = list(sys.argv[1:] if argv is None else argv)
    argv += redact.inherited_secrets()  # secret keys roll-train's launcher passed in the environment
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from roll.logging import setup_logging

    setup_logging()
    if not argv:  # a bare roll-train: what to type, not a complaint about model_name_or_path
        sys.stderr.write(USAGE + "\nGive a recipe, e.g. `roll-train recipes/demo/tiny_sft.yaml` (its tiny model: "
                         "`python scripts/make_tiny_model.py --out .demo/tiny-qwen2`); every key: "
                         "`roll-train --help`.\n")
        return EXIT_USAGE
    try:
        from roll.config import parse_args

        _adopt_slurm(argv)
        options, config = parse_args(argv)
        if options.help:
            sys.stdout.write(format_help())
            return 0
        if options.version:
            sys.stdout.write(f"roll-train {__version__}\n")
            return 0
        if options.print_config:
            sys.stdout.write(yaml.safe_dump(redact.redact(_printable(config)), sort_keys=False))
            return 0
        if options.sbatch:
            from roll import slurm

            t = config.training
            sys.stdout.write(slurm.sbatch_script(options.recipe, argv, t.nnodes, t.nproc_per_node,
                                                 config.explicit_keys))
            return 0
        if options.plan:
            from roll.plan.planner import plan_run

            plan = plan_run(config)
            sys.stdout.write(json.dumps(plan.to_dict()) + "\n" if options.json else plan.format())
            return 0
        if options.prepare_data:
            from roll import router

            router.prepare_data(config, as_json=options.json)
            return 0
        if options.dry_run:  # the tokenizer (and, with --use-mca, the model's config) must be on this machine
            from roll import preflight, router

            preflight.check_model_paths(config)
            router.run(config, dry_run=True, as_json=options.json)
            return 0
        return _train(config, argv)
    except RollError as exc:
        return _report(EXIT_USAGE, str(exc))
    except TrainingStopped as exc:
        return _report(exc.exit_code, str(exc))
    except KeyboardInterrupt:
        sys.stderr.write("roll-train: interrupted\n")
        return EXIT_INTERRUPTED


def _adopt_slurm(argv: list[str]) -> None:
    """A task of a multi-task ``srun`` step is one rank (or one node) of one run: map SLURM's variables to the
    launcher's before the config reads them (``roll.slurm``)."""
    from roll import slurm
    from roll.config.parser import peek

    slurm.adopt(peek(argv, ("nproc_per_node", "master_addr", "master_port")))


def _printable(config) -> dict:
    """--print-config's mapping: every group, and with --use-mca the parallel layout it resolves to."""
    resolved = config.to_dict()
    layout = config.layout
    if layout is not None:
        resolved["layout"] = {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp,
                              "vpp": layout.vpp_size, "cp": layout.cp, "dp": layout.dp, "ep": layout.ep,
                              "etp": layout.expert_tp, "sequence_parallel": layout.sequence_parallel}
    return resolved


def _train(config, argv: list[str]) -> int:
    """Check what files alone can tell, lock output_dir (``roll.lock``), then launch ranks or train here."""
    from roll import launch, lock
    from roll.preflight import check_before_training

    check_before_training(config, launching=launch.needs_launch(config))
    held = lock.acquire(config.training.output_dir) if lock.takes_lock(config.training) else None
    try:
        if launch.needs_launch(config):
            outcome = launch.relaunch(config, argv, inherit=held.fd if held else None)
            if outcome.message:
                sys.stderr.write(f"roll-train: {_LABELS.get(outcome.code, 'error')}: {outcome.message}\n")
            return outcome.code
        from roll import reliability, router

        reliability.STOP.install(config.training.slurm_signum, config.training.slurm_requeue)
        try:
            router.run(config)
        except Preempted as exc:
            if reliability.STOP.requeued and get_rank() == 0:  # the early warning's checkpoint is complete
                from roll import slurm

                raise Preempted(f"{exc} {slurm.requeue()}") from None
            raise
        except Exception as exc:
            hung = reliability.collective_failure(exc, config.training.ddp_timeout)
            if hung is None:
                raise
            raise hung from None
        finally:  # a caller that trains in-process (notebook, test) gets its own signal handlers back
            reliability.STOP.uninstall()
        return 0
    finally:
        if held is not None:
            held.release()


_LABELS = {EXIT_USAGE: "error", EXIT_DIVERGED: "stopped", EXIT_HUNG: "error", EXIT_PREEMPTED: "stopped"}


def _report(code: int, message: str) -> int:
    """End this process with ``code``. A rank under roll-train's launcher reports to it (which shows the
    message once for all ranks); a rank that stopped together with all others (preempted, diverged)
    then exits 0 so the launcher does not tear the job down as failed."""
    from roll import launch

    if launch.under_roll_launcher():
        launch.write_status(code, message)
        return 0 if code in (EXIT_PREEMPTED, EXIT_DIVERGED) else code
    sys.stderr.write(f"roll-train: {_LABELS.get(code, 'error')}: {message}\n")
    return code


def command() -> typing.NoReturn:
    """The ``roll-train`` command (its entry point, and ``python -m roll.cli`` in each launched rank): ``main`` on
    this process's arguments, then the process ends without Python's finalization (``roll.fast_exit``: 1.7-1.9 s
    after a tiny run's last line on the 2-core dev VM). Code that trains in-process calls ``main(argv)``."""
    from roll.fast_exit import end_process

    end_process(main())


if __name__ == "__main__":
    command()
