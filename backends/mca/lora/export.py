"""LoRA adapters of Megatron chunks -> a Hugging Face PEFT adapter (and, optionally, the merged model).

``save_hf_adapter`` gathers the adapter weights the way ``models/export.py`` gathers model weights
(``gather_unit``: TP shards all-gathered, one holder per tensor, pipeline stages to rank 0), renames
them to PEFT's keys and writes ``adapter_config.json`` + ``adapter_model.safetensors``:

    decoder.layers.3.self_attention.linear_qkv.lora_A.k_proj
        -> base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight

Because every HF projection has its own adapter inside the fused Megatron module, this is a plain
rename: no splitting of a fused LoRA, and the result is exactly what PEFT would train on the HF model.
``export_merged`` merges on the HF side (fp32 ``PeftModel.merge_and_unload``), from the written files.
"""

from __future__ import annotations

import logging
import os
import re

import torch
import torch.distributed as dist
from torch import nn

from backends.mca.lora.apply import LoraSpec, is_lora_param, lora_spec_of
from backends.mca.models.export import copy_tokenizer_files, gather_unit
from backends.mca.models.gpt import chunk_placements
from backends.mca.models.template import template_for
from backends.mca.models.unwrap import unwrap_model
from roll.errors import ModelError
from roll.outputs import remove_stale_weights
from roll.logging import log_rank0

logger = logging.getLogger(__name__)
ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_SUBDIR = "adapter_config.json", "adapter_model.safetensors", "merged"
_NAME = re.compile(r"^(decoder\.layers\.\d+\.[\w.]+)\.lora_([AB])\.(\w+)$")


TEXT_LAYERS, VL_LAYERS = "model.layers", "model.language_model.layers"
"""Where transformers keeps the decoder layers: a causal LM's, and a Qwen-VL model's language model (docs/vl.md)."""


def hf_layers_prefix(hf_config: dict | None) -> str:
    """The decoder layers' module path in the HF model of ``hf_config`` (its config.json dict)."""
    return VL_LAYERS if hf_config and "vision_config" in hf_config else TEXT_LAYERS


def in_layers(hf_module: str, layers: str) -> str:
    """An HF module path of the checkpoint's layout (``model.layers.3.self_attn.k_proj``: what the conversion
    templates name) as the module of ``layers`` (a VL model's ``model.language_model.layers.3...``)."""
    return layers + hf_module[len(TEXT_LAYERS):] if hf_module.startswith(TEXT_LAYERS + ".") else hf_module


def hf_adapter_name(canonical: str, config, layers: str = TEXT_LAYERS) -> str:
    """Canonical Megatron adapter name (global layer) -> the key PEFT saves for it (``layers``: hf_layers_prefix).
    The HF module is the one the family's conversion template maps onto the adapted Megatron linear
    (``self_attention.linear_kv_up_proj`` -> ``self_attn.kv_b_proj``; ``mlp.shared_experts.linear_fc1`` -> Qwen2-MoE's
    ``mlp.shared_expert.gate_proj``), so the adapter sits on the same weight on both sides."""
    m = _NAME.match(canonical)
    if m is None:
        raise ModelError(f"adapter parameter {canonical!r} has no HF PEFT name (only decoder-layer adapters export).")
    module, ab, proj = m.groups()
    hf_names = template_for(config).match_mca(module + ".weight").hf_names
    hf_modules = [name.rsplit(".", 1)[0] for name in hf_names if name.rsplit(".", 2)[-2] == proj]
    if len(hf_modules) != 1 or not hf_modules[0].startswith("model."):
        raise ModelError(f"adapter parameter {canonical!r}: the conversion template maps {module}.weight to "
                         f"{', '.join(hf_names)}, none of them (exactly one) an HF {proj!r} module.")
    return f"base_model.model.{in_layers(hf_modules[0], layers)}.lora_{ab}.weight"


def gather_adapter(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Full adapter tensors under HF PEFT names on global rank 0 (``{}`` elsewhere). Collective."""
    config = unwrap_model(chunks[0]).config
    local = {}
    for chunk, place in zip(chunks, chunk_placements(config), strict=True):
        for name, param in unwrap_model(chunk).named_parameters():
            if is_lora_param(name):
                kind = "replicated"
                if getattr(param, "tensor_model_parallel", False):
                    kind = "column" if param.partition_dim == 0 else "row"
                local[place.to_global(name)] = (param, kind)
    full = gather_unit(local)
    layers = hf_layers_prefix(getattr(config, "hf_config", None))
    return {hf_adapter_name(name, config, layers): t.float().contiguous() for name, t in sorted(full.items())}


def save_hf_adapter(chunks: list[nn.Module], out_dir: str, base_model_name_or_path: str | None,
                    spec: LoraSpec | None = None, tokenizer_dir: str | None = None) -> str:
    """Write the chunks' adapter as a PEFT adapter directory that ``PeftModel.from_pretrained(hf_model,
    out_dir)`` loads. Collective: every rank calls it; rank 0 writes. ``spec`` defaults to the one
    ``apply_lora`` stored on the chunks. Returns ``out_dir``."""
    from safetensors.torch import save_file

    spec = spec or lora_spec_of(chunks)
    tensors = gather_adapter(chunks)
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = unwrap_model(chunks[0]).config
        layers = hf_layers_prefix(getattr(config, "hf_config", None))
        spec.peft_config(base_model_name_or_path, None if layers == TEXT_LAYERS else
                         peft_target_modules(_full_module_names(tensors), config.hf_config)).save_pretrained(out_dir)
        remove_stale_weights(out_dir, keep={ADAPTER_WEIGHTS, "adapter_config.json"})
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
        log_rank0(logger, "wrote LoRA adapter (%d tensors, PEFT format) to %s", len(tensors), out_dir)
    dist.barrier()
    return out_dir


def _full_module_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The adapted modules' full names (``model.language_model.layers.0.self_attn.q_proj``), in key order: a VL
    model's adapter names them in full, as the standard backend's does, so that PEFT does not also adapt the vision
    blocks' layers of the same short names."""
    names = (key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in tensors)
    return list(dict.fromkeys(names))


def peft_target_modules(names: list[str], hf_config: dict) -> list[str]:
    """``target_modules`` as PEFT writes them for these full module names of the HF model of ``hf_config``: from
    ``MIN_TARGET_MODULES_FOR_OPTIMIZATION`` names on, PEFT (``BaseTuner.inject_adapter``) replaces them by the
    shortest name suffixes that match exactly those modules (``q_proj`` for Qwen3-VL, whose tower has none of that
    name), and the standard backend's adapter says so; fewer stay full names."""
    from peft.tuners.tuners_utils import _find_minimal_target_modules
    from peft.utils.constants import MIN_TARGET_MODULES_FOR_OPTIMIZATION
    from transformers import AutoConfig, AutoModelForImageTextToText

    if len(names) < MIN_TARGET_MODULES_FOR_OPTIMIZATION:
        return names
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**hf_config))
    suffixes = tuple("." + name for name in names)
    others = [name for name, _ in model.named_modules() if name not in names and not name.endswith(suffixes)]
    shorter = _find_minimal_target_modules(names, others)
    return sorted(shorter) if len(shorter) < len(names) else names


def export_merged(adapter_dir: str, base_model_name_or_path: str, out_dir: str | None = None,
                  tokenizer_dir: str | None = None) -> str:
    """Write base + adapter merged into a plain HF model (default ``adapter_dir/merged``); rank 0
    merges in fp32 and saves in the base checkpoint's dtype. Collective (barrier). The base must be an
    HF model directory (``config.json`` + safetensors)."""
    out_dir = out_dir or os.path.join(adapter_dir, MERGED_SUBDIR)
    if not os.path.isfile(os.path.join(base_model_name_or_path, "config.json")):
        raise ModelError(f"export_merged: model_name_or_path {base_model_name_or_path!r} is not an HF model "
                         "directory (no config.json); merge the adapter with PeftModel on an HF copy of the base.")
    if dist.get_rank() == 0:
        from peft import PeftModel
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = getattr(AutoConfig.from_pretrained(base_model_name_or_path), "dtype", None) or torch.float32
        base = AutoModelForCausalLM.from_pretrained(base_model_name_or_path, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged = merged.to(dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype)))
        merged.config.use_cache = True
        merged.save_pretrained(out_dir)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
        log_rank0(logger, "merged model (base + LoRA adapter, merged in fp32) written to %s", out_dir)
    dist.barrier()
    return out_dir
