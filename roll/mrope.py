"""Multimodal RoPE (M-RoPE) position ids of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL batch, computed by transformers' own
code.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate each query/key by three positions (temporal, height, width): text tokens advance all three
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

ROPE_INDEX = {"qwen2_5_vl": ("Qwen2_5_VLModel", "Qwen2_5_VLVisionConfig"),
              "qwen2_vl": ("Qwen2VLModel", "Qwen2VLVisionConfig"), "qwen3_vl": ("Qwen3VLModel", "Qwen3VLVisionConfig")}
"""HF model_type -> (the model class whose ``get_rope_index`` lays the positions out, its vision config class), in
``transformers.models.<model_type>``."""


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
    collator concatenates them) sit at the ``<|image_pad|>`` runs of ``input_ids`` [b, s]: HF's
    the family's ``get_rope_index`` (``ROPE_INDEX``), or, for a batch without images, the 1-D positions HF's text
    model uses then. ``hf_config`` is the model's config.json (a dict). Videos are not supported (a ValueError)."""
    import importlib

    types = mm_token_type_ids(input_ids, hf_config)
    if (types == VIDEO).any():
        raise ValueError("the batch has video tokens (<|video_pad|>): videos are not supported, only images.")
    if image_grid_thw is None or len(image_grid_thw) == 0:
        batch, seq = input_ids.shape
        return torch.arange(seq, device=input_ids.device).view(1, 1, seq).expand(3, batch, seq)
    family = hf_config.get("model_type", "qwen2_5_vl")
    model_name, config_name = ROPE_INDEX[family]
    model_class = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), model_name)
    config_class = getattr(importlib.import_module(f"transformers.models.{family}.configuration_{family}"),
                           config_name)
    vision = config_class(**hf_config.get("vision_config", {}))
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision))  # what get_rope_index reads of `self`
    model.get_vision_position_ids = functools.partial(model_class.get_vision_position_ids, model)
    positions, _ = model_class.get_rope_index(model, input_ids, mm_token_type_ids=types,
                                              image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return positions


def packed_mrope_position_ids(input_ids: torch.Tensor, position_ids: torch.Tensor,
                              image_grid_thw: torch.Tensor | None, hf_config: dict[str, Any]) -> torch.Tensor:
    """Positions ``[3, b, s]`` of packed rows: each packed sample's as ``mrope_position_ids`` gives them for the
    sample alone (restarting at its first token), its images the next ones of ``image_grid_thw`` (row-major order,
    as the collator concatenates the packed rows' images). A sample starts where ``position_ids`` [b, s] (roll's
    packed positions, restarting at 0 per sample; padding tails are samples of their own) is 0, and at each row.

    Example (text-only rows, where M-RoPE is 1-D): ``position_ids`` [[0, 1, 2, 0, 1]] -> every axis
    [[0, 1, 2, 0, 1]]. HF's ``get_rope_index`` runs once, over the samples as rows of their own."""
    batch, seq = input_ids.shape
    starts = (position_ids == 0).clone()
    starts[:, 0] = True
    rows, begins = starts.nonzero(as_tuple=True)  # row-major: the samples (and their images) in packed order
    ends = torch.cat([begins[1:], begins.new_tensor([seq])])
    last = torch.ones_like(rows, dtype=torch.bool)
    last[:-1] = rows[1:] != rows[:-1]
    ends[last] = seq  # a row's last sample ends with the row
    lengths = (ends - begins).tolist()
    longest = max(lengths)
    samples = input_ids.new_zeros(len(lengths), longest)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long, device=input_ids.device)
    for k, (row, begin, length) in enumerate(zip(rows.tolist(), begins.tolist(), lengths)):
        samples[k, :length] = input_ids[row, begin:begin + length]
        mask[k, :length] = 1
    alone = mrope_position_ids(samples, image_grid_thw, hf_config, attention_mask=mask)  # [3, samples, longest]
    out = torch.empty(3, batch, seq, dtype=alone.dtype, device=input_ids.device)
    for k, (row, begin, length) in enumerate(zip(rows.tolist(), begins.tolist(), lengths)):
        out[:, row, begin:begin + length] = alone[:, k, :length]
    return out
