"""Megatron DDP, the Megatron optimizer from the recipe's Hugging Face keys, and the LR schedule.

The schedule reproduces ``transformers.get_scheduler`` step for step (constant, constant_with_warmup,
linear, cosine; warmup as steps or, below 1, as a ratio of the run), so both backends apply the same
learning rate at every step. Its only state is the step count, saved with the trainer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from roll.errors import ConfigError

LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
"""``lr_scheduler_type`` values the mca backend implements (the same curves as Hugging Face's)."""


def schedule_name(value) -> str:
    """The recipe's lr_scheduler_type as a plain name (HF may hand an enum); ConfigError if unsupported."""
    name = str(getattr(value, "value", value))
    if name not in LR_SCHEDULES:
        raise ConfigError(f"lr_scheduler_type {name!r} is not available on the mca backend; choose one of "
                          f"{', '.join(LR_SCHEDULES)}.")
    return name


@dataclass
class LRSchedule:
    """Learning rate at each optimizer step, as ``transformers.get_scheduler`` computes it."""

    base_lr: float
    name: str
    total_steps: int
    warmup: float = 0
    """Warmup steps (>= 1) or a ratio of ``total_steps`` (< 1), like HF's ``warmup_steps``."""

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup) if self.warmup >= 1 else math.ceil(self.total_steps * self.warmup)

    def lr(self, step: int) -> float:
        """The learning rate used by the update that follows ``step`` completed updates."""
        warmup = self.warmup_steps
        if self.name == "constant":
            return self.base_lr
        if step < warmup:
            return self.base_lr * step / max(1, warmup)
        if self.name == "constant_with_warmup":
            return self.base_lr
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        if self.name == "linear":
            return self.base_lr * max(0.0, 1.0 - progress)
        return self.base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a cycle

    def apply(self, optimizer, step: int) -> float:
        """Set every parameter group's learning rate for the update after ``step``; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def wrap_ddp(chunks: list[torch.nn.Module], megatron_args, *, fp16: bool, bf16: bool) -> list[torch.nn.Module]:
    """Megatron's DDP around each chunk (fp32 gradient reduction, optional overlap; buckets only for
    the first chunk, as Megatron-LM does under the virtual pipeline), after ``Float16Module`` when
    training in bf16/fp16. Parameters are broadcast from data-parallel rank 0 so replicas start equal."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    if fp16 or bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=megatron_args.overlap_grad_reduce,
        overlap_param_gather=megatron_args.overlap_param_gather,
        use_distributed_optimizer=megatron_args.use_distributed_optimizer,
        average_in_collective=False)  # per-token loss: finalize_model_grads divides by the token count
    wrapped = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
               for index, chunk in enumerate(chunks)]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def build_optimizer(chunks: list[torch.nn.Module], training, megatron_args):
    """``get_megatron_optimizer`` (AdamW) from the HF keys: adam_beta1/2, adam_epsilon, weight_decay,
    max_grad_norm (0 disables clipping), precision, use_distributed_optimizer and CPU offload. Weight
    decay skips what HF Trainer skips (biases, norm weights: ``param_groups``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from backends.mca.trainer.param_groups import apply_weight_decay, config_overrides

    config = chunks[0].config
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=training.learning_rate, min_lr=0.0, weight_decay=training.weight_decay,
        adam_beta1=training.adam_beta1, adam_beta2=training.adam_beta2, adam_eps=training.adam_epsilon,
        clip_grad=training.max_grad_norm or 0.0, bf16=bool(training.bf16), fp16=bool(training.fp16),
        params_dtype=config.params_dtype, use_distributed_optimizer=megatron_args.use_distributed_optimizer,
        optimizer_cpu_offload=getattr(megatron_args, "optimizer_cpu_offload", False))
    optimizer = get_megatron_optimizer(optimizer_config, chunks, config_overrides=config_overrides(chunks))
    apply_weight_decay(optimizer, training.weight_decay)
    return optimizer


def install_hooks(chunks: list[torch.nn.Module], optimizer, megatron_args) -> None:
    """Tell the schedules how to sync and finalise gradients (Megatron-LM's wiring)."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    if len(chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
    if megatron_args.overlap_grad_reduce:
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        if len(chunks) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    if megatron_args.overlap_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in chunks]
        if len(chunks) == 1:
            config.param_sync_func = config.param_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def step_if_finite(optimizer) -> tuple[bool, float | None]:
    """Megatron's ``optimizer.step()``, except that a non-finite gradient norm skips the update.

    megatron-core's fp32 / bf16 optimizers only skip on the fp16 grad scaler's inf check; a NaN gradient
    in fp32 would be applied and poison every weight. Same order as ``ChainedOptimizer.step``: prepare
    the grads (unscale, fp16 inf check), one global norm (collective over the model-parallel groups, so
    every rank decides alike), clip by that norm, update. Returns (updated, grad norm).
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # the fp16 grad scaler found inf/nan and lowered its scale
        return False, None
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False) or inner.config.clip_grad <= 0.0:
            continue
        parameters = inner.get_parameters()
        if parameters:
            decoupled = inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(parameters, max_norm=inner.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=decoupled)
    return optimizer.step_with_ready_grads(), grad_norm
