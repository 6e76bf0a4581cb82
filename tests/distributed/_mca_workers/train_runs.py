"""Worker: several real training runs (roll.router.run, the production path) in one torchrun job.

usage: torchrun --nproc_per_node=N train_runs.py SPEC.json RESULT.json

SPEC.json: {"base": {recipe keys}, "runs": [{"name": str, "overrides": {key: value}}, ...]}. Every
run starts from ``base`` + its overrides (``use_mca`` and ``nproc_per_node`` are set from the
launch), or, when it gives ``"args"``, from a roll-train command line (e.g. a recipe file and
``--use-mca``; ``nproc_per_node`` is appended), and trains in this process; Megatron is torn down and brought up again between runs, the
process group is kept (it is this worker's). Rank 0 writes {name: {"losses": [...], "grad_norms":
[...], "log": [...], "stream_rows_read": [rows each rank read from a streamed training set itself, or
null], "checkpoint_reads": [[tensors read in place, tensors left to PyTorch's reader] of each rank's
Megatron checkpoint loads (``backends.mca.checkpoint_io``: a resume, a converted model)]}} to RESULT.json; a run with ``"count_host_reads": true`` also gets "host_reads": the
tensor-to-host reads (``item``, ``tolist``, ``float()``, ``bool()``, ...) of each training step, its update
and the reading of its numbers (``_settle``, at a log, save or stop after it) counted together. Starting the interpreter and importing Megatron once for all
runs keeps a layout matrix affordable on 2 cores.
"""

from __future__ import annotations

import contextlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
"""Tensor methods that bring a value to the host: on a GPU each waits for the device to catch up."""
CPU_SIDE = (os.path.join("roll", "data", "order.py"),)
"""Modules whose tensors live on the host on every platform (the sample order: ``torch.randperm`` with a CPU
generator, read once an epoch): their reads are not counted, as they never wait for a device."""


@contextlib.contextmanager
def counting_host_reads(enabled: bool):
    """Count ``HOST_READS`` calls inside each ``MegatronTrainer._train_step`` and in the ``_settle`` calls
    after it (one count per step; a read nested in another, e.g. through the CPU platform's torch-function
    mode, counts once; a read made in a ``CPU_SIDE`` module is not counted). Only the training thread's reads
    count: an async save's background writer reads its host copies (``numpy()``) while the next steps run,
    and never makes the training thread wait (the CI run of session 44's submission counted its 53 reads into step 3)."""
    import threading

    import torch

    from backends.mca.trainer.loop import MegatronTrainer

    counts: list[int] = []
    if not enabled:
        yield counts
        return
    state = {"step": False, "inside": False, "thread": threading.get_ident()}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    original_step, original_settle = MegatronTrainer._train_step, MegatronTrainer._settle

    def counted(name):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if (state["step"] and not state["inside"] and threading.get_ident() == state["thread"]
                    and not caller.endswith(CPU_SIDE)):
                counts[-1] += 1
            outer, state["inside"] = state["inside"], True
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                state["inside"] = outer
        return read

    def train_step(self, *args, **kwargs):
        counts.append(0)
        state["step"] = True
        try:
            return original_step(self, *args, **kwargs)
        finally:
            state["step"] = False

    def settle(self, *args, **kwargs):
        state["step"] = bool(counts)
        try:
            return original_settle(self, *args, **kwargs)
        finally:
            state["step"] = False

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    MegatronTrainer._train_step, MegatronTrainer._settle = train_step, settle
    try:
        yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        MegatronTrainer._train_step, MegatronTrainer._settle = original_step, original_settle


@contextlib.contextmanager
def streamed_datasets():
    """The streamed training sets the run hands out (``share_stream`` is called with each on every rank)."""
    from roll.data import streaming

    seen, original = [], streaming.share_stream

    def share(dataset, output_dir):
        seen.append(dataset)
        return original(dataset, output_dir)

    streaming.share_stream = share
    try:
        yield seen
    finally:
        streaming.share_stream = original


@contextlib.contextmanager
def counting_checkpoint_reads():
    """[in place, left to PyTorch's reader]: how the run's Megatron checkpoint loads read each stored tensor
    (``checkpoint_io._read_in_place``, which the direct reader asks first for every tensor item)."""
    from backends.mca import checkpoint_io

    counts, original = [0, 0], checkpoint_io._read_in_place

    def counted(*args):
        done = original(*args)
        counts[0 if done else 1] += 1
        return done

    checkpoint_io._read_in_place = counted
    try:
        yield counts
    finally:
        checkpoint_io._read_in_place = original


def run_one(spec: dict, item: dict) -> dict:
    import torch.distributed as dist

    from roll.config.parser import parse_args
    from roll.router import run

    from spec_runs import recipe_config

    if "args" in item:
        config = parse_args(item["args"] + [f"nproc_per_node={dist.get_world_size()}"])[1]
    else:
        config = recipe_config(spec, item)
    with (counting_host_reads(item.get("count_host_reads", False)) as host_reads, streamed_datasets() as seen,
          counting_checkpoint_reads() as checkpoint_reads):
        result = run(config)
    log = [entry for entry in result.log_history if "loss" in entry]
    stream_rows = [None] * dist.get_world_size()  # rows each rank read from a stream itself
    dist.all_gather_object(stream_rows, sum(getattr(d, "rows_read", 0) for d in seen) if seen else None)
    reads = [None] * dist.get_world_size()
    dist.all_gather_object(reads, checkpoint_reads)
    return {"losses": [entry["loss"] for entry in log], "grad_norms": [entry.get("grad_norm") for entry in log],
            "log": log, "metrics": result.metrics, "host_reads": host_reads, "stream_rows_read": stream_rows,
            "checkpoint_reads": reads}


if __name__ == "__main__":
    from spec_runs import main

    main(run_one)
