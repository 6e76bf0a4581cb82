"""A/B of roll-bench's conversion block: two checkouts of roll, interleaved in one command, so that both
see the same load (the ledger's rule for speed comparisons on a shared machine).

    python scripts/bench_convert_ab.py --before /path/to/old/checkout --after . --model outputs/bench/model \
        --rounds 2 --work-dir /tmp/convert-ab
    python scripts/bench_convert_ab.py --before /path/to/old/checkout --after . --model outputs/bench/model \
        --in-process 4 --work-dir /tmp/convert-ab

Each round times, for ``before`` then ``after``: a raw safetensors read, ``roll-convert hf2mca`` and
``mca2hf`` (``roll.bench.convert.time_conversion``, run from that checkout), and prints the tables with the
load average. The model is any HF directory (roll-bench's is ``outputs/bench/model``).

``--in-process N``: N pairs per direction, the two checkouts alternating (before first in even pairs, after first
in odd ones), each a fresh process that imports the converter, then times ``convert_cli.run`` alone: wall and
CPU seconds (all threads) of the conversion without the start-up, whose variance under load (10-40 s on 2
shared cores) swamps the conversion in the whole-process rows, and the process's peak resident memory
(``VmHWM``, file pages it maps included) and peak anonymous memory (``RssAnon``, sampled every 10 ms), and its
minor page faults (``getrusage``), which, unlike the times, no other job on the machine changes: faulting in fresh
memory is most of what reading into it costs (``scripts/disk_floor.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roll.bench.convert import time_conversion  # noqa: E402
from roll.bench.report import conversion_table  # noqa: E402

_IN_PROCESS = """
import json, resource, sys, threading, time
from backends.mca import convert, convert_cli  # noqa: F401 - the start-up (roll-bench's import-only process), not timed
from roll.logging import setup_logging

def status(field):
    with open('/proc/self/status', encoding='ascii') as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ':'))

peak, done = [status('RssAnon')], threading.Event()
def sample():
    while not done.wait(0.01):
        peak[0] = max(peak[0], status('RssAnon'))
threading.Thread(target=sample, daemon=True).start()
setup_logging()
base_hwm, base_anon = status('VmHWM'), status('RssAnon')
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
wall, cpu = time.perf_counter(), time.process_time()
code = convert_cli.run(sys.argv[1:])
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
done.set()
peak[0] = max(peak[0], status('RssAnon'))
print(json.dumps({'code': code, 'wall_s': wall, 'cpu_s': cpu, 'minor_faults': faults, 'hwm': status('VmHWM'), 'base_hwm': base_hwm,
                  'anon_peak': peak[0], 'base_anon': base_anon}))
"""


def in_process(checkouts, model: str, work: str, pairs: int, timeout: float) -> dict:
    """``--in-process``: (direction, checkout) -> one row per run (see the module docstring)."""
    import shutil
    import subprocess

    from roll.bench.convert import safetensors_bytes

    size, results = safetensors_bytes(model) / 1e9, {}
    for pair in range(pairs):
        for name, repo in checkouts if pair % 2 == 0 else checkouts[::-1]:
            mca, back = os.path.join(work, name, "mca"), os.path.join(work, name, "hf")
            for direction, src, dst in (("hf2mca", model, mca), ("mca2hf", mca, back)):
                shutil.rmtree(dst, ignore_errors=True)
                load = os.getloadavg()[0]
                env = {**os.environ, "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1"}
                proc = subprocess.run([sys.executable, "-c", _IN_PROCESS, direction, "--input", src, "--output", dst],
                                      cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} {direction} failed:\n{proc.stderr[-2000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row.update(load=load, pair=pair)
                results.setdefault(f"{direction} {name}", []).append(row)
                print(f"pair {pair} {direction:6s} {name:6s} load {load:5.1f}: {row['wall_s']:6.2f} s wall "
                      f"({size / row['wall_s']:.2f} GB/s), {row['cpu_s']:5.2f} s CPU, {row['minor_faults']:6d} page faults, peak RSS "
                      f"+{(row['hwm'] - row['base_hwm']) / 1e9:.2f} GB, peak anonymous "
                      f"+{(row['anon_peak'] - row['base_anon']) / 1e9:.2f} GB", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="checkout of roll timed first in each round")
    parser.add_argument("--after", required=True, help="checkout of roll timed second in each round")
    parser.add_argument("--model", required=True, help="HF model directory to convert")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", default="outputs/convert-ab")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--in-process", type=int, default=0, metavar="N",
                        help="time the conversion inside the process instead, N alternating pairs (docstring)")
    args = parser.parse_args()
    model, work = os.path.abspath(args.model), os.path.abspath(args.work_dir)
    # resolved once, here: each round changes into a checkout, after which "." would be the other one
    checkouts = (("before", os.path.abspath(args.before)), ("after", os.path.abspath(args.after)))
    if args.in_process:
        results = in_process(checkouts, model, work, args.in_process, args.timeout)
        with open(os.path.join(work, "in_process.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
        return
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
