"""Where an mca training step's time goes on each rank: compute, gradient communication, optimizer, copies.

usage: python scripts/profile_mca_ranks.py RECIPE [KEY=VALUE ...] [--nproc 2] [--warmup 2] [--out DIR]
                                           [--no-ops] [--shapes]

Trains ``RECIPE`` with ``--use-mca`` on ``--nproc`` local processes (torchrun, 1 thread each unless
``OMP_NUM_THREADS`` says otherwise; ``--nproc 1`` runs in this process, on every core unless it says otherwise)
and, on every rank, after ``--warmup`` steps:

- times each step's phases with ``time.perf_counter`` and ``time.process_time`` around the loop's own functions:
  zeroing the ``main_grad`` buffers, the forward and backward through Megatron's schedule (with, inside it, the
  DDP hooks that add each ``param.grad`` into ``main_grad``; with ``overlap_grad_reduce`` the bucket
  all-reduces they start), ``finalize_model_grads`` (inside it the gradient all-reduce, or the wait for the
  overlapped one), the division by the token count, the grad norm, the optimizer step (clip, Adam) and the
  logged-metrics all-reduce;
- counts the step's kernel CPU seconds and minor page faults (``getrusage``: a tensor allocated afresh each
  step is new memory the kernel zeroes page by page) and the rank's peak RSS;
- runs ``torch.profiler`` (CPU) over the same steps and keeps the 25 ops with the most self time (``--shapes``:
  40, split by input shape; ``--no-ops``: no profiler, whose per-op bookkeeping slows the steps).

Writes ``DIR/rank_R.txt`` for each rank and prints every rank's phases and rank 0's ops. The numbers say what a
layout pays on top of one process's compute (docs/performance.md, "DP2 and TP2 on 2 processes").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("zero grad buffers", "forward+backward", "finalize_model_grads", "scale by token count", "grad norm",
          "optimizer step", "metrics all-reduce")
SUB_PHASES = {"forward+backward": ("DDP hooks (main_grad += grad)",), "finalize_model_grads": ("grad all-reduce",)}
"""Parts of a phase, timed inside it (listed under it, not added to the step again)."""


class StepTimer:
    """Wall and CPU seconds per phase, summed over the profiled steps. CPU time (``time.process_time``: all
    of this process's threads, gloo's included) barely moves when other jobs load the machine, wall time
    does: compare layouts or settings by CPU time on a busy machine."""

    def __init__(self, warmup: int, ops: bool = True, shapes: bool = False) -> None:
        self.warmup, self.step, self.ops, self.shapes = warmup, 0, ops, shapes
        self.totals, self.cpu = collections.defaultdict(float), collections.defaultdict(float)
        self.kernel = collections.defaultdict(float)  # the step's system CPU seconds and page faults (getrusage)
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
    from megatron.core.distributed import DistributedDataParallel as DDP

    from backends.mca.trainer import loop

    mcd.finalize_model_grads = timer.wrap("finalize_model_grads", mcd.finalize_model_grads)
    DDP.zero_grad_buffer = timer.wrap("zero grad buffers", DDP.zero_grad_buffer)
    DDP.finish_grad_sync = timer.wrap("grad all-reduce", DDP.finish_grad_sync)  # or the wait for the overlapped one
    DDP.scale_gradients = timer.wrap("scale by token count", DDP.scale_gradients)
    make_hook = DDP._make_backward_post_hook  # the hooks are made when DDP wraps the model, after this
    DDP._make_backward_post_hook = lambda self, param: timer.wrap("DDP hooks (main_grad += grad)",
                                                                  make_hook(self, param))
    loop.grad_norm_squared = timer.wrap("grad norm", loop.grad_norm_squared)
    loop.run_schedule = timer.wrap("schedule (forward+backward+finalize)", loop.run_schedule)
    loop.clip_and_step_on_device = timer.wrap("optimizer step", loop.clip_and_step_on_device)
    loop.clip_and_step = timer.wrap("optimizer step", loop.clip_and_step)  # inner optimizers without found_inf
    loop.MegatronTrainer._metrics = timer.wrap("metrics all-reduce", loop.MegatronTrainer._metrics)
    train_step = loop.MegatronTrainer._train_step

    def profiled_step(self, *args, **kwargs):
        if timer.step == timer.warmup and timer.ops:
            timer.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    record_shapes=timer.shapes)
            timer.profiler.__enter__()
        start, cpu, usage = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        try:
            return train_step(self, *args, **kwargs)
        finally:
            if timer.active:
                timer.totals["step"] += time.perf_counter() - start
                timer.cpu["step"] += time.process_time() - cpu
                end = resource.getrusage(resource.RUSAGE_SELF)
                timer.kernel["system s"] += end.ru_stime - usage.ru_stime
                timer.kernel["minor page faults"] += end.ru_minflt - usage.ru_minflt
            timer.step += 1

    loop.MegatronTrainer._train_step = profiled_step


def _per_step(totals: dict, steps: int) -> dict[str, float]:
    per = {name: value / steps for name, value in totals.items()}
    schedule = per.pop("schedule (forward+backward+finalize)", 0.0)
    per["forward+backward"] = schedule - per.get("finalize_model_grads", 0.0) - per.get("scale by token count", 0.0)
    per["other (data, bookkeeping)"] = per.get("step", 0.0) - sum(per.get(name, 0.0) for name in PHASES)
    return per


def report(timer: StepTimer) -> str:
    steps = max(timer.step - timer.warmup, 1)
    wall, cpu = _per_step(timer.totals, steps), _per_step(timer.cpu, steps)
    step = wall.get("step", 0.0)
    lines = [f"rank {os.environ.get('RANK', '0')}: {steps} profiled steps, {step:.3f} s per step "
             f"({cpu.get('step', 0.0):.3f} s CPU, of it {timer.kernel['system s'] / steps:.3f} s in the kernel; "
             f"{timer.kernel['minor page faults'] / steps:.0f} minor page faults; peak RSS "
             f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB); per step:"]
    names = [(name, "  ") for name in (*PHASES, "other (data, bookkeeping)")]
    for parent, parts in SUB_PHASES.items():
        at = names.index((parent, "  ")) + 1
        names[at:at] = [(part, "    ") for part in parts]
    for name, indent in names:
        seconds, share = wall.get(name, 0.0), 100 * wall.get(name, 0.0) / max(step, 1e-9)
        lines.append(f"{indent}{name:30s} {seconds:7.3f} s  {share:5.1f} %  {cpu.get(name, 0.0):7.3f} s CPU")
    if timer.profiler is not None:
        timer.profiler.__exit__(None, None, None)
        table = timer.profiler.key_averages(group_by_input_shape=timer.shapes).table(
            sort_by="self_cpu_time_total", row_limit=40 if timer.shapes else 25)
        lines += ["", f"torch.profiler over the same {steps} steps (self CPU time, all steps together):",
                  table]
    return "\n".join(lines)


def rank_main(out: str, warmup: int, argv: list[str], ops: bool = True, shapes: bool = False) -> int:
    from roll import cli

    timer = StepTimer(warmup, ops, shapes)
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
    parser.add_argument("--no-ops", action="store_true", help="no torch.profiler: phase timings only (the "
                        "profiler's per-op bookkeeping slows the steps)")
    parser.add_argument("--shapes", action="store_true", help="the profiler's ops split by input shape")
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    args, argv = parser.parse_known_args()
    argv = [*argv, "--use-mca"] if "--use-mca" not in argv else argv
    if args.rank_mode or args.nproc == 1:
        return rank_main(args.out, args.warmup, argv, not args.no_ops, args.shapes)
    from roll.launch import LAUNCHED_ENV, free_port

    env = {**os.environ, LAUNCHED_ENV: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "roll.torchrun", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__), "--rank-mode",
           "--out", args.out, "--warmup", str(args.warmup), *(["--no-ops"] if args.no_ops else []),
           *(["--shapes"] if args.shapes else []), *argv, f"nproc_per_node={args.nproc}"]
    code = subprocess.call(cmd, env=env, cwd=REPO)
    for rank in range(args.nproc):  # every rank's phases, rank 0's profiler table
        with contextlib.suppress(OSError), open(os.path.join(args.out, f"rank_{rank}.txt"), encoding="utf-8") as fh:
            text = fh.read()
            sys.stdout.write(text if rank == 0 else text.split("\n\n")[0] + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
