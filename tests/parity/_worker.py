"""Worker: many roll-train runs in one process, as the parity sweep groups them.

usage: python _worker.py SPEC.json RESULT.json              (standard runs, one process)
       torchrun --nproc_per_node=N _worker.py SPEC.json RESULT.json   (mca runs)

SPEC.json: {"runs": [{"label": str, "args": [roll-train arguments]}, ...]}. Each run trains in this process
through the production path (roll.cli.main for the standard backend, which trains in-process at one
process; roll.router.run under torchrun, with the process group kept across runs and Megatron brought up
and torn down per run). A failed run is recorded and the next one starts, so that one broken case does not
hide the others. Rank 0 writes {label: {"ok": bool, "error": str, "seconds": float}} to RESULT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _train(args: list[str], distributed: bool) -> None:
    if not distributed:
        from roll.cli import main

        code = main(args)
        if code != 0:
            raise RuntimeError(f"roll-train exited {code}")
        return
    from roll.config.parser import parse_args
    from roll.router import run

    run(parse_args(args)[1])


def main() -> None:
    spec_file, result_file = sys.argv[1:]
    with open(spec_file, encoding="utf-8") as fh:
        spec = json.load(fh)
    distributed = "WORLD_SIZE" in os.environ
    rank = 0
    if distributed:
        import torch.distributed as dist

        from roll.logging import setup_logging

        setup_logging("WARNING")
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    results = {}
    for item in spec["runs"]:
        start = time.monotonic()
        try:
            _train(item["args"], distributed)
            results[item["label"]] = {"ok": True, "error": "", "seconds": time.monotonic() - start}
        except Exception:  # noqa: BLE001 - recorded for the test's message; the next run goes on
            results[item["label"]] = {"ok": False, "error": traceback.format_exc()[-3000:],
                                      "seconds": time.monotonic() - start}
        if distributed:
            dist.barrier()
    if rank == 0:
        with open(result_file, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
