"""Qwen3-VL: the Qwen3 language model (q/k RMSNorm, no qkv bias unless attention_bias) with interleaved multimodal
RoPE, plus HF's vision tower, merger and deepstack mergers.

transformers saves (and the hub ships) the language model under ``model.language_model.*`` and the tower under
``model.visual.*`` (Qwen2.5-VL's ``model.*`` / ``visual.*`` layout is not used by this family). The tower is HF's own
module inside the Megatron model of the first pipeline stage (``backends.mca.models.qwen3_vl``), named ``visual.*``
there, 1:1, whole on every tensor-parallel rank. The config is Qwen2.5-VL's (``text_config`` wins over the top level,
``qwen2_5_vl.mrope_hook``) with transformers' Qwen3-VL default sections ``[24, 20, 20]``; the interleaving of the
sections is the model class's (transformers' ``Qwen3VLTextRotaryEmbedding`` interleaves whatever
``mrope_interleaved`` says, and so does ``backends.mca.models.qwen3_vl``).

Qwen3-VL-MoE (``qwen3_vl_moe``) has no template: its experts ship fused and transposed, and neither the data
pipeline nor the standard backend knows it as a vision-language model yet.
"""

from __future__ import annotations

from backends.mca.models.mapping import Mapping, Rename
from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c
from backends.mca.models.templates.qwen2_5_vl import mrope_hook, text_keys

DEFAULT_MROPE_SECTION = [24, 20, 20]
"""transformers' default when the config names none (``Qwen3VLTextRotaryEmbedding``): T, H, W frequencies."""

LANGUAGE = "model.language_model."

_LINEAR_NORM = ("norm", "linear_fc1", "linear_fc2")
_VISION_BLOCK = ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")


def vision_rows() -> list[Mapping]:
    """HF's vision tower: patch embedding (with bias), learned position table, blocks (LayerNorm with bias, a
    two-matrix MLP), merger and deepstack mergers, carried 1:1 from ``model.visual.*`` to ``visual.*``."""
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight",
             *(f"{prefix}.{part}.{w}" for prefix, parts in (("blocks.{block}", _VISION_BLOCK),
                                                             ("merger", _LINEAR_NORM),
                                                             ("deepstack_merger_list.{block}", _LINEAR_NORM))
               for part in parts for w in ("weight", "bias"))]
    return [Rename(f"model.visual.{name}", f"visual.{name}") for name in names]


TEMPLATE = register_template(Template(
    model_type="qwen3_vl",
    config_keys=[*text_keys(), ConfigKey("text_config.attention_bias", "add_qkv_bias")],
    constants={**c.CONSTANTS, "qk_layernorm": True},
    weights=[*c.model_rows(LANGUAGE), *c.attention_rows(qkv_bias=True, qk_norm=True, layer=LANGUAGE + "layers.{layer}."),
             *c.mlp_rows(LANGUAGE + "layers.{layer}.mlp."), *vision_rows()],
    config_hook=mrope_hook("qwen3_vl", DEFAULT_MROPE_SECTION),
    model_class="backends.mca.models.qwen3_vl.Qwen3VLModel",
))
