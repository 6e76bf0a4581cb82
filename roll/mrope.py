"""Multimodal RoPE (M-RoPE) position ids of a Qwen2.5-VL or Qwen3-VL batch, computed by transformers' own code.

Qwen2.5-VL and Qwen3-VL rotate each query/key by three positions (temporal, height, width): text tokens advance all three
by one, an image's tokens get their (t, h, w) place in the image's grid of merged patches, offset by the text
before it. Both backends use the same positions: HF's model computes them in its forward only when it is given
``mm_token_type_ids`` (without them transformers 5 silently falls back to 1-D positions), and the Megatron model
gets them from ``mrope_position_ids``, which runs HF's ``get_rope_index`` on the same batch.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2
"""HF's modality codes in ``mm_token_type_ids``."""


def mm_token_type_ids(input_ids: torch.Tensor, hf_config: dict[str, Any]) -> torch.Tensor:
    """HF's modality of each token ``[b, s]`` (0 text, 1 image, 2 video) from the placeholder ids: what HF's
    processor returns with ``input_ids`` and HF's model needs to compute 3-D positions."""
    types = torch.full_like(input_ids, TEXT, dtype=torch.int32)
    types[input_ids == hf_config["image_token_id"]] = IMAGE
    types[input_ids == hf_config["video_token_id"]] = VIDEO
    return types


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, hf_config: dict[str, Any],
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions ``[3, b, s]`` of a batch whose images (``image_grid_thw`` [n_images, 3], in row order, as the
    collator concatenates them) sit at the ``<|image_pad|>`` runs of ``input_ids`` [b, s]: the ``get_rope_index`` of
    the family's HF model (``Qwen2_5_VLModel``, ``Qwen3VLModel``: by ``model_type``), or, for a batch without images,
    the 1-D positions HF's text model uses then. ``hf_config`` is the model's config.json (a dict). Videos are not
    supported (a ValueError)."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    types = mm_token_type_ids(input_ids, hf_config)
    if (types == VIDEO).any():
        raise ValueError("the batch has video tokens (<|video_pad|>): videos are not supported, only images.")
    if image_grid_thw is None or len(image_grid_thw) == 0:
        batch, seq = input_ids.shape
        return torch.arange(seq, device=input_ids.device).view(1, 1, seq).expand(3, batch, seq)
    family = hf_config["model_type"]
    vision = CONFIG_MAPPING[family].sub_configs["vision_config"](**hf_config.get("vision_config", {}))
    hf_model = getattr(transformers, MODEL_MAPPING_NAMES[family])  # e.g. Qwen3VLModel
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision))  # what get_rope_index reads of `self`
    model.get_vision_position_ids = functools.partial(hf_model.get_vision_position_ids, model)
    positions, _ = hf_model.get_rope_index(model, input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw,
                                           attention_mask=attention_mask)
    return positions
