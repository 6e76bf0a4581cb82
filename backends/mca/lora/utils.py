"""Adapter utilities for Megatron-Core models: find the modules LoRA can adapt, by normalised name.

Names are *layer patterns*: a module's dotted name inside its ``GPTModel`` with every numeric
component (layer and expert indices) dropped and the leading ``decoder.layers.`` removed, so the N
decoder layers collapse into one entry:

    decoder.layers.3.self_attention.linear_qkv               -> self_attention.linear_qkv
    decoder.layers.0.mlp.experts.local_experts.5.linear_fc1  -> mlp.experts.local_experts.linear_fc1
    embedding                                                 -> embedding
    output_layer                                              -> output_layer

Transformer Engine classes are matched by class name (so this works, and is testable, without TE
installed); Megatron's local parallel linears by instance. Nothing here initialises Megatron or
needs a process group: the functions only walk ``named_modules()``.

Also here: the HF projection names (``q_proj`` ... ``down_proj``) <-> Megatron module patterns
table that lets a recipe say ``lora_target: q_proj,v_proj`` on either backend.
"""

from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from roll.errors import ConfigError
from roll.logging import warn_once

logger = logging.getLogger(__name__)

TE_LINEAR_CLASSES = ("TELinear", "TEGroupedLinear", "TELayerNormColumnParallelLinear", "TEColumnParallelLinear",
                     "TERowParallelLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")
"""Transformer Engine linear wrappers of megatron.core.extensions.transformer_engine, by class name."""

MCA_TO_HF: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    # multi-latent attention (DeepSeek-V3): each Megatron linear is one HF nn.Linear, the same weight
    # (backends/mca/models/templates/deepseek_v3.py maps them 1:1)
    "self_attention.linear_q_proj": ("q_proj",),  # q_lora_rank null
    "self_attention.linear_q_down_proj": ("q_a_proj",),
    "self_attention.linear_q_up_proj": ("q_b_proj",),
    "self_attention.linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "self_attention.linear_kv_up_proj": ("kv_b_proj",),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
    # shared experts (DeepSeek-V3, GLM-4.5, Qwen2-MoE) are plain nn.Linear in HF: PEFT adapts them by the same names
    "mlp.shared_experts.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.shared_experts.linear_fc2": ("down_proj",),
}
"""Megatron layer pattern -> the HF projections it computes, in the fused module's output order. q/k/v share
the fused ``linear_qkv`` and gate/up the fused ``linear_fc1``: the Megatron LoRA keeps one adapter *per HF
projection* inside the fused module (see docs/mca-lora.md), so ``q_proj`` alone adapts only q. The HF module
of each (its path in ``model.layers.N``) comes from the family's conversion template (``lora/export.py``)."""

HF_TO_MCA: dict[str, tuple[str, ...]] = {}
"""HF projection name -> every Megatron layer pattern that computes one, as PEFT matches a target by the
module's last name: ``gate_proj`` is the dense MLP's and the shared experts' (DeepSeek-V3's dense first layers
and its MoE layers), ``q_proj`` GQA's fused q (``linear_qkv``) or latent attention's ``linear_q_proj``."""
for _pattern, _projs in MCA_TO_HF.items():
    for _proj in _projs:
        HF_TO_MCA[_proj] = HF_TO_MCA.get(_proj, ()) + (_pattern,)

HF_ORDER = ("q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
            "gate_proj", "up_proj", "down_proj")
"""HF projection names in the order HF registers them in a decoder layer (the order PEFT creates, and seeds,
their adapters): GQA and latent attention share only q_proj (first in both) and o_proj."""

PEFT_EXPERT_MLP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_moe")
"""model_types on which PEFT (0.21, through transformers 5's weight conversion) moves the MLP targets
``gate_proj``/``up_proj``/``down_proj`` (also when ``all`` resolves to them) to the routed experts' fused
parameters (``mlp.experts.gate_up_proj`` at rank 2r, ``down_proj``): the dense first layers and the shared experts
are then not adapted. roll's Megatron LoRA has no exportable adapter for routed experts, so it refuses these
targets there rather than adapt other modules than the standard backend
(``peft.utils.transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING``; pinned by a unit test)."""

UNMAPPED_HF_LINEARS = {"mlp.shared_experts.gate_weight": "shared_expert_gate"}
"""Megatron parameters whose HF module is an nn.Linear that PEFT's ``all`` adapts but roll's LoRA cannot (not a
Megatron linear module): Qwen2-MoE's shared-expert gate."""


def normalize_name(name: str) -> str:
    """``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1`` -> ``mlp.experts.local_experts.linear_fc1``."""
    parts = [part for part in name.split(".") if not part.isdigit()]
    pattern = ".".join(parts)
    return pattern[len("decoder.layers."):] if pattern.startswith("decoder.layers.") else pattern


def find_layers(model: nn.Module, cond: Callable[[str, nn.Module], bool]) -> list[str]:
    """Normalised names (see the module docstring) of the modules for which ``cond(name, module)``
    is true, deduplicated, in first-seen order. ``name`` passed to ``cond`` is the full dotted name."""
    found: dict[str, None] = {}
    for name, module in model.named_modules():
        if name and cond(name, module):
            found.setdefault(normalize_name(name), None)
    return list(found)


def is_parallel_linear(module: nn.Module) -> bool:
    """A Megatron linear: local Column/RowParallelLinear (experts included) or a TE class (by name)."""
    if type(module).__name__ in TE_LINEAR_CLASSES or any(c.__name__ in TE_LINEAR_CLASSES for c in type(module).__mro__):
        return True
    try:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    except ImportError:
        return False
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def find_all_linear_modules(model: nn.Module, include_output_layer: bool = False) -> list[str]:
    """Every parallel linear's layer pattern, e.g. ``["self_attention.linear_qkv",
    "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]``; the output head
    (``output_layer``) only when ``include_output_layer``. The MoE router is not a linear here
    (it is a plain parameter; see ``find_all_router_modules``)."""
    def cond(name: str, module: nn.Module) -> bool:
        return is_parallel_linear(module) and (include_output_layer or normalize_name(name) != "output_layer")

    return find_layers(model, cond)


def find_all_embedding_modules(model: nn.Module) -> list[str]:
    """The word-embedding module(s), e.g. ``["embedding"]`` (Megatron's ``LanguageModelEmbedding``)."""
    return find_layers(model, lambda name, module: type(module).__name__ == "LanguageModelEmbedding")


def find_all_router_modules(model: nn.Module) -> list[str]:
    """MoE routers, e.g. ``["mlp.router"]`` (any ``*Router`` class: TopKRouter and subclasses)."""
    return find_layers(model, lambda name, module: any(c.__name__ == "Router" for c in type(module).__mro__))


def set_linear_is_expert(model: nn.Module) -> int:
    """Mark every linear inside a routed-experts block ``is_expert = True`` (in place); returns how
    many. Megatron's MoE layers already build them so; this makes it explicit for code (LoRA) that
    must pick the expert groups, and fixes models whose experts were built without the flag.
    Shared experts are not routed experts and are left alone."""
    count = 0
    for name, module in model.named_modules():
        parts = name.split(".")
        if "experts" in parts and "shared_experts" not in parts and is_parallel_linear(module):
            module.is_expert = True
            count += 1
    return count


def resolve_lora_targets(model: nn.Module, targets: list[str] | str) -> dict[str, tuple[str, ...]]:
    """``lora_target`` -> {Megatron layer pattern: the HF projections to adapt in it}.

    ``all``: every linear ``find_all_linear_modules`` finds that has an HF projection (attention, latent
    attention, dense MLP, shared experts); routed experts are skipped with a warning, which is also what PEFT's
    ``all`` gives on transformers 5's fused-expert HF models. A list may name HF projections (``q_proj,v_proj``:
    every module computing one, as PEFT matches names) or Megatron modules (``linear_qkv`` = q, k and v).
    """
    present = set(find_all_linear_modules(model))
    if targets == "all":
        unmapped = sorted({hf for name, _ in model.named_parameters() for suffix, hf in UNMAPPED_HF_LINEARS.items()
                           if name.endswith(suffix)})
        if unmapped:
            names = [p for p in HF_ORDER if any(p in MCA_TO_HF.get(pattern, ()) for pattern in present)]
            raise ConfigError(f"lora_target all: the standard backend's PEFT would also adapt {', '.join(unmapped)} "
                              "(an nn.Linear in HF), which has no LoRA mapping on the mca backend, so the two backends "
                              f"would train different adapters. Name the targets: lora_target: {','.join(names)}.")
        chosen = {p: MCA_TO_HF[p] for p in MCA_TO_HF if p in present}
    else:
        chosen = {}
        short: dict[str, tuple[str, ...]] = {}
        for pattern in MCA_TO_HF:
            short[pattern.rsplit(".", 1)[-1]] = short.get(pattern.rsplit(".", 1)[-1], ()) + (pattern,)
        for target in targets:
            if target in HF_TO_MCA:
                patterns, projs = HF_TO_MCA[target], (target,)
            elif target in MCA_TO_HF or target in short:
                patterns = short.get(target, (target,))
                projs = ()
            else:
                raise ConfigError(f"lora_target {target!r} is not supported on the mca backend; use 'all' or HF "
                                  f"projection names ({', '.join(HF_ORDER)}) or Megatron modules "
                                  f"({', '.join(sorted(short))}).")
            found = [p for p in patterns if p in present]
            if not found:
                raise ConfigError(f"lora_target {target!r}: this model has no {' or '.join(map(repr, patterns))} "
                                  f"module (its linear modules: {', '.join(sorted(present))}).")
            for pattern in found:
                chosen[pattern] = tuple(dict.fromkeys(chosen.get(pattern, ()) + (projs or MCA_TO_HF[pattern])))
    if not chosen:
        raise ConfigError(f"lora_target={targets!r} selects no module of this model.")
    _refuse_peft_expert_targets(model, targets, chosen)
    skipped = sorted(p for p in present if p not in MCA_TO_HF) if targets == "all" else []
    if skipped:
        warn_once(logger, f"lora_target=all: no HF adapter mapping for {', '.join(skipped)} "
                          "(MoE experts); these modules are not adapted.")
    return {p: tuple(h for h in HF_ORDER if h in projs) for p, projs in chosen.items()}


def _refuse_peft_expert_targets(model: nn.Module, targets, chosen: dict[str, tuple[str, ...]]) -> None:
    model_type = getattr(getattr(model, "config", None), "hf_model_type", None)
    mlp = sorted({p for projs in chosen.values() for p in projs if p in ("gate_proj", "up_proj", "down_proj")},
                 key=HF_ORDER.index)
    if model_type not in PEFT_EXPERT_MLP_FAMILIES or not mlp:
        return
    present = set(find_all_linear_modules(model))
    attention = [p for p in HF_ORDER if any(pattern in present and pattern.startswith("self_attention.")
                                            for pattern in HF_TO_MCA[p])]
    raise ConfigError(f"lora_target {targets if targets == 'all' else ','.join(targets)}: on model_type "
                      f"{model_type!r} the standard backend's PEFT applies {', '.join(mlp)} to the routed experts' "
                      "fused parameters (transformers 5's weight conversion), not to the dense MLP or the shared "
                      "experts, and the mca backend has no LoRA for routed experts yet: the two backends would "
                      f"train different adapters. Adapt the attention: lora_target: {','.join(attention)}.")
