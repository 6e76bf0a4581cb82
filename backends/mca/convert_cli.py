"""``roll-convert``: HF <-> Megatron checkpoint conversion and the logits parity check.

    roll-convert hf2mca --input HF_DIR --output OUT [LAYOUT]
    roll-convert mca2hf --input MCA_DIR --output HF_DIR [LAYOUT] [--max-shard-gb 2]
    roll-convert check  --input HF_DIR [LAYOUT] [--tolerance 1e-4] [--seq-len 16]

LAYOUT: --tp N --pp N --vpp N --ep N --etp N (sizes default to 1, --etp to --tp).

A layout that needs several ranks re-executes the command under torchrun on the fewest processes it needs
(tp * pp * dp, dp the smallest that etp * ep divides into tp * dp), as roll-train does for nproc_per_node.
Running it yourself under ``torchrun --nproc_per_node=N -m backends.mca.convert_cli ...`` works too.
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import sys
import time
from typing import NoReturn

from roll import launch
from roll.errors import EXIT_USAGE, RollError

logger = logging.getLogger("backends.mca.convert_cli")  # also when run as __main__ (python -m)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for options that have one (not for required ones or None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def _parser(epilog: bool = True) -> argparse.ArgumentParser:
    """``epilog`` False: without the memory arithmetic that only ``--help`` shows (``roll.plan``'s import, which a
    conversion does not need)."""
    memory = _memory_epilog() if epilog else None
    parser = argparse.ArgumentParser(prog="roll-convert", description=__doc__.split("\n")[0], epilog=memory)
    sub = parser.add_subparsers(dest="command", required=True)
    specs = {"hf2mca": "HF checkpoint -> Megatron checkpoint (torch_dist + mca_config.json)",
             "mca2hf": "Megatron checkpoint -> standard HF safetensors checkpoint",
             "check": "build the HF and the Megatron model from HF_DIR and compare their logits"}
    for name, help_text in specs.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_DefaultsFormatter,
                             epilog=memory if name != "check" else None)
        cmd.add_argument("--input", required=True, metavar="DIR", help="source model directory")
        if name != "check":
            cmd.add_argument("--output", required=True, metavar="DIR", help="directory to write")
        cmd.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size")
        cmd.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel size")
        cmd.add_argument("--vpp", type=_positive_int, default=None, help="virtual pipeline stages per pipeline rank")
        cmd.add_argument("--ep", type=_positive_int, default=1, help="expert parallel size")
        cmd.add_argument("--etp", type=_positive_int, default=None, help="expert tensor parallel size (default: tp)")
        if name == "check":
            cmd.add_argument("--tolerance", type=float, default=1e-4, help="max allowed |HF - Megatron| logit")
            cmd.add_argument("--seq-len", type=_positive_int, default=16, help="tokens per sample of the random batch")
        if name == "mca2hf":
            cmd.add_argument("--max-shard-gb", type=float, default=2.0, help="max size of one safetensors file")
            cmd.add_argument("--trust-checkpoint-pickles", action="store_true",
                             help="load --input even if its pickle files (.metadata, common.pt, .distcp bytes) "
                                  "name Python objects beyond roll's allow-list, which can run code "
                                  "(docs/reliability.md)")
    return parser


def _memory_epilog() -> str:
    from roll.plan.convert import conversion_memory_line

    return (f"{conversion_memory_line()} The HF side streams shard by shard; the Megatron checkpoint is "
            "written from this process with I/O threads; a progress bar with GB/s goes to stderr "
            "(docs/mca-models.md, 'The converter').")


def processes_needed(args: argparse.Namespace) -> int:
    """The fewest ranks the layout runs on: tp * pp * dp, with dp the smallest that lets etp * ep divide
    tp * dp (Megatron folds the expert layout into the same ranks; cp is 1 here)."""
    expert = (args.etp or args.tp) * args.ep
    return args.tp * args.pp * (math.lcm(args.tp, expert) // args.tp)


def run(argv: list[str] | None = None) -> int:
    """Parse and run one command; returns the process exit code (1: check failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(epilog=bool({"-h", "--help"} & set(argv))).parse_args(argv)
    from roll.model_dir import check_model_exists

    check_model_exists(args.input, "--input")  # before torchrun, torch or megatron start
    nproc = processes_needed(args)
    if nproc > 1 and not launch.inside_launcher():
        outcome = launch.relaunch_tool("backends.mca.convert_cli", argv, nproc)
        if outcome.message:
            print(f"roll-convert: error: {outcome.message}", file=sys.stderr, flush=True)
        return outcome.code
    from backends.mca import convert

    started = time.perf_counter()  # the imports done: what follows is the conversion itself
    # The one ParallelLayout of this command (and the settings it came from), as a training run builds it.
    megatron, layout = convert.megatron_settings(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if args.command == "hf2mca":
        convert.hf_to_mca(args.input, args.output, megatron, layout)
        _log_converted("hf2mca", args.input, started)
        return 0
    if args.command == "mca2hf":
        from roll import unpickle

        unpickle.set_trusted(args.trust_checkpoint_pickles)
        unpickle.check_folder(args.input)  # refused before any process group or model exists
        convert.mca_to_hf(args.input, args.output, megatron, layout, max_shard_bytes=int(args.max_shard_gb * 1024**3))
        _log_converted("mca2hf", args.output, started)
        return 0
    diff = convert.check_parity(args.input, megatron, layout, seq_len=args.seq_len)
    ok = diff <= args.tolerance
    if rank0:
        print(f"max |HF - Megatron| logit difference: {diff:.3e} (tolerance {args.tolerance:.1e}, tp {args.tp} "
              f"pp {args.pp} vpp {args.vpp or 1} ep {args.ep}): {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


def _log_converted(command: str, hf_dir: str, started: float) -> None:
    """One line on rank 0: the conversion's own time and speed (from after the imports to its files written and
    closed; ``roll-bench`` reads it) and the start-up before it (the process's age when the conversion began)."""
    from roll.logging import log_rank0

    seconds = time.perf_counter() - started
    gb = sum(os.path.getsize(path) for path in glob.glob(os.path.join(hf_dir, "*.safetensors"))) / 1e9
    log_rank0(logger, "%s: converted %.3f GB of HF weights in %.2f s (%.2f GB/s) after %.1f s of start-up",
              command, gb, seconds, gb / max(seconds, 1e-9), _age() - seconds)


def _age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            started = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - started / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    """``roll-convert`` in this process: raises SystemExit with the exit code (scripts and tests call it)."""
    sys.exit(_command(argv))


def command() -> NoReturn:
    """The ``roll-convert`` command (its entry point, and ``python -m backends.mca.convert_cli``): once its files
    are written the process ends without Python's finalization (``roll.fast_exit``)."""
    from roll.fast_exit import end_process

    end_process(_command(None))


def _command(argv: list[str] | None) -> int:
    from roll.logging import setup_logging

    setup_logging()
    message = ""
    try:
        code = run(argv)
    except RollError as err:
        code, message = EXIT_USAGE, str(err)
        if not launch.under_roll_launcher():  # else the roll-convert that launched this rank says it once
            print(f"roll-convert: error: {err}", file=sys.stderr, flush=True)
    finally:
        _shutdown()
    launch.write_status(code, message)  # a no-op unless roll-convert launched this rank
    return code


def _shutdown() -> None:
    """Tear down Megatron/torch.distributed if a command brought them up."""
    if "backends.mca.initialize" in sys.modules:
        from backends.mca.initialize import destroy_megatron

        try:
            destroy_megatron()
        except Exception:  # noqa: BLE001 - best effort at exit; the command's result is already decided
            pass


if __name__ == "__main__":
    command()
