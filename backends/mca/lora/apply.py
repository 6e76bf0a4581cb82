"""The LoRA entry point of the mca backend: adapters on every chunk, PEFT's initial values, selection.

``apply_lora(chunks, finetuning, seed)`` runs after loading and before DDP wrapping: it resolves
``lora_target``, gives each targeted Megatron linear one adapter per HF projection (``layers.add_lora``),
initialises them exactly as PEFT initialises them on the HF model with the same seed, and freezes
everything else. Adapter parameters are fp32.

PEFT's initial values (peft 0.21.2, ``init_lora_weights=True``): for each adapted ``nn.Linear`` in the
HF model's module order, ``LoraLayer.update_layer`` builds ``lora_A = nn.Linear(in, r)`` and
``lora_B = nn.Linear(r, out)`` (two kaiming-uniform draws from the global generator) and
``reset_lora_parameters`` redraws A with ``kaiming_uniform_(a=sqrt(5))`` and zeroes B. The standard
backend calls ``set_seed(seed)`` right before ``get_peft_model``; here a private generator seeded with
``seed`` replays the same draws for every HF projection of every layer, and each rank keeps its
layers' values (its shard of ``lora_A`` for row-parallel bases).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from backends.mca.lora.layers import LoraParallelLinear, add_lora
from backends.mca.lora.utils import HF_ORDER, normalize_name, resolve_lora_targets, set_linear_is_expert
from backends.mca.models.gpt import chunk_placements
from backends.mca.models.unwrap import unwrap_model
from roll.errors import ModelError
from roll.logging import log_rank0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSpec:
    """What ``apply_lora`` did; export writes it as the adapter's ``adapter_config.json``."""

    rank: int
    alpha: float
    dropout: float
    targets: dict[str, tuple[str, ...]]
    """Megatron layer pattern -> the HF projections adapted in it."""
    rslora: bool = False
    """Rank-stabilised scaling, alpha / sqrt(rank) (PEFT's ``use_rslora``), instead of alpha / rank."""

    @property
    def hf_target_modules(self) -> list[str]:
        return [p for p in HF_ORDER if any(p in projs for projs in self.targets.values())]

    def peft_config(self, base_model_name_or_path: str | None = None, modules: list[str] | None = None):
        """The PEFT ``LoraConfig`` of these adapters (written as ``adapter_config.json``): what PEFT needs to
        rebuild the same model, the scaling included. ``modules``: full module names instead of the short ones."""
        from peft import LoraConfig, TaskType

        return LoraConfig(task_type=TaskType.CAUSAL_LM, r=self.rank, lora_alpha=self.alpha,
                          lora_dropout=self.dropout, use_rslora=self.rslora,
                          target_modules=modules or self.hf_target_modules,
                          base_model_name_or_path=base_model_name_or_path)


def apply_lora(chunks: list[nn.Module], finetuning, seed: int) -> list[nn.Module]:
    """Add LoRA adapters to every model chunk (VPP too) in place and return the chunks.

    ``finetuning``: a ``FinetuningArguments`` (``lora_rank``, ``lora_alpha``, ``lora_dropout``,
    ``lora_target``). Call before DDP / Float16Module wrapping, on bare GPTModels. Afterwards only
    adapter parameters require grad; the spec is kept on each chunk (``chunk.lora_spec``).
    """
    bare = [unwrap_model(chunk) for chunk in chunks]
    if any(b is not c for b, c in zip(bare, chunks)):
        raise ModelError("apply_lora needs the bare model chunks: call it before DDP / Float16Module wrapping.")
    config = bare[0].config
    targets: dict[str, tuple[str, ...]] = {}
    for chunk in bare:
        set_linear_is_expert(chunk)
        targets.update(resolve_lora_targets(chunk, finetuning.lora_targets))
    spec = LoraSpec(finetuning.lora_rank, float(finetuning.lora_alpha), finetuning.lora_dropout, targets,
                    rslora=finetuning.use_rslora)
    for chunk in bare:
        chunk.requires_grad_(False)
        for name, module in list(chunk.named_modules()):
            pattern = normalize_name(name)
            if pattern in targets:
                _add(module, pattern, targets[pattern], spec, config)
        chunk.lora_spec = spec
    init_lora_weights(bare, config, seed)
    trainable = sum(p.numel() for c in bare for p in c.parameters() if p.requires_grad)
    total = sum(p.numel() for c in bare for p in c.parameters())
    log_rank0(logger, "LoRA r=%d alpha=%g%s on %s: %d of %d parameters trainable (this rank)", spec.rank,
              spec.alpha, " (rsLoRA)" if spec.rslora else "", ",".join(spec.hf_target_modules), trainable, total)
    return chunks


def _add(module: nn.Module, pattern: str, projs: tuple[str, ...], spec: LoraSpec, config) -> None:
    tp = module.tp_group.size() if getattr(module, "tp_group", None) is not None else 1
    out_local = module.weight.shape[0]
    common = dict(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, targeted=projs, rslora=spec.rslora)
    if pattern.endswith("linear_qkv"):
        groups = config.num_query_groups or config.num_attention_heads
        per_group, d = config.num_attention_heads // groups, config.kv_channels
        local_groups = groups // tp
        sizes = {"q_proj": local_groups * per_group * d, "k_proj": local_groups * d, "v_proj": local_groups * d}
        add_lora(module, sizes, fusion="qkv", local_groups=local_groups, **common)
    elif pattern.endswith("linear_fc1"):
        if not config.gated_linear_unit:
            raise ModelError("LoRA on linear_fc1 expects a gated MLP (gate_proj/up_proj); this model has none.")
        add_lora(module, {"gate_proj": out_local // 2, "up_proj": out_local // 2}, fusion="concat", **common)
    else:
        add_lora(module, {projs[0]: out_local}, **common)


def hf_layer_linears(config, layer: int) -> list[tuple[str, int, int]]:
    """(HF projection, in_features, out_features) of every ``nn.Linear`` PEFT can adapt in HF decoder layer
    ``layer`` (global index), in HF module order: attention (grouped-query, or latent with or without a q
    LoRA rank), then the dense MLP or, in an MoE layer, the shared experts (routed experts are fused 3-D
    parameters in transformers 5, not ``nn.Linear``)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    if getattr(config, "multi_latent_attention", False):
        q_out = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
        q = [("q_proj", hidden, q_out)] if config.q_lora_rank is None else \
            [("q_a_proj", hidden, config.q_lora_rank), ("q_b_proj", config.q_lora_rank, q_out)]
        attention = [*q, ("kv_a_proj_with_mqa", hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim),
                     ("kv_b_proj", config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim)),
                     ("o_proj", heads * config.v_head_dim, hidden)]
    else:
        groups = config.num_query_groups or heads
        q, kv = heads * config.kv_channels, groups * config.kv_channels
        attention = [("q_proj", hidden, q), ("k_proj", hidden, kv), ("v_proj", hidden, kv), ("o_proj", q, hidden)]
    ffn = (getattr(config, "moe_shared_expert_intermediate_size", None) if config.is_moe_layer(layer)
           else config.ffn_hidden_size)
    mlp = [("gate_proj", hidden, ffn), ("up_proj", hidden, ffn), ("down_proj", ffn, hidden)] if ffn else []
    return attention + mlp


@torch.no_grad()
def init_lora_weights(chunks: list[nn.Module], config, seed: int) -> None:
    """PEFT's initial adapter (see the module docstring): ``lora_A`` from the replayed draws, this
    rank's shard of it; ``lora_B`` zeros. Every rank draws the same full sequence."""
    held: dict[tuple[int, str], LoraParallelLinear] = {}  # (global layer, HF projection) -> module
    for chunk, place in zip(chunks, chunk_placements(config), strict=True):
        for name, module in chunk.named_modules():
            if isinstance(module, LoraParallelLinear) and name.startswith("decoder.layers."):
                layer = int(name.split(".")[2]) + place.layer_offset
                for proj in module.lora_A:
                    held[(layer, proj)] = module
    spec = chunks[0].lora_spec
    targeted = spec.hf_target_modules  # PEFT adapts the modules of these names in every layer, in module order
    gen = torch.Generator().manual_seed(seed)
    for layer in range(config.num_layers):
        for proj, in_f, out_f in hf_layer_linears(config, layer):
            if proj not in targeted:
                continue
            _kaiming(torch.empty(spec.rank, in_f), gen)   # nn.Linear(in, r).__init__
            _kaiming(torch.empty(out_f, spec.rank), gen)  # nn.Linear(r, out).__init__
            a = _kaiming(torch.empty(spec.rank, in_f), gen)  # reset_lora_parameters
            module = held.get((layer, proj))
            if module is None:
                continue
            if module.lora_kind == "row":
                width, rank = module.lora_A[proj].shape[1], module.tp_group.rank()
                a = a[:, rank * width:(rank + 1) * width]
            module.lora_A[proj].copy_(a)
            module.lora_B[proj].zero_()


def _kaiming(tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=gen)


def is_lora_param(name: str) -> bool:
    """True for adapter parameter names (``...linear_qkv.lora_A.q_proj``), wrapped or not."""
    return ".lora_A." in name or ".lora_B." in name


def lora_parameters(chunks: list[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter weight of the chunks, names as the bare model has them."""
    for chunk in chunks:
        for name, param in unwrap_model(chunk).named_parameters():
            if is_lora_param(name):
                yield name, param


def lora_spec_of(chunks: list[nn.Module]) -> LoraSpec:
    spec = getattr(unwrap_model(chunks[0]), "lora_spec", None)
    if spec is None:
        raise ModelError("these model chunks have no LoRA adapters (apply_lora was not called).")
    return spec


@contextlib.contextmanager
def adapters_disabled(chunks: list[nn.Module]):
    """Run the base model: every LoRA layer skips its adapter inside the block (DPO's reference)."""
    modules = [m for c in chunks for m in unwrap_model(c).modules() if isinstance(m, LoraParallelLinear)]
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.lora_enabled = True
