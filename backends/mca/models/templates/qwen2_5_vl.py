"""Qwen2.5-VL: the Qwen2 language model with multimodal RoPE (M-RoPE), plus HF's vision tower and merger.

The language model's rows are qwen2's (``model.layers.*``, ``model.embed_tokens``, ``model.norm``, ``lm_head``, as
transformers 5 saves them and the hub ships them). The vision tower is HF's own module inside the Megatron model of
the first pipeline stage (``backends.mca.models.qwen2_5_vl``), so its tensors keep their names (``visual.*``), 1:1,
whole on every tensor-parallel rank. The language model's keys are in ``text_config`` (transformers 5 saves) or at
the top level (hub configs); ``text_config`` wins where both are.
"""

from __future__ import annotations

from backends.mca.models.mapping import Mapping, Rename
from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c
from roll.errors import ModelError

DEFAULT_MROPE_SECTION = [16, 24, 24]
"""transformers' default when the config names none (``Qwen2_5_VLRotaryEmbedding``): T, H, W frequencies."""

_VISION_BLOCK = ("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias", *(f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")))


def text_keys() -> list[ConfigKey]:
    """The Llama-style key table read from the top level (hub configs), then from ``text_config`` (wins)."""
    return [*c.CONFIG_KEYS, *(ConfigKey(f"text_config.{key.hf}", key.mca, key.to_mca, key.to_hf)
                              for key in c.CONFIG_KEYS)]


def vision_rows() -> list[Mapping]:
    """HF's vision tower and patch merger, carried 1:1 (the Megatron model holds the same module as ``visual``)."""
    names = ["visual.patch_embed.proj.weight", *(f"visual.blocks.{{block}}.{n}" for n in _VISION_BLOCK),
             "visual.merger.ln_q.weight", *(f"visual.merger.mlp.{i}.{w}" for i in (0, 2) for w in ("weight", "bias"))]
    return [Rename(name, name) for name in names]


def mrope_hook(family: str, default_section: list[int]):
    """The config hook of a Qwen-VL family: the language model's keys (``text_config`` wins over the top level),
    default RoPE frequencies with M-RoPE sections (``default_section``: transformers' default for the family when
    the config names none) covering half of each head."""

    def hook(hf: dict, out: dict) -> None:
        text = {**hf, **(hf.get("text_config") or {})}
        rope, kind = c.rope_config(text)
        if kind not in ("default", "mrope"):  # hub configs say {"type": "mrope"}, transformers 5 "default"
            raise ModelError(f"{family}: rope_type {kind!r} is not supported by the Megatron conversion; only "
                             "multimodal RoPE with default frequencies is.")
        if text.get("use_sliding_window"):
            raise ModelError(f"{family}: use_sliding_window=true is not supported by the Megatron conversion (full "
                             "causal attention only). Set it to false in config.json.")
        c.fill_head_dim(text, out)
        section = list(rope.get("mrope_section") or default_section)
        if 2 * sum(section) != out["kv_channels"]:
            raise ModelError(f"{family}: mrope_section {section} covers {2 * sum(section)} of the head's "
                             f"{out['kv_channels']} dimensions; its entries must add up to head_dim / 2.")
        out.update(position_embedding_type="mrope", mrope_section=section)

    return hook


TEMPLATE = register_template(Template(
    model_type="qwen2_5_vl",
    config_keys=text_keys(),
    constants={**c.CONSTANTS, "add_qkv_bias": True},
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True), *c.mlp_rows(), *vision_rows()],
    config_hook=mrope_hook("qwen2_5_vl", DEFAULT_MROPE_SECTION),
    model_class="backends.mca.models.qwen2_5_vl.Qwen2_5_VLModel",
))
