"""How long roll-train takes to answer what needs no model: --help, a mistyped key, --print-config.

usage: python scripts/startup_time.py [--runs 5]

Each case runs ``python -m roll.cli ...`` as a fresh process ``--runs`` times and reports the median wall
time. Targets (issue 33): --help under 1.5 s, a mistyped key rejected under 2 s, --print-config under 2 s,
on 2 busy cores. Exits 1 when a median misses its target. (A measurement, not a test: timings on shared CI
cores are noise; tests/unit/test_startup.py checks the cause instead: no transformers/torch import.)
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = (
    ("--help", ["--help"], 0, 1.5),
    ("mistyped key", ["recipes/qwen_sft.yaml", "learning_rat=1e-5"], 2, 2.0),
    ("--print-config", ["recipes/qwen_sft.yaml", "--print-config"], 0, 2.0),
    ("--print-config --use-mca", ["recipes/qwen_sft.yaml", "--use-mca", "--print-config"], 0, 2.0),
)
"""(name, roll-train arguments, expected exit code, target seconds)."""


def time_once(args: list[str], expected: int) -> float:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "roll.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    wall = time.perf_counter() - start
    if proc.returncode != expected:
        raise SystemExit(f"roll-train {' '.join(args)} exited {proc.returncode}, expected {expected}:\n"
                         f"{proc.stderr[-2000:]}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="processes per case (the median is reported)")
    args = parser.parse_args()
    missed = 0
    for name, argv, expected, target in CASES:
        times = [time_once(argv, expected) for _ in range(args.runs)]
        median = statistics.median(times)
        ok = median <= target
        missed += not ok
        print(f"{'OK  ' if ok else 'SLOW'}  {name:26s} median {median:.2f} s (min {min(times):.2f}, "
              f"max {max(times):.2f}, {args.runs} runs; target {target:.1f} s)", flush=True)
    try:
        load = os.getloadavg()[0]
        print(f"load average {load:.1f} on {os.cpu_count()} cores")
    except OSError:
        pass
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
