"""Megatron-Core settings (the mca backend): parallel layout, distributed optimizer, recompute, MoE.

Recipes stay flat (``tensor_model_parallel_size: 2`` next to ``learning_rate``); these fields form
their own group only in code and in ``--help``. The standard backend ignores them with one warning, except
the MoE loss keys (``BOTH_BACKENDS``), which both backends honour (or both refuse).
"""

from __future__ import annotations

import logging
import math
import typing
from dataclasses import dataclass, fields
from typing import Literal

from roll.config.layout import ParallelLayout
from roll.errors import ConfigError
from roll.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)


@dataclass
class MegatronArguments:
    tensor_model_parallel_size: int = 1
    """[mca] Tensor parallel size (TP)."""

    pipeline_model_parallel_size: int = 1
    """[mca] Pipeline parallel size (PP)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """[mca] Virtual pipeline stages per pipeline rank (VPP, interleaved 1F1B)."""

    context_parallel_size: int = 1
    """[mca] Context parallel size (CP): each sequence is split across CP ranks."""

    expert_model_parallel_size: int = 1
    """[mca] Expert parallel size (EP) for MoE models."""

    expert_tensor_parallel_size: int | None = None
    """[mca] Tensor parallel size inside each expert (ETP); default: TP."""

    sequence_parallel: bool = False
    """[mca] Shard layer-norm/dropout activations along the sequence over the TP group (forced on with TP>1 and EP>1 or an MoE model)."""

    use_distributed_optimizer: bool = False
    """[mca] Shard optimizer state across data-parallel ranks (ZeRO-1 style)."""

    overlap_grad_reduce: bool | None = None
    """[mca] Overlap the gradient reduce-scatter/all-reduce with the backward pass, in buckets. Default (null): on with GPUs (NCCL), off on CPU (gloo: no gain measured, the reduction competes with the backward for the same cores; docs/performance.md)."""

    grad_reduce_in_fp32: bool = True
    """[mca] Accumulate and all-reduce gradients in fp32 (Megatron's ``main_grad`` buffer) when the weights are bf16/fp16; false: in the weights' dtype (half the bytes per all-reduce on NCCL, one more bf16 rounding per sum). No effect in fp32 training."""

    overlap_param_gather: bool = False
    """[mca] Overlap the parameter all-gather with the forward pass (needs the distributed optimizer)."""

    optimizer_cpu_offload: bool = False
    """[mca] Keep the optimizer states and the fp32 master copy on the CPU (Megatron's optimizer offload; GPU only)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """[mca] Activation recomputation: full layers or selective (attention core)."""

    recompute_method: Literal["uniform", "block"] | None = None
    """[mca] With full recompute: how layers are grouped for recomputation (default uniform)."""

    recompute_num_layers: int | None = None
    """[mca] With full recompute: layers per recompute group (uniform) or recomputed layers per stage (block); default 1."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    """[mca] MoE token dispatcher; alltoall accepts sequences of different lengths, allgather needs equal ones."""

    moe_grouped_gemm: bool = False
    """[mca] Run all local experts in one grouped GEMM (needs Transformer Engine on GPU)."""

    moe_aux_loss_coeff: float | None = None
    """MoE load-balancing loss coefficient, on both backends (0: off); default: the model config's
    router_aux_loss_coef (docs/mca-training.md: which loss, which tokens)."""

    moe_aux_loss_coef: float | None = None
    """LLaMA-Factory's spelling of moe_aux_loss_coeff (give one of them)."""

    moe_z_loss_coeff: float | None = None
    """MoE router z-loss coefficient (ST-MoE: the squared logsumexp of each token's router logits), on both
    backends; default null: off (docs/mca-training.md)."""

    moe_expert_capacity_factor: float | None = None
    """Not available: both backends route every token to its top-k experts (drop-less; Hugging Face's MoE
    models have no capacity factor), so any value is refused."""

    bias_activation_fusion: bool = False
    """[mca] Fuse the bias add with the activation (Megatron's fused SwiGLU/GeLU) where Transformer Engine runs
    the layers; on the local spec (CPU) no effect, said once."""

    apply_rope_fusion: bool = False
    """[mca] Apply rotary embeddings with the fused kernel where Transformer Engine runs the layers; on the
    local spec (CPU) no effect, said once."""

    make_vocab_size_divisible_by: int = 1
    """[mca] Pad the embedding/output vocabulary to a multiple of this times TP (Megatron-LM's key; 128 there). Padded rows never enter the loss."""

    calculate_per_token_loss: bool = True
    """Loss = sum of token losses / trainable tokens of the global batch. This is roll's loss definition on both backends; false falls back to Megatron's mean of micro-batch means (mca only, breaks backend parity)."""

    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """[mca] Layer implementation: Transformer Engine when importable on a GPU ('auto'), else Megatron's local spec."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size", "recompute_num_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (or null), got {getattr(self, name)}.")
        self._check_choices()
        self._take_aux_loss_alias()
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("overlap_param_gather=true needs use_distributed_optimizer=true.")
        self._check_recompute()

    def _check_choices(self) -> None:
        """Python does not enforce ``Literal``: a value set in code (not through the parser) is checked here."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            choices, value = _literal_choices(hints[f.name]), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}.")

    def _take_aux_loss_alias(self) -> None:
        coef, coeff = self.moe_aux_loss_coef, self.moe_aux_loss_coeff
        if coef is not None and coeff is not None and coef != coeff:
            raise ConfigError(f"moe_aux_loss_coef={coef} and moe_aux_loss_coeff={coeff} are the same key (LLaMA-"
                              "Factory's spelling and Megatron's): give one of them.")
        self.moe_aux_loss_coeff = coeff if coeff is not None else coef
        self.moe_aux_loss_coef = None  # one field holds the value
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}.")

    def _check_recompute(self) -> None:
        """Megatron's rules for activation recomputation, named by recipe key (its own asserts fire later)."""
        granularity = self.recompute_granularity
        if granularity is None:
            given = [n for n in ("recompute_method", "recompute_num_layers") if getattr(self, n) is not None]
            if given:
                raise ConfigError(f"{' and '.join(given)} only apply with recompute_granularity: full; "
                                  "set recompute_granularity or drop them.")
        elif granularity == "full":
            # Megatron needs both; unset, "full" means what it says: every layer recomputed.
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
        elif granularity == "selective" and self.recompute_num_layers is not None:
            raise ConfigError("recompute_num_layers only applies with recompute_granularity: full (selective "
                              "recomputes the attention core of every layer).")

    def build_layout(self, world_size: int, *, moe: bool = False) -> ParallelLayout:
        """The run's one ParallelLayout, and ``sequence_parallel`` set to the value the layout requires
        (``moe``: the model has routed experts).

        Every entry point (``RunConfig`` validation, ``roll-convert``) calls this once; the layout
        object is then passed on, so the sequence-parallel rule (see ``ParallelLayout``) is applied
        in one place and logged here.
        """
        layout = ParallelLayout(
            world_size=world_size, tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
            vpp=self.virtual_pipeline_model_parallel_size, cp=self.context_parallel_size,
            ep=self.expert_model_parallel_size, etp=self.expert_tensor_parallel_size,
            sequence_parallel=self.sequence_parallel, moe=moe)
        if layout.sequence_parallel and not self.sequence_parallel:
            why = "EP>1" if layout.ep > 1 else "an MoE model (its MoE layers refuse to train without it)"
            log_rank0(logger, f"sequence_parallel turned on: Megatron-Core requires it with TP>1 and {why}.")
        elif self.sequence_parallel and not layout.sequence_parallel:
            warn_once(logger, "sequence_parallel ignored: it only applies with tensor_model_parallel_size > 1.")
        self.sequence_parallel = layout.sequence_parallel
        return layout

    def non_defaults(self) -> dict[str, object]:
        """Fields set to something other than their default that the standard backend ignores (it warns about
        them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default and f.name not in BOTH_BACKENDS}


BOTH_BACKENDS = frozenset({"moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor"})
"""Fields of this group the standard backend honours too."""


def _literal_choices(tp: object) -> tuple:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return tuple(c for arm in typing.get_args(tp) if typing.get_origin(arm) is Literal for c in typing.get_args(arm))
