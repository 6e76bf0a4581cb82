"""roll against LLaMA-Factory on the same model, data and settings, whole command to whole command
(roll/bench/side_by_side.py says what is compared and how; docs/performance.md has the results).

usage: python scripts/side_by_side_llamafactory.py [--rounds 3] [--steps 12] [--batch-size 2]
           [--llamafactory-cli PATH] [--work-dir outputs/side_by_side] [--json-out FILE]

LLaMA-Factory is not a roll dependency: install it in a venv of its own (its transformers/trl/peft pins
differ from roll's), e.g. `python3.11 -m venv lf && lf/bin/pip install torch==2.13.0 llamafactory==0.9.5`,
and pass --llamafactory-cli lf/bin/llamafactory-cli (default: $LLAMAFACTORY_CLI, else llamafactory-cli on
PATH). Without it the script says so and exits 0 without running anything.
Prints a markdown table: per tool the median wall time and its phases, and LLaMA-Factory's wall time over
roll's per round (>= 1: roll as fast or faster), with the load average.
"""

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from roll.bench import side_by_side as sbs  # noqa: E402
from roll.logging import setup_logging  # noqa: E402

logger = logging.getLogger("roll.scripts.side_by_side")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--cutoff-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (default: all cores)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    parser.add_argument("--tools", default=",".join(sbs.TOOLS), help="a subset of " + ",".join(sbs.TOOLS))
    parser.add_argument("--llamafactory-cli", default=os.environ.get("LLAMAFACTORY_CLI") or "llamafactory-cli")
    parser.add_argument("--work-dir", default="outputs/side_by_side")
    parser.add_argument("--json-out", help="default: WORK_DIR/side_by_side.json")
    args = parser.parse_args()
    setup_logging()
    tools = tuple(t for t in args.tools.split(",") if t)
    if set(tools) - set(sbs.TOOLS) or "llamafactory" not in tools:
        parser.error(f"--tools takes llamafactory plus standard and/or mca, got {args.tools!r}")
    cli = shutil.which(args.llamafactory_cli) or args.llamafactory_cli
    version = sbs.llamafactory_version(cli)
    if version is None:
        print(f"skipped: LLaMA-Factory is not installed ({args.llamafactory_cli!r} does not run `version`). "
              "Install it in a venv of its own and pass --llamafactory-cli VENV/bin/llamafactory-cli.")
        return 0
    settings = sbs.Settings(steps=args.steps, batch_size=args.batch_size, cutoff_len=args.cutoff_len,
                            threads=args.threads, timeout=args.timeout)
    root = os.path.abspath(args.work_dir)
    paths = {"model": sbs.prepare_model(os.path.join(root, "model")), "data_dir": os.path.join(root, "data")}
    paths["data"] = sbs.prepare_data(paths["data_dir"], settings)
    load_start = [round(x, 2) for x in os.getloadavg()]
    results = []
    for index in range(args.rounds):
        for tool in (t for t in sbs.round_order(index) if t in tools):
            logger.info("round %d: %s ...", index + 1, tool)
            results.append(sbs.run_one(tool, index, root, paths, settings, cli))
            r = results[-1]
            logger.info("round %d: %s %s, %.1f s wall", index + 1, tool, r.status, r.wall_s)
    summary = sbs.ratios(results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, timeout=30).stdout.strip()
    header = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": "python scripts/side_by_side_llamafactory.py " + " ".join(sys.argv[1:]),
              "commit": commit or "?", "llamafactory_version": version,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()],
              "settings": f"bench model (Qwen2, hidden 512, 8 layers, 151,936-token vocabulary), sft, full, fp32, "
                          f"1 process, {settings.steps} steps of {settings.batch_size} rows, cutoff_len "
                          f"{settings.cutoff_len}, lr {settings.learning_rate:g} constant, final model saved, "
                          f"{settings.threads or os.cpu_count()} threads, a fresh datasets cache per run"}
    text = sbs.markdown(results, summary, header)
    print(text)
    json_out = args.json_out or os.path.join(root, "side_by_side.json")
    with open(json_out, "w", encoding="utf-8") as fh:
        json.dump({"header": header, "summary": summary, "runs": sbs.result_dicts(results)}, fh, indent=1)
    failed = [f"{r.tool} round {r.round + 1}: {r.status}" for r in results if r.status != "ok"]
    for line in failed:
        logger.warning("%s (log: %s/runs/)", line, root)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
