"""Run ``roll-train ARGS`` in this process and write its memory, for comparing with ``roll-train --plan``.

usage: python tests/distributed/_plan_measure.py OUT_PREFIX ROLL-TRAIN-ARGS...
       torchrun --nproc_per_node=2 tests/distributed/_plan_measure.py OUT_PREFIX ROLL-TRAIN-ARGS...

Writes ``OUT_PREFIX.rank{R}.json``: {"baseline": RSS after the imports, "peak": peak RSS of the process,
"delta": peak - baseline, "code": roll-train's exit code} in bytes. CPU peak RSS includes the Python/torch
runtime (hundreds of MB), so everything a run imports lazily is imported first: the delta is then what the
run allocates (model, gradients, optimizer states, activations; plus the small tokenizer and dataset).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import resource
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def import_everything(backend: str) -> None:
    """Import the backend package and the libraries its run imports lazily, so they land in the baseline."""
    import datasets  # noqa: F401
    import matplotlib.pyplot  # noqa: F401  (loss.png at the end of every run)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    names = ["trl", "peft", "transformers.trainer", "roll.router", "roll.data", "roll.plot"]
    if backend == "mca":
        names += ["megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
                  "megatron.core.pipeline_parallel"]
    package = importlib.import_module(f"backends.{backend}")
    names += [m.name for m in pkgutil.walk_packages(package.__path__, f"backends.{backend}.")]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra (e.g. DeepSpeed, Transformer Engine) is allowed to be missing
            pass


def main() -> int:
    prefix, argv = sys.argv[1], sys.argv[2:]
    from roll.config import parse_args

    _, config = parse_args(argv)  # the recipe may choose the backend, so ask the parser
    import_everything(config.backend_name)
    baseline = rss_bytes()
    from roll.cli import main as roll_train

    code = roll_train(argv)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{prefix}.rank{rank}.json", "w", encoding="utf-8") as fh:
        json.dump({"rank": rank, "baseline": baseline, "peak": peak, "delta": peak - baseline,
                   "code": code}, fh)
    return code


if __name__ == "__main__":
    sys.exit(main())
