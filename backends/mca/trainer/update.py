"""One optimizer update of the mca loop and the numbers it reports, read to the host once per log.

A step leaves its numbers on the device (``PendingStep``): the objective's report sums and the real tokens
(all-reduced), the squared gradient norm, whether the update was skipped, the MoE losses. With torch's
fused Adam (``use_fast_adam``: CPU, and GPUs without Transformer Engine / Apex) the skip of a non-finite
step is decided on the device too (``clip_and_step_on_device``), so a step between two logs never waits
for the device; the loop reads all pending steps at once (``read_pending``) when it logs, saves or stops.
Other inner optimizers decide on the host (``clip_and_step``: one read per step), and fp16's grad scaler
reads its own inf check in ``prepare_grads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class PendingStep:
    """A step's numbers still on the device."""

    step: int
    """Steps done after it (1-based)."""
    learning_rate: float
    numbers: torch.Tensor
    """float64 ``[objective report sums..., real tokens, squared grad norm, skip]``; skip: 0.0 stepped, 1.0
    skipped (a non-finite loss or norm), 2.0 skipped by fp16's grad scaler (no norm computed)."""
    moe: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)
    """``moe_losses``: each loss's sum on the device and the count it is divided by."""


SKIPPED, SCALER_SKIPPED = 1.0, 2.0


def read_pending(pending: list[PendingStep]) -> list[tuple[list[float], dict[str, float]]]:
    """Each pending step's ``numbers`` and MoE losses on the host, in one read."""
    if not pending:
        return []
    parts = []
    for entry in pending:
        parts.append(entry.numbers)
        parts.extend(value.reshape(1).to(entry.numbers) for value, _ in entry.moe.values())
    flat, out, at = torch.cat(parts).tolist(), [], 0
    for entry in pending:
        numbers = flat[at:at + entry.numbers.numel()]
        at += entry.numbers.numel()
        moe = {}
        for name, (_, count) in entry.moe.items():
            moe[name] = flat[at] / count
            at += 1
        out.append((numbers, moe))
    return out


def grad_norm_squared(optimizer, device: torch.device) -> torch.Tensor:
    """``[squared global gradient norm]`` as Megatron's ``get_grad_norm`` measures it, left on the device.

    Megatron's own reads the norm to the host (``.item()``; without TE/Apex its local l2 kernel reads it
    once more), so a step would wait on the device twice before its update; the loop keeps this on the
    device (``clip_and_step_on_device``) and reads it with the loss reports at the next log. The same arithmetic as megatron-core's
    local fallback (each gradient's norm, their norm, squared, summed over each inner optimizer's
    grad-stats group: the model-parallel ranks, or every rank with the distributed optimizer), so its
    square root in Python is the float Megatron returns. Collective. Call after ``prepare_grads``.
    """
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False):
            continue
        grads = inner.get_main_grads_for_grad_norm()
        square = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            square = (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) ** 2).reshape(1)
        dist.all_reduce(square, group=inner.get_grad_stats_parallel_group())
        total += square
    return total


def skips_on_device(optimizer) -> bool:
    """Every inner optimizer is torch's fused Adam (``use_fast_adam``), whose kernel takes a ``found_inf``
    tensor and makes no update where it is 1: the loop can skip a non-finite step without reading it
    (``clip_and_step_on_device``). TE's / Apex's FusedAdam, torch's foreach Adam and the CPU-offload
    hybrid take no such flag: their steps are decided on the host (``clip_and_step``)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False):
            continue
        base = getattr(inner, "optimizer", None)
        if not isinstance(base, torch.optim.Adam) or not all(group.get("fused") for group in base.param_groups):
            return False
    return True


def clip_and_step_on_device(optimizer, loss_sum: torch.Tensor, grad_norm_square: torch.Tensor) -> torch.Tensor:
    """``clip_and_step`` without a host read: clip and update unless ``loss_sum`` or ``grad_norm_square``
    (``grad_norm_squared``, the same on every rank) is not finite; returns that skip as a float32 0-dim
    tensor on the device (1.0: no update). Needs ``skips_on_device``.

    The clip is megatron-core's ``clip_grad_by_total_norm_fp32`` with its coefficient kept on the device:
    ``max_norm / (norm + 1e-6)`` in float64 from the same float64 root, capped at 1 and rounded to float32
    (what the multiply does with Megatron's Python float), then every gradient multiplied in place. Below
    the cap the same bits as Megatron's; at the cap a multiply by exactly 1.0, which Megatron leaves out
    (no change, one more pass over the gradients). The skip is torch's fused Adam ``found_inf``: no
    update, no moment or step-count change, as if the step had not been called (the grad scaler's use).
    """
    found_inf = (~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm_square))).reshape(()).float()
    norm = grad_norm_square.double().sqrt().reshape(())
    inners = [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
              if not getattr(inner, "is_stub_optimizer", False)]
    for inner in inners:
        if inner.config.clip_grad > 0.0:
            grads = [param.grad for param in inner.get_parameters() if param.grad is not None]
            if grads:
                coeff = (inner.config.clip_grad / (norm + 1.0e-6)).clamp(max=1.0).float()
                torch._foreach_mul_(grads, coeff)
        inner.optimizer.found_inf = found_inf
    try:
        optimizer.step_with_ready_grads()
    finally:
        for inner in inners:
            del inner.optimizer.found_inf  # checkpoints and any later caller see a plain Adam
    return found_inf


def clip_and_step(optimizer, grad_norm: float) -> bool:
    """Clip by ``grad_norm`` (``grad_norm_squared``'s root), then Megatron's update; returns whether it stepped.

    The host-side twin of ``clip_and_step_on_device``, for inner optimizers without a ``found_inf`` (one
    read per step). The loop skips this when the loss or the norm is not finite: megatron-core's fp32 / bf16 optimizers only
    skip on the fp16 grad scaler's inf check, and a NaN gradient in fp32 would be applied and poison every
    weight. Same order as ``ChainedOptimizer.step``: prepare the grads (unscale, fp16 inf check: the
    loop's ``prepare_grads``), one global norm (collective, so every rank decides alike), clip, update.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False) or inner.config.clip_grad <= 0.0:
            continue
        parameters = inner.get_parameters()
        if parameters:
            decoupled = inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(parameters, max_norm=inner.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=decoupled)
    return optimizer.step_with_ready_grads()


def moe_losses(config, num_microbatches: int) -> dict[str, tuple[torch.Tensor, int]]:
    """The MoE losses of the last step as Megatron tracks them (before their coefficients), each averaged over
    MoE layers, micro-batches and ranks: ``moe_aux_loss`` (load balancing, reduced by Megatron's own rule)
    and ``moe_z_loss`` (router z-loss, which Megatron tracks per rank: summed here over every rank, then
    divided by the ranks that hold the same layers); {} for dense models and losses that are off. Each as
    (its sum on the device, the count ``read_pending`` divides it by). Collective."""
    if not config.num_moe_experts:
        return {}
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker, reduce_aux_losses_tracker_across_ranks)

    tracker = get_moe_layer_wise_logging_tracker()
    freq = config.moe_layer_freq
    moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, config.num_layers, freq))
    out = {}
    if "load_balancing_loss" in tracker:  # moe_aux_loss_coeff 0: nothing computed
        reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
        values = tracker["load_balancing_loss"]["values"]
        out["moe_aux_loss"] = (values.sum(), moe_layers * num_microbatches)
    if "z_loss" in tracker:
        values = tracker["z_loss"]["values"]
        dist.all_reduce(values)
        ranks_per_layer = dist.get_world_size() // config.pipeline_model_parallel_size
        out["moe_z_loss"] = (values.sum(), moe_layers * num_microbatches * ranks_per_layer)
    clear_aux_losses_tracker()
    return out
