"""Tensor-parallel LoRA on Megatron's parallel linears, one adapter per HF projection.

``add_lora(module, projections, ...)`` turns a Megatron linear into its LoRA form *in place*: the
module's class is swapped for a subclass (``LoraColumnParallelLinear`` etc., the way
``torch.distributed.fsdp.fully_shard`` swaps classes) and it gains two ``ParameterDict``s,
``lora_A`` and ``lora_B``, keyed by HF projection name. The base parameters keep their names
(``linear_qkv.weight``), so checkpoints, export and the optimizer see the model they know, and the
adapters are ``linear_qkv.lora_A.q_proj`` / ``linear_qkv.lora_B.q_proj`` next to them.

Placement (``tp`` = the base's tensor-parallel group: TP, or expert-TP for experts):

- column-parallel base (``linear_qkv``, ``linear_fc1``): ``lora_A`` [r, in] replicated, ``lora_B``
  [out/tp, r] split like the base's output rows. The low-rank activation ``A x`` passes a
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) before ``B``, so
  ``A``'s gradient and the input gradient are complete on every rank. With sequence parallelism the
  input is all-gathered first (its backward splits, as the gradient is already complete).
- row-parallel base (``linear_proj``, ``linear_fc2``): ``lora_A`` [r, in/tp] split like the base's
  input, ``lora_B`` [out, r] replicated; ``A x`` is all-reduced (``reduce_from_...``) before ``B``,
  and with sequence parallelism the LoRA output is scattered along the sequence like the base's.
- replicated base (Transformer Engine's duplicated ``TELinear``: latent attention's down-projections): both
  weights whole on every rank; under sequence parallelism each rank sees its part of the sequence, so the
  adapters carry the base weight's ``sequence_parallel`` tag and ``finalize_model_grads`` sums them over TP.
- MoE expert linears with explicit expert communication (the token dispatcher moves tokens and
  reduces partial outputs, and the base runs no collective): the LoRA path runs none either; the
  replicated weight passes ``copy_to_...`` with the expert-TP group, so its partial gradient is
  summed in backward. Its parameters carry the base's ``allreduce=False`` tag, so Megatron DDP
  reduces them over the expert-data-parallel group.

So the gradients of replicated adapter weights of a column or row base come out identical on every TP rank
without help from ``finalize_model_grads``: they must *not* be tagged ``sequence_parallel`` (that would sum
them over TP a second time). Split weights get Megatron's ``tensor_model_parallel`` / ``partition_dim``
tags; ``sharded_state_dict`` saves them as TP-sharded tensors and the rest as replicated.

A fused module carries one (A, B) pair per HF projection: q/k/v outputs are interleaved per query
group, gate/up are concatenated per rank, exactly like the base's own output rows; a projection
the recipe does not target contributes zeros. The LoRA output is ``B (A dropout(x)) * alpha / r``,
computed in the adapters' dtype (fp32) and added to the base output; ``(output, bias)`` is kept.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from roll.errors import ModelError

Kind = Literal["column", "row", "replicated"]
_LORA_CLASSES: dict[type, type] = {}


def linear_kind(module: nn.Module) -> Kind:
    """How a Megatron linear splits its weight: column (output rows), row (input columns), or not at all."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    names = [c.__name__ for c in type(module).__mro__]
    if "TEGroupedLinear" in names:
        raise ModelError(f"LoRA on {type(module).__name__} (grouped-GEMM experts) is not supported yet; build the "
                         "experts without grouped GEMM (moe_grouped_gemm: false) or do not target them.")
    if any("ColumnParallel" in n for n in names):
        return "column"
    if any("RowParallel" in n for n in names):
        return "row"
    mode = getattr(module, "parallel_mode", None)  # TELinear: "column" / "row" / "duplicated" / None
    if mode in ("column", "row"):
        return mode
    if mode in ("duplicated", None) and "TELinear" in names:
        return "replicated"
    raise ModelError(f"{type(module).__name__} is not a Megatron parallel linear LoRA can wrap.")


class LoraParallelLinear:
    """Mixin placed before the base class in the swapped class's MRO (see ``add_lora``)."""

    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        result, bias = super().forward(input_, *args, **kwargs)
        x = input_
        if self.lora_norm_output:  # TE LayerNormLinear returns (out, layernorm output): LoRA sees the norm
            result, x = result
        if not self.lora_enabled or not len(self.lora_A):
            return result, bias
        lora = self.lora_forward(x, kwargs.get("runtime_gather_output"))
        return result + lora.to(result.dtype), bias

    def lora_forward(self, x: torch.Tensor, runtime_gather_output: bool | None = None) -> torch.Tensor:
        """The summed LoRA outputs in the base output's layout on this rank (before bias)."""
        from megatron.core import tensor_parallel as tp

        group, sp = self.tp_group, bool(getattr(self, "sequence_parallel", False))
        explicit = bool(getattr(self, "explicit_expert_comm", False))
        x = x.to(next(iter(self.lora_A.values())).dtype)
        if self.lora_kind == "column":
            if sp and not explicit:
                x = tp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
            x = self.lora_dropout(x)
            outs = {}
            for proj, a in self.lora_A.items():
                a = tp.copy_to_tensor_model_parallel_region(a, group=group) if explicit else a
                h = x @ a.t()  # [s, b, r]
                if not explicit:
                    h = tp.copy_to_tensor_model_parallel_region(h, group=group)
                outs[proj] = h @ self.lora_B[proj].t()  # [s, b, out_proj / tp]
            y = self._combine(outs)
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather and not explicit:
                y = tp.gather_from_tensor_model_parallel_region(y, group=group)
        elif self.lora_kind == "row":
            if not getattr(self, "input_is_parallel", True):
                x = tp.scatter_to_tensor_model_parallel_region(x, group=group)
            (proj, a), b = next(iter(self.lora_A.items())), next(iter(self.lora_B.values()))
            h = self.lora_dropout(x) @ a.t()  # [s, b, r], partial sum over the input shards
            if explicit:  # partial output, reduced by the token dispatcher like the base's
                y = h @ tp.copy_to_tensor_model_parallel_region(b, group=group).t()
            else:
                h = tp.reduce_from_tensor_model_parallel_region(h, group=group)
                y = h @ b.t()
                if sp:
                    y = tp.scatter_to_sequence_parallel_region(y, group=group)
        else:
            (proj, a), b = next(iter(self.lora_A.items())), next(iter(self.lora_B.values()))
            y = self.lora_dropout(x) @ a.t() @ b.t()
        return y * self.lora_scaling

    def _combine(self, outs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-projection outputs -> the fused module's local output layout (missing ones are zeros)."""
        sizes = self.lora_out_sizes  # local output rows per projection, in the fused order
        ref = next(iter(outs.values()))
        parts = [outs.get(p, ref.new_zeros(*ref.shape[:-1], n)) for p, n in sizes.items()]
        if self.lora_fusion == "qkv":  # [g0: q (nh/ng heads), k, v | g1: ...] per local query group
            groups = self.lora_local_groups
            parts = [p.reshape(*p.shape[:-1], groups, -1) for p in parts]
            return torch.cat(parts, dim=-1).reshape(*ref.shape[:-1], -1)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base's sharded state dict with the adapters placed right: the split adapter weight
        (``lora_B`` of a column base, dim 0; ``lora_A`` of a row base, dim 1) is TP-sharded, the
        other one replicated. Keys are ``<prefix>lora_A.<proj>`` / ``<prefix>lora_B.<proj>``."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        adapters = {f"lora_{ab}.{proj}": p
                    for ab, params in (("A", self.lora_A), ("B", self.lora_B)) for proj, p in params.items()}
        axis = {k: p.partition_dim for k, p in adapters.items() if getattr(p, "tensor_model_parallel", False)}
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            from megatron.core import parallel_state as ps

            dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        sharded.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets,
                                                           tp_group=self.tp_group, dp_cp_group=dp_cp_group))
        return sharded


def _lora_class(base_cls: type) -> type:
    if base_cls not in _LORA_CLASSES:
        _LORA_CLASSES[base_cls] = type(f"Lora{base_cls.__name__}", (LoraParallelLinear, base_cls), {})
    return _LORA_CLASSES[base_cls]


def add_lora(module: nn.Module, projections: dict[str, int], *, rank: int, alpha: float, dropout: float = 0.0,
             fusion: Literal["qkv", "concat", "single"] = "single", local_groups: int = 1,
             targeted: tuple[str, ...] | None = None, rslora: bool = False) -> None:
    """Give a Megatron linear one LoRA adapter per projection it computes (in place).

    ``projections``: every HF projection the module's output holds, in its fused order, with its
    *local* output rows (``{"q_proj": ..., "k_proj": ..., "v_proj": ...}`` for ``linear_qkv``);
    ``targeted`` the subset that gets an adapter (default all). ``fusion`` says how the local outputs
    interleave: per query group (``qkv``, ``local_groups`` groups on this rank), concatenated
    (``concat``, fc1's [gate_r; up_r]) or a single projection. Adapters start as zeros (A and B):
    ``init_lora_weights`` sets PEFT's values. Parameters are fp32 on the base weight's device.
    """
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    if isinstance(module, LoraParallelLinear):
        raise ModelError(f"{type(module).__name__} already has LoRA adapters.")
    kind = linear_kind(module)
    weight = module.weight
    out_local, in_local = weight.shape
    if sum(projections.values()) != out_local:
        raise ModelError(f"LoRA projections {projections} do not add up to the module's {out_local} output rows.")
    if kind == "row" and len(projections) != 1:
        raise ModelError("a row-parallel linear computes one projection; got " + ", ".join(projections))
    module.__class__ = _lora_class(type(module))
    module.lora_kind, module.lora_fusion, module.lora_local_groups = kind, fusion, local_groups
    module.lora_out_sizes = dict(projections)
    module.lora_scaling, module.lora_rank, module.lora_enabled = alpha / rank, rank, True
    if rslora:  # rank-stabilised LoRA (Kalajdzievski 2023), PEFT's use_rslora
        module.lora_scaling = alpha / math.sqrt(rank)
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_norm_output = hasattr(module, "return_layernorm_output")  # TE LayerNormLinear
    if module.lora_norm_output:
        module.return_layernorm_output = True
    module.lora_A, module.lora_B = nn.ParameterDict(), nn.ParameterDict()
    allreduce = getattr(weight, "allreduce", True)
    for proj in (targeted or tuple(projections)):
        a = nn.Parameter(torch.zeros(rank, in_local, device=weight.device, dtype=torch.float32))
        b = nn.Parameter(torch.zeros(projections[proj], rank, device=weight.device, dtype=torch.float32))
        if kind == "column":
            set_tensor_model_parallel_attributes(b, True, 0, 1)
        elif kind == "row":
            set_tensor_model_parallel_attributes(a, True, 1, 1)
        for p in (a, b):
            p.allreduce = allreduce  # False on expert linears: DDP reduces them over expert-DP
            if kind == "replicated" and getattr(weight, "sequence_parallel", False):
                # a duplicated TELinear (latent attention's down-projections under TE) sees this rank's part of
                # the sequence: finalize_model_grads sums its adapters' gradients over TP, as the base weight's
                p.sequence_parallel = True
        module.lora_A[proj], module.lora_B[proj] = a, b
