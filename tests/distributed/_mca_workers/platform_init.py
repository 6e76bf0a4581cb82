"""Checks of initialize_megatron: idempotence, seeding, layouts. Run as
``python platform_init.py single`` (no launcher) or ``torchrun --nproc_per_node=2 platform_init.py torchrun``."""

from __future__ import annotations

import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from platform_common import build_gpt, batch, emit, tiny_config  # noqa: E402 (sets sys.path)
from wgrad_checks import wgrad_fusion_checks  # noqa: E402

from backends.mca.initialize import destroy_megatron, initialize_megatron
from backends.mca.platform import applied_patches, apply_patches
from roll.config.layout import ParallelLayout
from roll.errors import ConfigError


def draws() -> dict[str, list[float]]:
    """One draw from each generator a run uses; the TP tracker state is forked, so it is not consumed elsewhere."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_stream = torch.rand(4).tolist()
    return {"torch": torch.rand(2).tolist(), "numpy": np.random.rand(2).tolist(), "random": [random.random()],
            "tp_tracker": tp_stream}


def single() -> None:
    layout = ParallelLayout(world_size=1)
    info = initialize_megatron(layout, seed=5)
    first = draws()
    patches = applied_patches()
    modes = len(torch.overrides._get_current_function_mode_stack())
    assert initialize_megatron(layout, seed=5) is info, "second initialize_megatron call was not a no-op"
    same = ParallelLayout(world_size=1, etp=1, vpp=1)  # defaults spelled out: the same layout
    assert initialize_megatron(same, seed=5) is info, "an equivalent layout was treated as a different one"
    apply_patches()
    assert applied_patches() == patches and len(torch.overrides._get_current_function_mode_stack()) == modes, \
        "apply_patches is not idempotent"
    try:
        initialize_megatron(ParallelLayout(world_size=2, tp=2), seed=5)
        raise AssertionError("re-initialising with another layout did not raise")
    except ConfigError as err:
        conflict_error = str(err)
    destroy_megatron()
    assert not dist.is_initialized(), "destroy_megatron left the process group it created"
    initialize_megatron(layout, seed=5)
    again = draws()
    destroy_megatron()
    try:
        initialize_megatron(ParallelLayout(world_size=2), seed=5)
        raise AssertionError("a world-size mismatch did not raise")
    except ConfigError as err:
        world_error = str(err)
    assert not dist.is_initialized(), "a failed initialize_megatron left its process group behind"
    initialize_megatron(layout, seed=5)
    wgrad = wgrad_fusion_checks()
    destroy_megatron()
    emit(info=info.__dict__, patches=list(patches), first=first, again=again, conflict_error=conflict_error,
         world_error=world_error, wgrad=wgrad)


def multi() -> None:
    dist.init_process_group("gloo")  # ours, so destroy_megatron must leave it alone
    group = dist.group.WORLD
    results = {}
    for name, layout in (("tp2", ParallelLayout(world_size=2, tp=2)), ("dp2", ParallelLayout(world_size=2)),
                         ("tp2_again", ParallelLayout(world_size=2, tp=2)),
                         ("ep2", ParallelLayout(world_size=2, ep=2)),
                         ("tp2_ep2", ParallelLayout(world_size=2, tp=2, ep=2, etp=1)),
                         ("pp2", ParallelLayout(world_size=2, pp=2))):
        info = initialize_megatron(layout, seed=11)
        mine = draws()
        gathered = [None, None]
        dist.all_gather_object(gathered, mine, group=group)
        results[name] = {"info": info.__dict__, "draws": gathered}
        if name == "tp2":
            results[name]["train"] = _tp2_forward_backward()
        if name.endswith("ep2"):
            results[name]["moe_loss"] = _moe_losses(sequence_parallel=layout.tp > 1)
        if name == "pp2":
            results[name]["train"] = _pp2_train_steps()
        destroy_megatron()
        assert dist.is_initialized(), "destroy_megatron destroyed a process group it did not create"
    emit(**results)


def _tp2_forward_backward() -> dict:
    """A TP2 GPT from roll's spec trains one step; with sequence parallelism (local norms patched)
    it gives the same loss, and its norm grads summed over TP equal the non-SP grads."""
    from megatron.core import parallel_state as ps

    tokens, position_ids = batch()
    labels = torch.roll(tokens, -1, 1)
    grads, losses, tagged = {}, {}, []
    for sp in (False, True):
        model = build_gpt(tiny_config(sequence_parallel=sp), seed=3)
        loss = model(tokens, position_ids, None, labels=labels).mean()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        losses[sp] = loss.item()
        grads[sp] = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            if getattr(p, "sequence_parallel", False):  # what finalize_model_grads does under SP
                tagged.append(name)
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            grads[sp][name] = g
    grad_diff = max((grads[True][n] - grads[False][n]).abs().max().item() for n in grads[False])
    return {"loss": losses[False], "sp_loss": losses[True], "sp_grad_diff": grad_diff, "sp_tagged": tagged}


def _moe_losses(sequence_parallel: bool) -> dict[str, float]:
    """Loss of a 4-expert top-2 MoE GPT (same weights every time) with each token dispatcher; the
    CPU patches for the router without TE, CUDA streams and alltoall split sizes are exercised."""
    tokens, position_ids = batch()
    losses = {}
    for dispatcher in ("allgather", "alltoall"):
        config = tiny_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.0,
                             moe_token_dispatcher_type=dispatcher, sequence_parallel=sequence_parallel)
        model = build_gpt(config, seed=2)
        loss = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).mean()
        loss.backward()
        losses[dispatcher] = loss.item()
    return losses


def _pp2_train_steps(steps: int = 4) -> dict:
    """Megatron DDP + distributed optimizer + the 1F1B schedule at PP2: the code paths with
    hard-coded 'cuda' tensors. Same two micro-batches every step, so the loss must go down."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from platform_common import SEQ, build_chunks

    config = tiny_config()
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in build_chunks(config, seed=1)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0,
                                                       use_distributed_optimizer=True), chunks)

    def forward_step(data, model):
        tokens, position_ids = next(data)
        output = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1))
        return output, lambda out: (out.mean(), {"loss": out.mean().detach()})

    losses, grad_norms = [], []
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch(seed=0), batch(seed=1)]), model=chunks,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=2, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(grad_norm)
        if outputs:  # last stage only
            losses.append(sum(out["loss"].item() for out in outputs))
    return {"losses": losses, "grad_norms": grad_norms}


if __name__ == "__main__":
    single() if sys.argv[1] == "single" else multi()
