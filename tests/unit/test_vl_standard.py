"""Qwen2.5-VL on the standard backend (backends/standard/vision.py, docs/vl.md): LLaMA-Factory's
freeze_vision_tower / freeze_multi_modal_projector / freeze_language_model choose what trains, in full fine-tuning
and with LoRA (adapters on the linear layers of the parts not frozen: by default the language model only).
The expected sets are written from the tiny model's module names (model.visual.blocks / patch_embed: the tower;
model.visual.merger: the projector; model.language_model, lm_head: the language model), not from the module."""

from __future__ import annotations

import dataclasses

import pytest

from roll.config.finetuning import FinetuningArguments
from roll.errors import ConfigError


@pytest.fixture(scope="module")
def vl_model_dir(tmp_path_factory) -> str:
    from roll.demo.tiny_vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl_std")))


def load(path):
    import torch

    from backends.standard.vision import load_vl_model

    return load_vl_model(path, dtype=torch.float32)


def trained_prefixes(model) -> set[str]:
    """'tower', 'projector', 'language' for each group with a trainable parameter (names as saved by HF)."""
    out = set()
    for name, param in model.named_parameters():
        if param.requires_grad:
            name = name.removeprefix("base_model.model.")
            out.add("projector" if ".visual.merger." in name else "tower" if ".visual." in name else "language")
    return out


@pytest.mark.parametrize("keys, trained", [
    ({}, {"language"}),
    ({"freeze_vision_tower": False}, {"language", "tower"}),
    ({"freeze_multi_modal_projector": False, "freeze_language_model": True}, {"projector"}),
])
def test_full_fine_tuning_trains_the_parts_not_frozen(vl_model_dir, keys, trained):
    from backends.standard.vision import freeze_parts

    model = freeze_parts(load(vl_model_dir), FinetuningArguments(**keys))
    assert trained_prefixes(model) == trained


def test_lora_adapts_the_language_model_only_by_default_and_the_tower_when_unfrozen(vl_model_dir):
    from backends.standard.models import apply_lora

    lora = FinetuningArguments(finetuning_type="lora")
    model = apply_lora(load(vl_model_dir), lora, vision=True)
    adapted = {name.split(".lora_A")[0] for name, _ in model.named_parameters() if ".lora_A" in name}
    assert adapted and all(".language_model.layers." in name for name in adapted), sorted(adapted)
    assert trained_prefixes(model) == {"language"}
    model = apply_lora(load(vl_model_dir), dataclasses.replace(lora, freeze_vision_tower=False), vision=True)
    assert any(".visual.blocks." in name and ".lora_A" in name for name, _ in model.named_parameters())
    with pytest.raises(ConfigError, match="no linear layer"):
        apply_lora(load(vl_model_dir), dataclasses.replace(lora, freeze_language_model=True), vision=True)
