"""Where a training step's time goes: plain HF Trainer, the standard and the mca backends, side by side.

Each runner trains the ``roll-bench`` model on the bench data (same recipe as ``roll-bench``'s case of that
runner) in its own process; ``torch.profiler`` records the CPU ops of the steps after the warm-up only
(started and stopped by a global optimizer-step hook, so start-up, loading and conversion are left out) and
the table prints each op's self time per step, biggest first, with the runners in columns.

    python scripts/profile_mca_step.py                       # hf and mca, seq 256, 1 warm-up + 3 steps
    python scripts/profile_mca_step.py --runners hf,standard,mca --seq 1024 --top 40
    python scripts/profile_mca_step.py --packing --rounds 3 --no-ops --threads 1   # an A/B of per-step time

``--rounds N`` runs the runners N times in rotated order (A B, B A, ...) so that a change of the machine's load
hits each alike, and prints each runner's per-step wall and CPU seconds (this process's user + system time over
the profiled steps: on a machine shared with other jobs less distorted than wall time) as the median over the
rounds, with the ratio to the first runner. ``--no-ops`` leaves the profiler off (its per-op bookkeeping costs
most where a runner runs the most small ops).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROUPS = (("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
          ("optimizer", ("adam", "foreach", "lerp", "addcdiv", "addcmul", "sqrt")),
          ("copies", ("copy_", "contiguous", "clone", "to", "_to_copy", "cat", "stack")),
          ("loss", ("log_softmax", "logsumexp", "cross_entropy", "nll_loss", "exp", "softmax")))
"""Op-name groups of the summary (an op goes to the first group one of whose words its name contains)."""


def _group(name: str) -> str:
    base = name.removeprefix("aten::").lower()
    for group, words in GROUPS:
        if any(base == w or base.startswith(w + "_") or w in ("adam", "foreach") and w in base for w in words):
            return group
    return "other"


def child(runner: str, recipe: str, output_dir: str, out_json: str, warmup: int, steps: int,
          ops: bool = True) -> None:
    """Run one runner in this process; profile the optimizer steps ``warmup+1 .. warmup+steps`` (their ops
    with ``ops``, always their wall and CPU seconds)."""
    import time

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if ops else None
    seen = {"steps": 0, "start": 0.0, "wall": 0.0, "cpu_start": 0.0, "cpu": 0.0}

    def hook(optimizer, args, kwargs) -> None:
        seen["steps"] += 1
        if seen["steps"] == warmup:
            seen["start"], seen["cpu_start"] = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.start()
        elif seen["steps"] == warmup + steps:
            if profiler is not None:
                profiler.stop()
            seen["wall"] = time.perf_counter() - seen["start"]
            seen["cpu"] = time.process_time() - seen["cpu_start"]

    register_optimizer_step_post_hook(hook)
    if runner == "hf":
        sys.argv = ["roll.bench.hf", recipe, output_dir]
        module = "roll.bench.hf"
    else:
        sys.argv = ["roll.cli", recipe] + (["--use-mca"] if runner == "mca" else [])
        module = "roll.cli"
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    table = {}
    for event in profiler.key_averages() if profiler is not None else ():
        table[event.key] = {"self_us": event.self_cpu_time_total, "count": event.count}
    with open(out_json, "w", encoding="utf-8") as fh:
        json.dump({"ops": table, "wall_s": seen["wall"], "cpu_s": seen["cpu"], "steps": steps,
                   "optimizer_steps": seen["steps"]}, fh)


def run(args) -> dict[str, dict]:
    from roll.bench.cli import Case, case_env, case_recipe
    from roll.bench.prepare import BenchOptions, prepare_data, prepare_model

    options = BenchOptions(steps=args.steps, warmup=args.warmup, seqs=(args.seq,), threads=args.threads,
                           work_dir=args.work_dir, tokens_per_step=args.tokens_per_step)
    root = os.path.abspath(args.work_dir)
    model_dir, _ = prepare_model(os.path.join(root, "model"), "bench")
    data_path = prepare_data(os.path.join(root, "data.jsonl"), options, None)
    results: dict[str, list[dict]] = {entry: [] for entry in args.runners}
    for round_ in range(args.rounds):
        shift = round_ % len(args.runners)
        for entry in args.runners[shift:] + args.runners[:shift]:
            runner, _, repo = entry.partition("@")  # mca@/path/to/other/checkout: that checkout's code
            case = Case(runner, "1p", "fp32", args.seq, args.packing)
            out = os.path.join(root, "profile", case.name + ("-" + os.path.basename(repo) if repo else ""))
            os.makedirs(out, exist_ok=True)
            recipe = case_recipe(case, options, model_dir, data_path, out)
            recipe["max_steps"] = args.warmup + args.steps
            recipe_path = out + ".yaml"
            with open(recipe_path, "w", encoding="utf-8") as fh:
                json.dump(recipe, fh)
            out_json = out + ".json"
            command = [sys.executable, __file__, "--child", runner, recipe_path, out, out_json,
                       str(args.warmup), str(args.steps), "0" if args.no_ops else "1"]
            env = {**case_env(case, options), "PYTHONPATH": os.path.abspath(repo or REPO)}
            with open(out + ".log", "w", encoding="utf-8") as log:
                subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                               check=True)
            with open(out_json, encoding="utf-8") as fh:
                results[entry].append(json.load(fh))
    return results


def rounds_report(results: dict[str, list[dict]]) -> str:
    """Per-step wall and CPU seconds of each runner: every round, the median, the ratio to the first runner."""
    import statistics

    first = next(iter(results))
    median = {entry: {key: statistics.median(run[key] / run["steps"] for run in runs) for key in ("wall_s", "cpu_s")}
              for entry, runs in results.items()}
    lines = [f"{'s per step':<24}{'wall (each round)':>32}{'median':>8}{'cpu (each round)':>32}{'median':>8}"
             f"{'cpu vs ' + first[-10:]:>18}"]
    for entry, runs in results.items():
        walls = " ".join(f"{run['wall_s'] / run['steps']:.2f}" for run in runs)
        cpus = " ".join(f"{run['cpu_s'] / run['steps']:.2f}" for run in runs)
        lines.append(f"{entry[-24:]:<24}{walls:>32}{median[entry]['wall_s']:>8.2f}{cpus:>32}"
                     f"{median[entry]['cpu_s']:>8.2f}{median[entry]['cpu_s'] / median[first]['cpu_s']:>17.3f}x")
    return "\n".join(lines)


def report(results: dict[str, dict], top: int) -> str:
    """Per-step milliseconds (of one round): wall, the groups, then the ``top`` ops by their largest self time."""
    runners = list(results)
    per_step = {r: {k: v["self_us"] / 1e3 / results[r]["steps"] for k, v in results[r]["ops"].items()}
                for r in runners}
    head = f"{'ms per step':<44}" + "".join(f"{r[-11:]:>12}" for r in runners)
    lines = [head, "-" * len(head),
             f"{'wall':<44}" + "".join(f"{results[r]['wall_s'] * 1e3 / results[r]['steps']:>12.0f}"
                                       for r in runners)]
    for group in [g for g, _ in GROUPS] + ["other"]:
        cells = [sum(ms for op, ms in per_step[r].items() if _group(op) == group) for r in runners]
        lines.append(f"{'  ' + group:<44}" + "".join(f"{c:>12.0f}" for c in cells))
    lines.append("-" * len(head))
    names = sorted({op for r in runners for op in per_step[r]}, key=lambda op: -max(per_step[r].get(op, 0)
                                                                                   for r in runners))
    for op in names[:top]:
        lines.append(f"{op[:44]:<44}" + "".join(f"{per_step[r].get(op, 0):>12.1f}" for r in runners))
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        runner, recipe, output_dir, out_json, warmup, steps, ops = sys.argv[2:9]
        child(runner, recipe, output_dir, out_json, int(warmup), int(steps), ops == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=lambda s: s.split(","), default=["hf", "mca"],
                        help="comma-separated: hf (plain Trainer), standard, mca; RUNNER@DIR runs the code of the "
                             "checkout DIR (an A/B of two branches)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--tokens-per-step", type=int, default=512, help="global batch in tokens, as roll-bench")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps before the profiled ones")
    parser.add_argument("--steps", type=int, default=3, help="profiled optimizer steps")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--top", type=int, default=25, help="ops listed")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every runner, in rotated order")
    parser.add_argument("--no-ops", action="store_true", help="no per-op profile: wall and CPU seconds only")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--work-dir", default="outputs/bench")
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    results = run(args)
    if not args.no_ops:
        print(report({entry: runs[-1] for entry, runs in results.items()}, args.top))
    print(rounds_report(results))


if __name__ == "__main__":
    main()
