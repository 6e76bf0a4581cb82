"""Worker: demo recipes on the mca backend, one after another in this torchrun job (roll.router.run).

usage: torchrun --nproc_per_node=N _mca_worker.py SPEC.json RESULT.json

SPEC.json: [{"name": str, "args": [roll-train arguments]}, ...]. Rank 0 writes {name: [per-step losses]}.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main() -> None:
    import torch.distributed as dist

    from roll.config.parser import parse_args
    from roll.logging import setup_logging
    from roll.router import run

    spec_file, result_file = sys.argv[1:]
    with open(spec_file, encoding="utf-8") as fh:
        spec = json.load(fh)
    setup_logging("WARNING")
    dist.init_process_group("gloo")
    results = {}
    for item in spec:
        _, config = parse_args(item["args"] + [f"nproc_per_node={dist.get_world_size()}"])
        result = run(config)
        results[item["name"]] = [entry["loss"] for entry in result.log_history if "loss" in entry]
        dist.barrier()
    if dist.get_rank() == 0:
        with open(result_file, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
