"""``python -m roll.torchrun ARGS``: torchrun, minus its Python traceback when a rank fails.

torchrun ends a failed job by raising ``ChildFailedError`` out of its ``main``, so every failed run shows a
traceback of the launcher itself, even when a rank stopped cleanly on a user's mistake (exit code 2) and
already said why. roll-train launches ranks through this module instead: the same argument parser and
launch (``torch.distributed.run.run``), torchrun's one-line log of which rank failed, and exit code 1.
roll-train then reports the ranks' own exit codes (``roll.launch.summarize``). A stop signal to torchrun
itself (SLURM signals every process of a job step) ends it with 128 + the signal, without a traceback.

Its rendezvous store listens on ``--master_addr`` only, not on every interface (``roll.listen``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from roll.listen import patch_torchrun_store

    patch_torchrun_store()
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError:
        return 1
    except SignalException as exc:
        # SLURM signals every process of a step, this launcher too: torchrun has given its ranks SIGTERM and
        # up to 30 s (they finish their step and save, then report to roll-train); its traceback adds nothing
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    from roll.fast_exit import end_process

    end_process(main())  # without the interpreter's finalization (0.7 s with torch loaded): roll.fast_exit
