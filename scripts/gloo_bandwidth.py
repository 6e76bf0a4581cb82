"""What a gloo all-reduce of one step's gradients costs on this machine: the floor of a DP2 step on CPU.

usage: python scripts/gloo_bandwidth.py [--mb 471] [--procs 2] [--threads 1] [--repeat 3]

Spawns ``--procs`` processes on 127.0.0.1 (``--threads`` torch threads each, as roll-train's launches use one)
and times, in each:

- ``all_reduce`` of ``--mb`` MB of fp32 as one tensor (Megatron DDP without ``overlap_grad_reduce``: one
  bucket) and as 40M-element buckets, one after another and all in flight at once (``overlap_grad_reduce``'s
  default bucket size, 40M elements at DP2);
- the same in bf16 (``grad_reduce_in_fp32: false`` with bf16 weights: half the bytes);
- ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` of the same buffer (the distributed
  optimizer's traffic: each rank steps its shard in between);
- a local ``add_`` of a tensor of the same size into another (what a memory pass over the gradients costs:
  Megatron's DDP adds every ``param.grad`` into its ``main_grad`` buffer).

Reports the median seconds and the bandwidth in GB/s of the buffer's size (so 1 s for 0.47 GB is
0.47 GB/s). The numbers are the floor a DP2 step pays on top of its compute, whatever the loop does.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUCKET = 40_000_000
"""Megatron DDP's bucket size with overlap_grad_reduce: max(40M, 1M * dp) elements."""


def _timed(fn, repeat: int) -> float:
    fn()  # warm-up: gloo sets up its buffers on the first call of a size
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cases(numel: int):
    """(name, function, bytes moved per call), one dtype's buffers alive at a time."""
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.ones(numel, dtype=dtype)
        buckets = list(flat.split(BUCKET))
        name = "fp32" if dtype == torch.float32 else "bf16"
        size = flat.numel() * flat.element_size()

        def one(flat=flat):
            dist.all_reduce(flat)

        def serial(buckets=buckets):
            for bucket in buckets:
                dist.all_reduce(bucket)

        def in_flight(buckets=buckets):
            for work in [dist.all_reduce(bucket, async_op=True) for bucket in buckets]:
                work.wait()

        shard = torch.empty(numel // dist.get_world_size(), dtype=dtype)

        def scatter(flat=flat, shard=shard):
            dist.reduce_scatter_tensor(shard, flat)

        def gather(flat=flat, shard=shard):
            dist.all_gather_into_tensor(flat, shard)

        yield f"all_reduce {name}, one tensor", one, size
        yield f"reduce_scatter_tensor {name}", scatter, size
        yield f"all_gather_into_tensor {name}", gather, size
        yield f"all_reduce {name}, {len(buckets)} buckets one by one", serial, size
        yield f"all_reduce {name}, {len(buckets)} buckets in flight", in_flight, size
        del flat, buckets, shard, one, serial, in_flight, scatter, gather
    grad, main_grad = torch.ones(numel), torch.zeros(numel)
    yield "local add_ fp32 (param.grad into main_grad)", lambda: main_grad.add_(grad), numel * 4


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.procs)
    numel = int(args.mb * 1e6) // 4
    for name, fn, size in _cases(numel):
        seconds = _timed(fn, args.repeat)
        if rank == 0:
            sys.stdout.write(f"{name:48s} {seconds:7.3f} s  {size / 1e9 / seconds:6.2f} GB/s "
                             f"({size / 1e9:.3f} GB)\n")
            sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=471.0, help="MB of fp32 gradients (bench model: 471)")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.stdout.write(f"{args.procs} processes x {args.threads} thread(s), {args.mb:.0f} MB fp32, "
                     f"median of {args.repeat}\n")
    mp.spawn(_worker, args=(args, port), nprocs=args.procs, join=True)


if __name__ == "__main__":
    main()
