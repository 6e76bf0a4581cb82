"""Vision-language models on the standard backend (docs/vl.md): HF's ``...ForConditionalGeneration`` through the
same Trainer / DeepSpeed path, and LLaMA-Factory's ``freeze_vision_tower`` / ``freeze_multi_modal_projector`` /
``freeze_language_model`` with its meanings: full fine-tuning trains the parts not frozen; LoRA adapts the linear
layers of the parts not frozen (by default the language model only); finetuning_type freeze trains the last
language-model layers (roll.data.vision.check_config refuses unfreezing vision parts with it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from roll.errors import ConfigError
from roll.logging import log_rank0

logger = logging.getLogger(__name__)

PARTS = (("projector", ("model.visual.merger.",)), ("vision", ("model.visual.",)),
         ("language", ("model.language_model.", "lm_head.")))
"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL parameter and module name prefixes (transformers 5.23) of each part, first match:
the merger is LLaMA-Factory's multi-modal projector, the rest of ``model.visual`` its vision tower."""


def part_of(name: str) -> str:
    """'vision', 'projector' or 'language' for a parameter or module name of the unwrapped model."""
    for part, prefixes in PARTS:
        if any((name + ".").startswith(prefix) for prefix in prefixes):
            return part
    raise ValueError(f"{name!r} belongs to no known part of a Qwen-VL model ({PARTS})")


def frozen_parts(finetuning) -> set[str]:
    flags = (("vision", finetuning.freeze_vision_tower), ("projector", finetuning.freeze_multi_modal_projector),
             ("language", finetuning.freeze_language_model))
    return {part for part, frozen in flags if frozen}


def load_vl_model(path: str, *, dtype, trust_remote_code: bool = False, attn_implementation: str | None = None,
                  what: str = "model_name_or_path") -> nn.Module:
    """``AutoModelForImageTextToText.from_pretrained`` with the checks of models.load_causal_lm."""
    from backends.standard.models import load_causal_lm

    return load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code,
                          attn_implementation=attn_implementation, what=what, auto_class="AutoModelForImageTextToText")


def freeze_parts(model: nn.Module, finetuning) -> nn.Module:
    """finetuning_type full: the frozen parts' parameters stop training."""
    frozen = frozen_parts(finetuning)
    for name, param in model.named_parameters():
        if part_of(name) in frozen:
            param.requires_grad_(False)
    _log_trainable(model, frozen)
    return model


def lora_modules(model: nn.Module, short_names: list[str], finetuning) -> list[str]:
    """Full names of the linear modules LoRA adapts: short name among ``short_names``, in a part not frozen."""
    frozen = frozen_parts(finetuning)
    head = model.get_output_embeddings()
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head
             and name.rsplit(".", 1)[-1] in short_names and part_of(name) not in frozen]
    if not names:
        raise ConfigError(f"LoRA finds no linear layer to adapt: lora_target {','.join(short_names)} in the parts "
                          f"not frozen (frozen: {', '.join(sorted(frozen)) or 'none'}); unfreeze a part "
                          "(freeze_language_model: false) or widen lora_target.")
    return names


def _log_trainable(model: nn.Module, frozen: set[str]) -> None:
    from backends.standard.models import count_parameters

    trainable, total = count_parameters(model)
    if trainable == 0:
        raise ConfigError("every part of the vision-language model is frozen (freeze_vision_tower, "
                          "freeze_multi_modal_projector, freeze_language_model): nothing would train.")
    log_rank0(logger, "vision-language model: frozen %s; %d of %d parameters trainable",
              ", ".join(sorted(frozen)) or "nothing", trainable, total)


def save_image_processor(model_dir: str, output_dir: str) -> None:
    """The model's preprocessor_config.json next to the saved model (rank 0), so that the saved folder is a VL
    model directory roll and transformers read with the same image processor."""
    import os
    import shutil

    from roll.logging import is_rank0

    source = os.path.join(model_dir, "preprocessor_config.json")
    if is_rank0() and os.path.isfile(source):
        shutil.copyfile(source, os.path.join(output_dir, "preprocessor_config.json"))


@dataclass
class PackedVisionBatch:
    """Packed rows of a VL model as transformers 5.23's Qwen-VL takes them: ``position_ids`` [4, b, s], the text
    positions (restarting at 0 per packed sample: the language model's mask builder then keeps attention inside
    each sample, its packed-sequence rule) over the 3-D M-RoPE positions of each sample alone
    (``roll.mrope.packed_mrope_position_ids``), and no ``cu_seqlens``: the vision tower would take a
    ``cu_seqlens`` keyword for its own patch boundaries (``transformers.vision_utils.get_vision_cu_seqlens``).

    Example (a text-only row of two samples): ``{"input_ids": [[5, 6, 7]], "position_ids": [[0, 1, 0]],
    "cu_seqlens": [0, 2, 3], ...}`` -> ``{"input_ids": [[5, 6, 7]], "position_ids": [[[0, 1, 0]]] * 4, ...}``.
    """

    base: Any
    """The shared collator (roll.data.vision.VisionCollator over a packing SequenceCollator)."""
    hf_config: dict
    """The model's config.json."""

    def __call__(self, features: list[dict]) -> dict:
        import torch

        from roll.mrope import packed_mrope_position_ids

        batch = dict(self.base(features))
        batch.pop("cu_seqlens", None)
        text = batch["position_ids"]
        mrope = packed_mrope_position_ids(batch["input_ids"], text, batch.get("image_grid_thw"), self.hf_config)
        batch["position_ids"] = torch.cat([text[None], mrope])
        return batch
