"""Where an mca training step's time goes on each rank: compute, gradient communication, optimizer, copies.

usage: python scripts/profile_mca_ranks.py RECIPE [KEY=VALUE ...] [--nproc 2] [--warmup 2] [--out DIR]

Trains ``RECIPE`` with ``--use-mca`` on ``--nproc`` local processes (torchrun, 1 thread each, as roll-train
launches them; ``--nproc 1`` runs in this process with every core) and, on every rank, after ``--warmup``
steps:

- times each step's phases with ``time.perf_counter`` around the loop's own functions: the forward and
  backward through Megatron's schedule (including the DDP hooks that add each ``param.grad`` into the
  ``main_grad`` buffer, and with ``overlap_grad_reduce`` the bucket all-reduces they start),
  ``finalize_model_grads`` (the gradient all-reduce, or the wait for it, and the division by the token
  count), the logged-metrics all-reduce and the optimizer step (grad norm, clip, Adam);
- runs ``torch.profiler`` (CPU) over the same steps and keeps the 25 ops with the most self time.

Writes ``DIR/rank_R.txt`` for each rank and prints rank 0's. The numbers say what a layout pays on top
of one process's compute (docs/performance.md, "What the numbers say").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("forward+backward", "finalize_model_grads", "metrics all-reduce", "optimizer step")


class StepTimer:
    """Wall and CPU seconds per phase, summed over the profiled steps. CPU time (``time.process_time``: all
    of this process's threads, gloo's included) barely moves when other jobs load the machine, wall time
    does: compare layouts or settings by CPU time on a busy machine."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.step = warmup, 0
        self.totals, self.cpu = collections.defaultdict(float), collections.defaultdict(float)
        self.profiler = None

    @property
    def active(self) -> bool:
        return self.step >= self.warmup

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start
                self.cpu[name] += time.process_time() - cpu

        return timed


def install(timer: StepTimer) -> None:
    """Wrap the mca loop's phases (module attributes the loop looks up at call time)."""
    import megatron.core.distributed as mcd
    import torch

    from backends.mca.trainer import loop

    mcd.finalize_model_grads = timer.wrap("finalize_model_grads", mcd.finalize_model_grads)
    loop.run_schedule = timer.wrap("schedule (forward+backward+finalize)", loop.run_schedule)
    loop.clip_and_step_on_device = timer.wrap("optimizer step", loop.clip_and_step_on_device)
    loop.clip_and_step = timer.wrap("optimizer step", loop.clip_and_step)  # inner optimizers without found_inf
    loop.MegatronTrainer._metrics = timer.wrap("metrics all-reduce", loop.MegatronTrainer._metrics)
    train_step = loop.MegatronTrainer._train_step

    def profiled_step(self, *args, **kwargs):
        if timer.step == timer.warmup:
            timer.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            timer.profiler.__enter__()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return train_step(self, *args, **kwargs)
        finally:
            if timer.active:
                timer.totals["step"] += time.perf_counter() - start
                timer.cpu["step"] += time.process_time() - cpu
            timer.step += 1

    loop.MegatronTrainer._train_step = profiled_step


def _per_step(totals: dict, steps: int) -> dict[str, float]:
    per = {name: value / steps for name, value in totals.items()}
    schedule = per.pop("schedule (forward+backward+finalize)", 0.0)
    per["forward+backward"] = schedule - per.get("finalize_model_grads", 0.0)
    per["other (data, bookkeeping)"] = per.get("step", 0.0) - sum(per.get(name, 0.0) for name in PHASES)
    return per


def report(timer: StepTimer) -> str:
    steps = max(timer.step - timer.warmup, 1)
    wall, cpu = _per_step(timer.totals, steps), _per_step(timer.cpu, steps)
    step = wall.get("step", 0.0)
    lines = [f"rank {os.environ.get('RANK', '0')}: {steps} profiled steps, {step:.3f} s per step "
             f"({cpu.get('step', 0.0):.3f} s CPU); per step:"]
    for name in (*PHASES, "other (data, bookkeeping)"):
        seconds, share = wall.get(name, 0.0), 100 * wall.get(name, 0.0) / max(step, 1e-9)
        lines.append(f"  {name:26s} {seconds:7.3f} s  {share:5.1f} %  {cpu.get(name, 0.0):7.3f} s CPU")
    if timer.profiler is not None:
        timer.profiler.__exit__(None, None, None)
        table = timer.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        lines += ["", f"torch.profiler over the same {steps} steps (self CPU time, all steps together):",
                  table]
    return "\n".join(lines)


def rank_main(out: str, warmup: int, argv: list[str]) -> int:
    from roll import cli

    timer = StepTimer(warmup)
    install(timer)
    code = cli.main(argv)
    text = report(timer)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank_{os.environ.get('RANK', '0')}.txt"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing starts")
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "profile"))
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    args, argv = parser.parse_known_args()
    argv = [*argv, "--use-mca"] if "--use-mca" not in argv else argv
    if args.rank_mode or args.nproc == 1:
        return rank_main(args.out, args.warmup, argv)
    from roll.launch import LAUNCHED_ENV, free_port

    env = {**os.environ, LAUNCHED_ENV: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "roll.torchrun", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__), "--rank-mode",
           "--out", args.out, "--warmup", str(args.warmup), *argv, f"nproc_per_node={args.nproc}"]
    code = subprocess.call(cmd, env=env, cwd=REPO)
    with contextlib.suppress(OSError), open(os.path.join(args.out, "rank_0.txt"), encoding="utf-8") as fh:
        sys.stdout.write(fh.read())
    return code


if __name__ == "__main__":
    sys.exit(main())
