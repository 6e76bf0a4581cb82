"""Megatron DDP, the Megatron optimizer from the recipe's Hugging Face keys, and the LR schedule.

The schedule is Hugging Face's own: ``transformers.get_scheduler`` builds the recipe's
``lr_scheduler_type`` (with ``lr_scheduler_kwargs`` and the warmup steps HF Trainer derives from
``warmup_steps``), and the mca loop reads its per-step factor, so both backends apply the same learning
rate at every step. Its only state is the step count, saved with the trainer state.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # config validation imports schedule_name: --print-config must not import torch
    import torch

from roll.errors import ConfigError
from roll.logging import log_rank0

logger = logging.getLogger(__name__)

METRIC_DRIVEN = {"reduce_lr_on_plateau": "it lowers the rate when an eval metric stops improving",
                 "greedy": "it changes the rate from the training loss it is fed each step"}
"""HF schedules that are not a function of the step; the mca loop has no metric hook for them."""


STEP_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                  "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
"""``lr_schedules()`` of the pinned transformers, written out so that config checks import no torch
(tests/unit/test_mca_trainer.py keeps it equal to transformers' ``SchedulerType``)."""
PLAIN_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
"""Schedules that need no ``lr_scheduler_kwargs``; config checks build HF's function only for the others."""


def check_schedule_name(value) -> str:
    """``schedule_name`` against ``STEP_SCHEDULES``, without importing transformers."""
    name = str(getattr(value, "value", value))
    if name in METRIC_DRIVEN:
        return schedule_name(name)  # its message says why
    if name not in STEP_SCHEDULES:
        raise ConfigError(f"lr_scheduler_type {name!r} is not available on the mca backend; choose one of "
                          f"{', '.join(STEP_SCHEDULES)}.")
    return name


def lr_schedules() -> tuple[str, ...]:
    """``lr_scheduler_type`` values the mca backend runs: every HF schedule that depends on the step only."""
    from transformers import SchedulerType

    return tuple(kind.value for kind in SchedulerType if kind.value not in METRIC_DRIVEN)


def schedule_name(value) -> str:
    """The recipe's lr_scheduler_type as a plain name (HF may hand an enum); ConfigError if unsupported."""
    name = str(getattr(value, "value", value))
    if name in METRIC_DRIVEN:
        raise ConfigError(f"lr_scheduler_type {name!r} is not available on the mca backend: "
                          f"{METRIC_DRIVEN[name]}. "
                          f"Choose a step-based schedule: {', '.join(lr_schedules())}.")
    if name not in lr_schedules():
        raise ConfigError(f"lr_scheduler_type {name!r} is not available on the mca backend; choose one of "
                          f"{', '.join(lr_schedules())}.")
    return name


@dataclass
class LRSchedule:
    """Learning rate at each optimizer step, from ``transformers.get_scheduler``'s own schedule function."""

    base_lr: float
    name: str
    total_steps: int
    warmup: float = 0
    """Warmup steps (>= 1) or a ratio of ``total_steps`` (< 1), like HF's ``warmup_steps``."""
    kwargs: dict | None = None
    """HF's ``lr_scheduler_kwargs`` (``min_lr_rate`` for cosine_with_min_lr, ``power`` for polynomial, ...)."""
    _factor: Callable[[int], float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import torch
        from transformers import get_scheduler

        # Some schedules read the optimizer's base rate (polynomial's lr_end, min_lr): give them the recipe's.
        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=self.base_lr)
        try:
            scheduler = get_scheduler(schedule_name(self.name), probe, num_warmup_steps=self.warmup_steps,
                                      num_training_steps=self.total_steps,
                                      scheduler_specific_kwargs=self.kwargs or None)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"lr_scheduler_type {self.name!r} with lr_scheduler_kwargs "
                              f"{self.kwargs or {}}: {exc}. Set lr_scheduler_kwargs to what this schedule takes.") from None
        self._factor = scheduler.lr_lambdas[0]  # LambdaLR: the rate is base_lr * factor(step)

    @property
    def warmup_steps(self) -> int:
        """HF ``TrainingArguments.get_warmup_steps``: steps, or below 1 a ratio of the run rounded up."""
        return int(self.warmup) if self.warmup >= 1 else math.ceil(self.total_steps * self.warmup)

    def lr(self, step: int) -> float:
        """The learning rate used by the update that follows ``step`` completed updates."""
        return self.base_lr * self._factor(step)

    def apply(self, optimizer, step: int) -> float:
        """Set every parameter group's learning rate for the update after ``step``; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def schedule_for(training, total_steps: int) -> LRSchedule:
    """The recipe's schedule over ``total_steps`` (``lr_scheduler_kwargs`` may be a JSON string, as on HF)."""
    kwargs = training.lr_scheduler_kwargs
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs) if kwargs.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"lr_scheduler_kwargs is not a JSON object: {exc}.") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"lr_scheduler_kwargs must be a mapping, e.g. {{min_lr_rate: 0.1}}; "
                          f"got {kwargs!r}.")
    return LRSchedule(training.learning_rate, schedule_name(training.lr_scheduler_type), total_steps,
                      training.warmup_steps, kwargs)


def ddp_config(megatron_args):
    """Megatron's ``DistributedDataParallelConfig`` from the recipe's keys.

    ``grad_reduce_in_fp32``: the ``main_grad`` buffer (where each backward adds its gradients and what
    the all-reduce sums) in fp32, or in the weights' dtype; fp32 weights always reduce in fp32.
    ``overlap_grad_reduce``: start each bucket's all-reduce as soon as its gradients are complete,
    during the backward, in buckets of Megatron's default size (40M elements at DP <= 40), instead of one
    all-reduce of the whole buffer after it (``overlap_grad_reduce_default`` when unset).
    ``average_in_collective`` stays off: with the per-token loss, ``finalize_model_grads`` divides the
    summed gradients by the global batch's token count.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    overlap = megatron_args.overlap_grad_reduce
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=megatron_args.grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce_default() if overlap is None else overlap,
        overlap_param_gather=megatron_args.overlap_param_gather,
        use_distributed_optimizer=megatron_args.use_distributed_optimizer,
        average_in_collective=False)


def overlap_grad_reduce_default() -> bool:
    """On with an accelerator, off on CPU. NCCL reduces on the GPU while the backward computes (Megatron-LM
    recommends the overlap); gloo sums on the same CPU cores the backward runs on, and on 2 cores a DP2 step
    measured no faster with it (docs/performance.md, scripts/profile_mca_ranks.py)."""
    from roll.platform import current_platform

    return current_platform().is_accelerator


def wrap_ddp(chunks: list[torch.nn.Module], megatron_args, *, fp16: bool, bf16: bool) -> list[torch.nn.Module]:
    """Megatron's DDP around each chunk (``ddp_config``; buckets only for the first chunk, as Megatron-LM
    does under the virtual pipeline), after ``Float16Module`` when training in bf16/fp16. Parameters are
    broadcast from data-parallel rank 0 so replicas start equal. The linear and embedding weights are tagged
    to add their gradients into ``main_grad`` in the backward (``backends.mca.wgrad_fusion``)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    from backends.mca.wgrad_fusion import mark_params

    config = chunks[0].config
    if fp16 or bf16:
        # Float16Module casts every floating buffer, the routers' fp32 expert bias too (HF keeps
        # e_score_correction_bias in fp32): Megatron casts it back to fp32 but the rounding stays, so the
        # loaded values are put back after the wrap.
        kept = [[b.detach().clone() for b in _expert_biases(chunk)] for chunk in chunks]
        chunks = [Float16Module(config, chunk) for chunk in chunks]
        for chunk, values in zip(chunks, kept):
            for buffer, value in zip(_expert_biases(chunk), values, strict=True):
                buffer.data = value
    wrapped = [DistributedDataParallel(config, ddp_config(megatron_args), chunk,
                                       disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]
    for chunk in wrapped:
        chunk.broadcast_params()
    mark_params(wrapped)
    return wrapped


def _expert_biases(chunk: torch.nn.Module) -> list[torch.Tensor]:
    """The sigmoid routers' expert-bias buffers of ``chunk``, in module order."""
    return [buffer for name, buffer in chunk.named_buffers() if name.endswith("router.expert_bias")]


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
    kernels = use_fast_adam(optimizer)
    log_rank0(logger, "Adam kernel: %s", ", ".join(sorted(set(kernels))) or "none (no trainable parameters)")
    return optimizer


def use_fast_adam(optimizer) -> list[str]:
    """Run Megatron's inner Adam as one fused (or multi-tensor) kernel over all parameters; returns the
    kernel of each inner optimizer.

    With Transformer Engine or Apex installed Megatron builds their ``FusedAdam`` itself (``te_fused`` /
    ``apex_fused``: left as built). Without them it falls back to ``torch.optim.AdamW`` with torch's
    defaults, which on CPU is the per-parameter loop (a mul / lerp / sqrt / div / addcdiv call for each
    tensor). The same update as one kernel: torch's ``fused`` AdamW on every device it has a kernel for
    (CPU, CUDA, ...: what HF Trainer's default ``adamw_torch_fused`` runs), else ``foreach``. The flags are
    the param groups' own (torch reads them at each step), so Megatron's wrappers, grad clipping and
    checkpoints see the same optimizer. Call it again after a checkpoint load: loading replaces the groups.
    """
    import torch

    kernels = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        base = getattr(inner, "optimizer", None)
        if base is None:  # a rank without trainable parameters
            continue
        if not isinstance(base, torch.optim.Adam):  # TE / Apex FusedAdam, or the CPU-offload hybrid
            kernels.append(_kernel_name(base))
            continue
        params = [param for group in base.param_groups for param in group["params"]]
        fused = _fused_adam_supported(params)
        for settings in (base.defaults, *base.param_groups):
            settings.update(fused=fused, foreach=not fused)
        _own_step_tensors(base, fused)
        kernels.append("torch_fused" if fused else "torch_foreach")
    return kernels


def _fused_adam_supported(params: list[torch.Tensor]) -> bool:
    """torch's fused Adam runs on ``params``: floating point, on devices it has a fused kernel for."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    return all(p.is_floating_point() and p.device.type in devices and not p.is_sparse for p in params)


def _own_step_tensors(base, fused: bool) -> None:
    """One ``step`` tensor per parameter (a loaded checkpoint may share one across all of them, and both
    kernels increment each parameter's in place), float32 on the parameter's device for the fused kernel."""
    import torch

    for param, state in base.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            device = param.device if fused else step.device
            state["step"] = step.detach().to(dtype=torch.float32, device=device, copy=True)


def _kernel_name(base) -> str:
    module = type(base).__module__
    if module.startswith("transformer_engine"):
        return "te_fused"
    if module.startswith("apex"):
        return "apex_fused"
    return type(base).__name__


def install_hooks(chunks: list[torch.nn.Module], optimizer, megatron_args) -> None:
    """Tell the schedules how to sync and finalise gradients (Megatron-LM's wiring)."""
    config = chunks[0].config
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    if len(chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
    if chunks[0].ddp_config.overlap_grad_reduce:  # the resolved value (``ddp_config``)
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        if len(chunks) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    if megatron_args.overlap_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in chunks]
        if len(chunks) == 1:
            config.param_sync_func = config.param_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads_on_device
    config.grad_scale_func = optimizer.scale_loss


def finalize_model_grads_on_device(model, num_tokens=None, pg_collection=None, force_all_reduce=False) -> None:
    """megatron-core's ``finalize_model_grads`` (gradient all-reduce, tied and SP grads), then its per-token
    division by the global batch's token count without reading that count to the host.

    Megatron's own tests ``if num_tokens > 0`` on the device tensor, a wait on the device inside every
    step. Dividing by ``max(count, 1)`` is the same: with no trainable token the gradients are zero.
    ``1.0 / count`` is the same float32 tensor Megatron computes. Collective (broadcast over the
    pipeline, all-reduce over data and context parallel ranks), as Megatron's.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.distributed.finalize_model_grads import get_pp_last_rank

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    if pg_collection is not None:
        pp_group, dp_cp_group = pg_collection.pp, pg_collection.dp_cp
    else:
        pp_group = ps.get_pipeline_model_parallel_group()
        dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    dist.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)  # only the last stage counts
    dist.all_reduce(num_tokens, group=dp_cp_group)
    scaling = 1.0 / num_tokens.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)


def sync_params(chunks: list[torch.nn.Module]) -> None:
    """Bring every rank's model weights up to date now (collective; a no-op without overlap_param_gather).

    With the distributed optimizer and ``overlap_param_gather``, the all-gather of the shards an optimizer
    step updated is deferred to the next forward's pre-hooks, so after a step the weights a rank holds
    outside its own shard are one update old. Checkpoints, the HF export and eval read the weights, so each
    first forces that all-gather (Megatron-LM does the same with ``disable_forward_pre_hook`` around saves
    and evals). The gradient reduction needs no such step: ``finalize_model_grads`` finishes it inside
    every step, overlapped or not.
    """
    for chunk in chunks:
        if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
