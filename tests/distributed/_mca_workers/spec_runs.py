"""The driver the recipe-run workers share (train_runs.py, export_checks.py, reward_checks.py): one torchrun job
reads SPEC.json, trains each of its runs in this process (``roll.router.run``, the production path) and writes
rank 0's results to RESULT.json.

usage of a worker: torchrun --nproc_per_node=N WORKER.py SPEC.json RESULT.json, with SPEC.json
{"base": {recipe keys}, "runs": [{"name": str, "overrides": {key: value}, ...}, ...]}.
"""

from __future__ import annotations

import json
import sys
from typing import Callable


def recipe_config(spec: dict, item: dict, **keys):
    """A run's config: ``base`` + ``use_mca`` + the launch's ``nproc_per_node`` + ``keys``, then the run's
    ``overrides`` given as a command line gives them (strings)."""
    import torch.distributed as dist

    from roll.config.parser import resolve

    recipe = {**spec.get("base", {}), "use_mca": True, "nproc_per_node": dist.get_world_size(), **keys}
    return resolve(recipe, {key: str(value) for key, value in item.get("overrides", {}).items()}, None)


def main(run_one: Callable[[dict, dict], object], setup: Callable[[], None] | None = None) -> None:
    """``run_one(spec, item)`` for each run of SPEC.json (argv[1]) under gloo, a barrier after each; rank 0 writes
    {name: what run_one returned on rank 0} to RESULT.json (argv[2]). ``setup`` runs once, after the process
    group is up."""
    import torch.distributed as dist

    from roll.logging import setup_logging

    spec_file, result_file = sys.argv[1:]
    with open(spec_file, encoding="utf-8") as fh:
        spec = json.load(fh)
    setup_logging("WARNING")
    dist.init_process_group("gloo")
    if setup is not None:
        setup()
    results = {}
    for item in spec["runs"]:
        results[item["name"]] = run_one(spec, item)
        dist.barrier()
    if dist.get_rank() == 0:
        with open(result_file, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()
