"""Qwen2-VL: Qwen2.5-VL's language model and M-RoPE (``templates.qwen2_5_vl``) with Qwen2-VL's own vision tower.

The tower is HF's ``Qwen2VisionTransformerPretrainedModel`` inside the Megatron model of the first pipeline stage
(``backends.mca.models.qwen2_5_vl``), carried 1:1 under its names (``visual.*``) as Qwen2.5-VL's is. It differs
from Qwen2.5-VL's in its names only as far as the weights go: LayerNorms with a bias instead of RMSNorms, a
two-layer ``fc1`` / ``fc2`` MLP instead of a gated one, a LayerNorm with a bias before the merger.
"""

from __future__ import annotations

from backends.mca.models.mapping import Mapping, Rename
from backends.mca.models.template import Template, register_template
from backends.mca.models.templates import _common as c
from backends.mca.models.templates import qwen2_5_vl

_VISION_BLOCK = tuple(f"{n}.{w}" for n in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
                      for w in ("weight", "bias"))


def vision_rows() -> list[Mapping]:
    """HF's Qwen2-VL vision tower and patch merger, 1:1 (the Megatron model holds the same module as ``visual``)."""
    names = ["visual.patch_embed.proj.weight", *(f"visual.blocks.{{block}}.{n}" for n in _VISION_BLOCK),
             "visual.merger.ln_q.weight", "visual.merger.ln_q.bias",
             *(f"visual.merger.mlp.{i}.{w}" for i in (0, 2) for w in ("weight", "bias"))]
    return [Rename(name, name) for name in names]


TEMPLATE = register_template(Template(
    model_type="qwen2_vl",
    config_keys=qwen2_5_vl.text_keys(),
    constants={**c.CONSTANTS, "add_qkv_bias": True},
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True), *c.mlp_rows(), *vision_rows()],
    config_hook=qwen2_5_vl.mrope_hook("qwen2_vl", qwen2_5_vl.DEFAULT_MROPE_SECTION),
    model_class="backends.mca.models.qwen2_5_vl.Qwen2_5_VLModel",
))
