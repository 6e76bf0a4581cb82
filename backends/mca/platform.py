"""Megatron-Core where it assumes CUDA and Transformer Engine: the one place that patches it.

megatron-core assumes CUDA in ~175 ``torch.cuda.current_device()`` call sites, ~60 hard-coded
``device="cuda"`` tensors (optimizer, clip_grads, schedules, p2p), a CUDA-only RNG tracker, CUDA
streams in the MoE alltoall dispatcher, and (0.16.x) a ``NameError`` in the MoE router when
Transformer Engine is absent; without TE/Apex its torch norms also refuse sequence parallelism, and
gloo refuses the uneven collectives MoE with expert-TP issues; on any device its expert-bias token count does not
broadcast its padding mask (``expert_bias_padding_mask``). One more is not about the platform: the
checkpoint reader PyTorch and megatron use would unpickle anything a checkpoint holds
(``restricted_checkpoint_reads``, applied everywhere; docs/reliability.md, "What roll trusts"). The CUDA
ones (a CPU-only torch build) are written in ``backends.mca.cpu_build``, the patches to checkpoint reads (that one and ``distopt_step_on_load``) are written in ``backends.mca.checkpoint_reads``,
the multi-tensor scale without extra copies (``foreach_multi_tensor_scale``) in ``backends.mca.multi_tensor``,
the weight gradients written into ``main_grad`` in the backward (``wgrad_into_main_grad``, Megatron's
gradient accumulation fusion without Apex) in ``backends.mca.wgrad_fusion``,
and one about the objective, the router z-loss's scale under TP / CP (``moe_z_loss_scale_per_token``), in
``backends.mca.moe_loss_scale``; this module's table and ``apply_patches`` are the one entry point for all but one:
``lazy_jit_fuser`` (``backends.mca.lazy_jit``: megatron's ``jit_fuser`` builds ``torch.compile`` on a
decorated function's first call, not at import, saving ~1.5 s of CPU per process) must act before megatron is
imported, so ``backends/mca/__init__`` installs it; it can go when megatron-core defers ``torch.compile``.

Each patch says what it fixes, when it can go, and is applied exactly when the condition it fixes
holds (``_Patch.needed``): the CUDA ones only without an accelerator, the MoE-router one whenever
megatron's MoE utilities were imported without TE (on any device), the norm one whenever torch
norms can be built (no Apex; also a GPU running the local spec), the gloo one under gloo. All are
also gated on the megatron-core version. They touch no megatron file and are process-wide and
permanent: never apply them inside a test runner's own process (tests run Megatron in subprocesses).

Not patched here, because they are features rather than bugs: context parallelism and packed (THD)
sequences need TE attention; ``backends.mca.attention.LocalCoreAttention`` covers them on CPU.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from packaging.version import Version

from backends.mca.checkpoint_reads import patch_distopt_step_on_load, patch_restricted_checkpoint_reads
from backends.mca.cpu_build import (patch_cuda_streams, patch_current_device, patch_default_causal_mask,
                                    patch_hardcoded_cuda, patch_moe_split_sizes, patch_rng_tracker)
from backends.mca.mla_rope_key_grad import patch_mla_rope_key_grad
from backends.mca.moe_loss_scale import patch_moe_z_loss_scale_per_token
from backends.mca.multi_tensor import patch_local_multi_tensor_scale, uses_local_multi_tensor_scale
from backends.mca.wgrad_fusion import fused_kernel_absent, patch_wgrad_into_main_grad
from roll.logging import log_rank0, warn_once
from roll.platform import current_platform

logger = logging.getLogger(__name__)

TESTED_VERSIONS = (Version("0.16.1"), Version("0.20"))
"""megatron-core versions these patches were verified against: [low, high)."""


@dataclass(frozen=True)
class _Patch:
    name: str
    apply: Callable[[], None]
    remove_when: str
    """The condition under which the patch can be deleted."""
    needed: Callable[[], bool]
    """Whether this process has the problem the patch fixes (no accelerator, no TE, gloo, ...)."""
    fixed_in: Version | None = None
    """First megatron-core version that no longer needs it (it is skipped there)."""


_applied: list[str] = []


def megatron_core_version() -> Version:
    from megatron.core import package_info

    return Version(package_info.__version__)


def applied_patches() -> tuple[str, ...]:
    """Names of the patches active in this process (empty on a GPU with TE and NCCL)."""
    return tuple(_applied)


def apply_patches() -> None:
    """Apply every patch whose condition holds in this process. Idempotent.

    Call it before building a model; ``initialize_megatron`` does (after the process group exists,
    so the gloo condition is known).
    """
    todo = [p for p in _PATCHES if p.name not in _applied and p.needed()]
    if not todo:
        return
    version = megatron_core_version()
    low, high = TESTED_VERSIONS
    if not low <= version < high:
        warn_once(logger, f"megatron-core {version} is outside the range the compat patches were verified on "
                          f"([{low}, {high})); CPU and non-TE runs may fail in new places.")
    new = []
    for patch in todo:
        if patch.fixed_in is not None and version >= patch.fixed_in:
            continue
        patch.apply()
        _applied.append(patch.name)
        new.append(patch.name)
    if new:
        log_rank0(logger, "megatron-core %s on %s: applied compat patches %s", version,
                  current_platform().device_type, ", ".join(new))
        if _torch_adam_fallback():  # megatron's own 7 import-time warnings are silenced in backends/mca/__init__
            log_rank0(logger, "Transformer Engine and Apex are not installed: megatron-core uses its local "
                              "fallbacks (torch norms, torch AdamW run fused, local multi-tensor kernels)")


# --------------------------------------------------------------------------------------------------
# When each patch is needed
# --------------------------------------------------------------------------------------------------

def _no_accelerator() -> bool:
    return not current_platform().is_accelerator


def _moe_utils_without_te_gemm() -> bool:
    """megatron imported its MoE utilities without TE's GEMM (TE missing or broken), on any device."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _torch_norms_possible() -> bool:
    """Without Apex the local spec builds ``WrappedTorchNorm`` (on a GPU too, with transformer_impl local)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return not getattr(gpt_layer_specs, "HAVE_APEX", False)


def _torch_adam_fallback() -> bool:
    """Without TE and Apex, Megatron's optimizers wrap torch's AdamW (on any device)."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def _always() -> bool:
    """Not a platform problem: every process that reads checkpoints needs it."""
    return True


def _gloo() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_backend() == "gloo"
    return current_platform().dist_backend == "gloo"


# --------------------------------------------------------------------------------------------------
# The patches written here (those of a CPU-only torch build: backends.mca.cpu_build)
# --------------------------------------------------------------------------------------------------

def _patch_moe_router_without_te() -> None:
    """megatron-core 0.16.x defines ``moe_utils.te_general_gemm`` only when TE imports, then tests
    ``te_general_gemm is not None`` in the router: ``NameError`` without TE, on any device."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_expert_bias_padding_mask() -> None:
    """megatron-core 0.16.1's ``TopKRouter._apply_expert_bias`` (the token count behind the expert-bias update of
    sigmoid routers: GLM-4.5, DeepSeek-V3) masks the ``[tokens, experts]`` routing map with the ``[tokens]``
    padding mask, which does not broadcast: every training step of such a model given a padding mask (roll passes
    one for MoE models) fails. The same count, with the mask as ``[tokens, 1]``, on any device."""
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)  # [tokens, 1]: True = padding
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias


def _mla_sees_mock_te() -> bool:
    """megatron-core 0.16.1 imports TE's classes for multi-latent attention inside a ``try`` that succeeds without
    TE, with mocks in their place; it then sets ``HAVE_TE`` and calls ``isinstance(..., TELinear)`` on a mock."""
    from megatron.core.transformer import multi_latent_attention as mla

    return mla.HAVE_TE and not isinstance(mla.TELinear, type)


def _patch_mla_without_te() -> None:
    """Multi-latent attention (DeepSeek-V3) without Transformer Engine: ``HAVE_TE`` false in its module, so it
    builds with the local spec instead of raising ``TypeError`` from ``isinstance`` on the mock."""
    from megatron.core.transformer import multi_latent_attention as mla

    mla.HAVE_TE = False


def _patch_torch_norm_sequence_parallel() -> None:
    """Without TE/Apex the local spec (and the final norm) uses ``WrappedTorchNorm``, which asserts
    ``not config.sequence_parallel``; yet SP is required for TP>1 with EP>1. Under SP a norm sees a
    sequence shard, so its weight grads are partial: tag them ``sequence_parallel`` like TE/Apex
    norms do, and ``finalize_model_grads`` sums them over the TP group."""
    import megatron.core.transformer.torch_norm as torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)  # only to pass the assert; the norm itself has no SP logic
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


def _patch_gloo_uneven_first_dim() -> None:
    """MoE with expert-tensor parallelism > 1 gathers and reduce-scatters token blocks of *uneven*
    size over the expert-TP group (``mappings._gather_along_first_dim`` /
    ``_reduce_scatter_along_first_dim`` with split sizes). NCCL accepts uneven lists; gloo raises
    "invalid tensor size" and has no list reduce-scatter. Pad the gather to the largest block;
    reduce-scatter as all-reduce + own slice. Equal-size paths are left to megatron."""
    import megatron.core.tensor_parallel.mappings as mappings
    import torch.distributed as dist

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(blocks, padded, group=group)
        return torch.cat([block[:size] for block, size in zip(blocks, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]]

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


_UPSTREAM_CPU = "megatron-core supports CPU-only torch builds (not the case up to 0.19.2)"

_PATCHES: tuple[_Patch, ...] = (
    _Patch("rng_tracker", patch_rng_tracker, _UPSTREAM_CPU, _no_accelerator),
    _Patch("current_device", patch_current_device, _UPSTREAM_CPU, _no_accelerator),
    _Patch("default_causal_mask", patch_default_causal_mask, _UPSTREAM_CPU, _no_accelerator),
    _Patch("hardcoded_cuda", patch_hardcoded_cuda, _UPSTREAM_CPU, _no_accelerator),
    _Patch("moe_router_without_te", _patch_moe_router_without_te, "megatron-core >= 0.19 is the minimum",
           _moe_utils_without_te_gemm, fixed_in=Version("0.19")),
    _Patch("cuda_streams", patch_cuda_streams, _UPSTREAM_CPU, _no_accelerator),
    _Patch("moe_split_sizes", patch_moe_split_sizes, _UPSTREAM_CPU, _no_accelerator),
    _Patch("torch_norm_sequence_parallel", _patch_torch_norm_sequence_parallel,
           "WrappedTorchNorm supports sequence parallelism upstream (not as of 0.19.2)", _torch_norms_possible),
    _Patch("gloo_uneven_first_dim", _patch_gloo_uneven_first_dim,
           "gloo supports uneven all_gather lists and list reduce_scatter", _gloo),
    _Patch("distopt_step_on_load", patch_distopt_step_on_load,
           "DistributedOptimizer loads fully_reshardable checkpoints with torch's AdamW (not in 0.16.1)",
           _torch_adam_fallback),
    _Patch("foreach_multi_tensor_scale", patch_local_multi_tensor_scale,
           "megatron-core's local multi_tensor_scale scales in place (not as of 0.16.1)", uses_local_multi_tensor_scale),
    _Patch("wgrad_into_main_grad", patch_wgrad_into_main_grad,
           "megatron-core's gradient_accumulation_fusion runs without Apex's CUDA kernel and adds a tied embedding's "
           "rows without a dense [vocab, hidden] gradient (not as of 0.16.1)", fused_kernel_absent),
    _Patch("expert_bias_padding_mask", _patch_expert_bias_padding_mask,
           "TopKRouter._apply_expert_bias broadcasts the padding mask per token (not as of 0.16.1)", _always),
    _Patch("mla_without_te", _patch_mla_without_te,
           "multi_latent_attention imports TE's classes only when TE is installed (not as of 0.16.1)",
           _mla_sees_mock_te),
    _Patch("mla_rope_key_grad", patch_mla_rope_key_grad,
           "multi-latent attention sums the shared RoPE key's gradient over TP after gathering a column-parallel "
           "linear_kv_down_proj (not as of 0.16.1; test_mca_lora's mla_tp2sp fails without it)", _always),
    _Patch("restricted_checkpoint_reads", patch_restricted_checkpoint_reads,
           "torch.distributed.checkpoint unpickles .metadata and bytes entries with an allow-list", _always),
    _Patch("moe_z_loss_scale_per_token", patch_moe_z_loss_scale_per_token,
           "megatron-core's router keeps the z-loss at its coefficient under TP / CP with the per-token loss "
           "(not in 0.16.1; tp2_mixtral_moe_losses fails once it is scaled twice)", _always),
)
