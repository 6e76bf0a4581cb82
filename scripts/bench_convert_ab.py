"""A/B of roll-bench's conversion block: two checkouts of roll, interleaved in one command, so that both
see the same load (the ledger's rule for speed comparisons on a shared machine).

    python scripts/bench_convert_ab.py --before /path/to/old/checkout --after . --model outputs/bench/model \
        --rounds 2 --work-dir /tmp/convert-ab

Each round times, for ``before`` then ``after``: a raw safetensors read, ``roll-convert hf2mca`` and
``mca2hf`` (``roll.bench.convert.time_conversion``, run from that checkout), and prints the tables with the
load average. The model is any HF directory (roll-bench's is ``outputs/bench/model``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roll.bench.convert import time_conversion  # noqa: E402
from roll.bench.report import conversion_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="checkout of roll timed first in each round")
    parser.add_argument("--after", required=True, help="checkout of roll timed second in each round")
    parser.add_argument("--model", required=True, help="HF model directory to convert")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", default="outputs/convert-ab")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    model, work = os.path.abspath(args.model), os.path.abspath(args.work_dir)
    # resolved once, here: each round changes into a checkout, after which "." would be the other one
    checkouts = (("before", os.path.abspath(args.before)), ("after", os.path.abspath(args.after)))
    results: dict[str, list] = {}
    for round_ in range(args.rounds):
        for name, repo in checkouts:
            os.environ["PYTHONPATH"] = repo  # the converter subprocesses import this checkout
            os.chdir(repo)
            load = os.getloadavg()
            rows = time_conversion(model, os.path.join(work, name), timeout=args.timeout)
            print(f"## {name} (round {round_}, {repo}), load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
                  f"at start, {os.getloadavg()[0]:.1f} at end")
            print("\n".join(conversion_table(rows)), flush=True)
            results.setdefault(name, []).append(rows)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "ab.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
