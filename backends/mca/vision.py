"""Training a vision-language model (Qwen2-VL, Qwen2.5-VL: ``backends.mca.models.qwen2_5_vl``; Qwen3-VL:
``backends.mca.models.qwen3_vl``) on the mca backend: what a run may ask for, which parts train, and the model
inputs of a micro-batch.

- **Parts** (LLaMA-Factory's names, the standard backend's meanings, docs/vl.md): the vision tower is ``visual.*``
  but its merger, the multi-modal projector ``visual.merger.*``, the language model everything else (embedding,
  decoder, output layer). ``freeze_vision_tower`` / ``freeze_multi_modal_projector`` (default true, as
  LLaMA-Factory's) and ``freeze_language_model`` (default false) stop a part training (full fine-tuning).
- **LoRA** adapts the language model's Megatron layers (backends/mca/lora), as the standard backend does by
  default; the tower stays frozen and an unfrozen tower or merger with LoRA is refused. The adapter is exported under
  transformers' VL names (``base_model.model.model.language_model.layers.*``, full module names in
  ``target_modules``), as PEFT saves it on the standard backend.
- **Inputs**: the micro-batch's ``pixel_values`` / ``image_grid_thw`` (docs/vl.md's batch contract) go to every
  pipeline stage's forward with the 3-D M-RoPE positions (``roll.mrope``); only the first stage encodes images.
  Packed rows: each packed sample's positions as for the sample alone (``roll.mrope.packed_mrope_position_ids``),
  over the THD stream. Context parallelism: the positions of the whole sequence (Megatron's RoPE keeps the rank's
  2 chunks of the 2 * CP of each row, or of each packed sample, as the tokens are cut), and the rows of the image
  features whose placeholders this rank holds (``image_feature_rows``); Qwen3-VL's deepstack features take the same
  rows (``Qwen3VLModel.vision_block_inputs``), so they follow the tokens under packing, CP and both.
- Refused: a Qwen3-VL pipeline split whose first chunk does not hold every layer that receives deepstack
  features.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from roll.errors import ConfigError
from roll.logging import log_rank0

if TYPE_CHECKING:  # the config checks below run before the training stack is imported (roll-train --print-config)
    import torch

logger = logging.getLogger(__name__)

PARTS = (("projector", "visual.merger."), ("vision", "visual."))
"""Megatron parameter-name prefixes of the vision parts (first match wins); anything else is the language model."""

FREEZE_KEYS = (("vision", "freeze_vision_tower"), ("projector", "freeze_multi_modal_projector"),
               ("language", "freeze_language_model"))
"""(part, the FinetuningArguments key that freezes it)."""


def is_vision_language(hf_config: dict) -> bool:
    """Whether an HF config.json (a dict) is a vision-language model's (it has a vision tower)."""
    return "vision_config" in hf_config


def part_of(name: str) -> str:
    """'vision', 'projector' or 'language' for a parameter name of an unwrapped Megatron chunk."""
    return next((part for part, prefix in PARTS if name.startswith(prefix)), "language")


DEEPSTACK_DEFAULT = (8, 16, 24)
"""transformers' ``Qwen3VLVisionConfig.deepstack_visual_indexes`` default (a config.json may leave it out)."""


def deepstack_layers(hf_config: dict) -> int:
    """How many decoder layers (the first ones) of a Qwen3-VL model receive deepstack features: one per deepstack
    vision block (``backends.mca.models.qwen3_vl``); 0 for other families."""
    if hf_config.get("model_type") != "qwen3_vl":
        return 0
    return len(hf_config.get("vision_config", {}).get("deepstack_visual_indexes", DEEPSTACK_DEFAULT) or ())


def deepstack_layout_error(layers: int, num_layers: int, pp: int, vpp: int | None) -> str | None:
    """Why a pipeline split cannot hold the ``layers`` deepstack layers in its first chunk, with the vision tower
    (None: it can)."""
    per_chunk = num_layers // (pp * (vpp or 1))
    if layers <= per_chunk:
        return None
    split = f"pipeline_model_parallel_size={pp}" + (f" x virtual_pipeline_model_parallel_size={vpp}" if vpp else "")
    return (f"Qwen3-VL adds its deepstack features to the first {layers} decoder layers, which must sit in the first "
            f"pipeline stage's first chunk with the vision tower; {split} puts {per_chunk} of the {num_layers} "
            f"layers there. Use a split with at least {layers} layers per chunk (fewer stages).")


def frozen_parts(finetuning) -> set[str]:
    """The parts the recipe freezes (roll.config.finetuning's keys, LLaMA-Factory's names and defaults: docs/vl.md)."""
    return {part for part, key in FREEZE_KEYS if getattr(finetuning, key)}


def check_config(config, hf_config: dict) -> None:
    """What a vision-language model (``hf_config``: its config.json) cannot do on the mca backend yet, before any
    model loads (exit 2)."""
    if frozen_parts(config.finetuning) == {part for part, _ in FREEZE_KEYS}:
        raise ConfigError("every part of the vision-language model is frozen (freeze_vision_tower, "
                          "freeze_multi_modal_projector, freeze_language_model): nothing would train.")
    if config.finetuning.finetuning_type == "lora" and {"vision", "projector"} - frozen_parts(config.finetuning):
        raise ConfigError("finetuning_type lora with freeze_vision_tower or freeze_multi_modal_projector false: the "
                          "mca backend adapts the language model only (the vision tower is HF's module, without "
                          "adapters). Keep both true (the defaults), use finetuning_type full to train the tower, or "
                          "use_mca: false (LoRA on the tower's layers).")
    if deepstack_layers(hf_config):
        m = config.megatron
        text = {**hf_config, **(hf_config.get("text_config") or {})}
        error = deepstack_layout_error(deepstack_layers(hf_config), text["num_hidden_layers"],
                                       m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size)
        if error:
            raise ConfigError(error)


def freeze_parts(chunks: list[torch.nn.Module], finetuning) -> None:
    """Full fine-tuning: the frozen parts' parameters stop training (before DDP wrapping, so that they get no
    gradient buffer); logs what trains on rank 0."""
    from backends.mca.models.unwrap import unwrap_model

    frozen = frozen_parts(finetuning)
    trainable = total = 0
    for chunk in chunks:
        for name, param in unwrap_model(chunk).named_parameters():
            if part_of(name) in frozen:
                param.requires_grad_(False)
            trainable, total = trainable + (param.numel() if param.requires_grad else 0), total + param.numel()
    log_rank0(logger, "vision-language model: frozen %s; %d of rank 0's %d parameters train",
              ", ".join(sorted(frozen)) or "nothing", trainable, total)


def vision_inputs(batch: dict[str, torch.Tensor], hf_config: dict, device: torch.device,
                  cp_index: torch.Tensor | None = None) -> dict[str, Any]:
    """A (shifted, padded) micro-batch's M-RoPE positions and its images, for every stage's forward.

    The positions are computed over all tokens, padding included: padding sits after a row's last real token, so
    the real tokens get the positions HF's model gives them with its attention mask (HF puts padding at 0; a
    causal model never lets a real token see it either way), and a filler row of padding only needs no special
    case. Plain rows: ``[3, b, s]``; packed rows (``cu_seqlens``): each sample's own, over the stream ``[3, 1, t]``.
    ``cp_index`` (context parallelism: the positions of the row or stream this rank holds, ``cp_token_index``): the
    positions stay whole (Megatron's RoPE keeps the rank's chunks of them: of each row, or of each packed sample,
    ``Qwen2_5_VLModel._preprocess``) and ``image_feature_rows`` names the image features of the placeholders this
    rank holds, in their order."""
    from roll.mrope import mrope_position_ids, packed_mrope_position_ids

    input_ids, grid = batch["input_ids"], batch.get("image_grid_thw")
    if "cu_seqlens" in batch:
        positions = packed_mrope_position_ids(input_ids, batch["position_ids"], grid, hf_config).reshape(3, 1, -1)
        input_ids = input_ids.reshape(1, -1)  # the THD stream the model gets (cp_index indexes it)
    else:
        positions = mrope_position_ids(input_ids, grid, hf_config)
    out: dict[str, Any] = {"position_ids": positions.to(device)}
    if grid is not None:
        out.update(pixel_values=batch["pixel_values"].to(device), image_grid_thw=grid.to(device))
        if cp_index is not None:
            placeholders = input_ids == hf_config["image_token_id"]
            ordinal = placeholders.reshape(-1).cumsum(0).view_as(placeholders) - 1  # row-major, as the features
            mine = placeholders[:, cp_index]
            out["image_feature_rows"] = ordinal[:, cp_index][mine].to(device)
    return out
