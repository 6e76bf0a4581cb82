"""Dist-checkpoint resharding: save at one layout, load at another, compare full logits.

``torchrun --nproc_per_node=2 platform_checkpoint.py OUT`` walks one chain of layouts, each
building a model from a *different* seed and loading the previous checkpoint(s):
TP1 (DP2) -> TP2 -> PP2 -> PP2xVPP2 -> TP1 (DP2). Every phase reports max |logits - TP1 logits|.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist

from platform_common import SEQ, batch, build_chunks, emit, tiny_config  # noqa: E402 (sets sys.path)

from backends.mca.checkpoint import is_dist_checkpoint, load_checkpoint, save_checkpoint
from backends.mca.initialize import destroy_megatron, initialize_megatron
from roll.config.layout import ParallelLayout
from roll.errors import ModelError

LAYERS = 4


def pipeline_logits(chunks: list, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [b, s, V] on the last pipeline stage (None elsewhere), without a schedule:
    virtual stage v = chunk * pp + pp_rank runs on pp_rank and hands its hidden states to v + 1."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    pp, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    stages = len(chunks) * pp
    hidden = None
    out = None
    with torch.no_grad():
        for v in range(stages):
            holder = v % pp
            if holder != me:
                continue
            chunk = chunks[v // pp]
            if v > 0 and pp > 1:
                hidden = torch.empty(SEQ, tokens.shape[0], chunk.config.hidden_size)
                dist.recv(hidden, src=group_ranks[(v - 1) % pp])
            if v > 0:
                chunk.set_input_tensor(hidden)
            out = chunk(tokens, positions, None)
            if v < stages - 1 and pp > 1:
                dist.send(out.contiguous(), dst=group_ranks[(v + 1) % pp])
            hidden = out
    if not ps.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(out)


def phase(layout: ParallelLayout, seed: int, reference: torch.Tensor | None, load_from: list[str],
          save_to: str, out: str, vpp: int | None = None) -> dict:
    initialize_megatron(layout, seed=seed)
    config = tiny_config(num_layers=LAYERS, virtual_pipeline_model_parallel_size=vpp)
    chunks = build_chunks(config, seed=seed)
    tokens, positions = batch()
    result = {}
    logits = pipeline_logits(chunks, tokens, positions)
    if reference is None:
        reference = logits
    else:
        result["before_load"] = _max_diff(logits, reference)  # other seed: must differ, or the test is void
    for name in load_from:
        load_checkpoint(chunks, os.path.join(out, name))
        result[f"from_{name}"] = _max_diff(pipeline_logits(chunks, tokens, positions), reference)
    # TP2: both ranks write shards, past the page cache (later phases load it), and again buffered: the same bytes;
    # and as a training run's background save writes them (PP2 loads that one)
    save_checkpoint(chunks, os.path.join(out, save_to), direct=save_to == "tp2")
    if save_to == "tp2":
        save_checkpoint(chunks, os.path.join(out, "tp2-buffered"))
        result["direct_differs"] = _differing_files(os.path.join(out, "tp2-buffered"), os.path.join(out, save_to))
        result["background_live"] = _background_save(chunks, os.path.join(out, "tp2-background"))
    destroy_megatron()
    return result, reference


def _background_save(chunks: list, ckpt_dir: str) -> bool:
    """``save_async``'s write of the model (``checkpoint_background``): planned here, written by a thread, finalized
    here; whether it read the model's own tensors (on CPU it must: no copy)."""
    from megatron.core import dist_checkpointing

    from backends.mca.checkpoint import sharded_model_state_dict
    from backends.mca.checkpoint_background import background_save_strategy

    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    strategy = background_save_strategy()
    request = dist_checkpointing.save(sharded_model_state_dict(chunks), ckpt_dir, sharded_strategy=strategy,
                                      async_sharded_save=True)
    writer = threading.Thread(target=request.async_fn, args=request.async_fn_args)
    writer.start()
    writer.join()
    for finalize in request.finalize_fns:
        finalize()
    return strategy.live


def _differing_files(a: str, b: str) -> list[str]:
    """The ``.distcp`` files of ``a`` whose bytes ``b`` lacks (``.metadata`` names the save, so it differs)."""
    names = sorted(n for n in os.listdir(a) if n.endswith(".distcp"))
    if not names or sorted(n for n in os.listdir(b) if n.endswith(".distcp")) != names:
        return ["<file lists differ>"]
    return [n for n in names if open(os.path.join(a, n), "rb").read() != open(os.path.join(b, n), "rb").read()]


def _max_diff(logits: torch.Tensor | None, reference: torch.Tensor) -> float:
    """max |logits - reference| over the ranks that hold logits (all ranks get the value)."""
    diff = torch.tensor(-1.0 if logits is None else (logits - reference).abs().max().item())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def main(out: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    results["tp1"], ref = phase(ParallelLayout(world_size=2), 1, None, [], "tp1", out)
    results["tp2"], _ = phase(ParallelLayout(world_size=2, tp=2), 2, ref, ["tp1"], "tp2", out)
    results["pp2"], _ = phase(ParallelLayout(world_size=2, pp=2), 3, ref, ["tp1", "tp2-background"], "pp2", out)
    results["vpp2"], _ = phase(ParallelLayout(world_size=2, pp=2, vpp=2), 4, ref, ["pp2"], "vpp2", out, vpp=2)
    results["back_to_tp1"], _ = phase(ParallelLayout(world_size=2), 5, ref, ["vpp2", "tp2"], "final", out)
    results["is_dist_checkpoint"] = [is_dist_checkpoint(os.path.join(out, "tp1")), is_dist_checkpoint(out)]
    results["load_errors"] = _load_errors(out)
    emit(**results)


def _load_errors(out: str) -> list[str]:
    """The messages for a directory that is no checkpoint, and for a model the checkpoint does not fit."""
    initialize_megatron(ParallelLayout(world_size=2), seed=1)
    errors = []
    for path, config in ((out, tiny_config(num_layers=LAYERS)),
                         (os.path.join(out, "tp1"), tiny_config(num_layers=LAYERS, qk_layernorm=True))):
        try:
            load_checkpoint(build_chunks(config), path)
            errors.append("")
        except ModelError as err:
            errors.append(str(err))
    destroy_megatron()
    return errors


if __name__ == "__main__":
    main(sys.argv[1])
