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

HF_TO_MCA: dict[str, str] = {
    "q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2",
}
"""HF projection name -> the Megatron module (layer pattern) that computes it. q/k/v share the fused
``linear_qkv`` and gate/up the fused ``linear_fc1``: the Megatron LoRA keeps one adapter *per HF
projection* inside the fused module (see docs/mca-lora.md), so ``q_proj`` alone adapts only q."""

MCA_TO_HF: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
"""Megatron layer pattern -> its HF projections, in the order HF registers them (the order PEFT
creates, and seeds, their adapters)."""

MLA_MODULES = ("self_attention.linear_q_proj", "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
               "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")
"""Multi-latent attention's projections (DeepSeek-V3): LoRA on them is refused until they are mapped."""

HF_PARENT: dict[str, str] = {"self_attention": "self_attn", "mlp": "mlp"}
"""Megatron sub-module of a decoder layer -> the HF one (``model.layers.N.<parent>.<proj>``)."""

HF_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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

    ``all``: every linear ``find_all_linear_modules`` finds that has an HF projection (attention and
    dense MLP); linears without one (MoE routed/shared experts) are skipped with a warning, which is
    also what PEFT's ``all`` gives on transformers 5's fused-expert HF models. A list may name HF
    projections (``q_proj,v_proj``) or Megatron modules (``linear_qkv`` = q, k and v).
    """
    present = set(find_all_linear_modules(model))
    latent = sorted(present & set(MLA_MODULES))
    if latent:
        raise ConfigError(f"finetuning_type lora: this model's multi-latent attention ({', '.join(latent)}) has no "
                          "LoRA mapping on the mca backend yet, so it would adapt other modules than the standard "
                          "backend's PEFT. Train it with finetuning_type: full, or LoRA on the standard backend "
                          "(use_mca: false).")
    if targets == "all":
        skipped = sorted(p for p in present if p not in MCA_TO_HF)
        if skipped:
            warn_once(logger, f"lora_target=all: no HF adapter mapping for {', '.join(skipped)} "
                              "(MoE experts); these modules are not adapted.")
        chosen = {p: MCA_TO_HF[p] for p in MCA_TO_HF if p in present}
    else:
        chosen = {}
        short = {p.rsplit(".", 1)[-1]: p for p in MCA_TO_HF}
        for target in targets:
            if target in HF_TO_MCA:
                pattern, projs = HF_TO_MCA[target], (target,)
            elif target in MCA_TO_HF or target in short:
                pattern = short.get(target, target)
                projs = MCA_TO_HF[pattern]
            else:
                raise ConfigError(f"lora_target {target!r} is not supported on the mca backend; use 'all' or HF "
                                  f"projection names ({', '.join(HF_ORDER)}) or Megatron modules "
                                  f"({', '.join(MCA_TO_HF)}).")
            if pattern not in present:
                raise ConfigError(f"lora_target {target!r}: this model has no {pattern!r} module "
                                  f"(its linear modules: {', '.join(sorted(present))}).")
            chosen[pattern] = tuple(dict.fromkeys(chosen.get(pattern, ()) + projs))
    if not chosen:
        raise ConfigError(f"lora_target={targets!r} selects no module of this model.")
    return {p: tuple(h for h in HF_ORDER if h in projs) for p, projs in chosen.items()}
