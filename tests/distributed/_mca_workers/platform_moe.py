"""MoE with expert-tensor parallelism on gloo (uneven token blocks): TP2 x EP2 x ETP2 with SP on 4
processes loads an EP2 (TP1) checkpoint and reproduces its loss with both token dispatchers.

``torchrun --nproc_per_node=4 platform_moe.py OUT``
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from platform_common import batch, build_gpt, emit, tiny_config  # noqa: E402 (sets sys.path)

from backends.mca.checkpoint import load_checkpoint, save_checkpoint
from backends.mca.initialize import destroy_megatron, initialize_megatron
from roll.config.layout import ParallelLayout


def moe_config(dispatcher: str, sequence_parallel: bool):
    return tiny_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.0,
                       moe_token_dispatcher_type=dispatcher, sequence_parallel=sequence_parallel)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    tokens, position_ids = batch()
    labels = torch.roll(tokens, -1, 1)

    initialize_megatron(ParallelLayout(world_size=4, ep=2), seed=1)
    model = build_gpt(moe_config("alltoall", False), seed=2)
    with torch.no_grad():
        reference = model(tokens, position_ids, None, labels=labels).mean().item()
    save_checkpoint([model], out)
    destroy_megatron()

    initialize_megatron(ParallelLayout(world_size=4, tp=2, ep=2, etp=2), seed=1)
    losses = {}
    for dispatcher in ("alltoall", "allgather"):
        model = build_gpt(moe_config(dispatcher, True), seed=5)
        load_checkpoint([model], out)
        loss = model(tokens, position_ids, None, labels=labels).mean()
        loss.backward()  # the reduce-scatter side of the uneven collectives
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        losses[dispatcher] = loss.item()
    destroy_megatron()
    emit(reference=reference, **losses)


if __name__ == "__main__":
    main(sys.argv[1])
