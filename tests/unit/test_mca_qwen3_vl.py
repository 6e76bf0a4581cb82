"""Qwen3-VL's Megatron template (``qwen3_vl``) and model pieces, in-process: bit-exact HF <-> Megatron <-> HF on random
values in every tensor (the tower's deepstack mergers included), the interleaved M-RoPE against transformers' own
rotary embedding, the 3-D positions by hand, and what is refused (a pipeline split that takes deepstack layers off
the first chunk, Qwen3-VL-MoE)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models import sharding  # noqa: E402
from backends.mca.models.config import McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.errors import ModelError  # noqa: E402
from tests.helpers import random_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_qwen3_vl_dir(tmp_path_factory) -> str:
    from roll.demo.tiny_vl import make_tiny_qwen3_vl_model

    return make_tiny_qwen3_vl_model(str(tmp_path_factory.mktemp("tiny_qwen3_vl")), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tiny_qwen3_vl_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """The tiny Qwen3-VL's saved config.json and tensor names, every tensor redrawn at random (untied)."""
    return random_checkpoint(tiny_qwen3_vl_dir)


def test_round_trip_is_bit_exact_with_the_tower_and_deepstack_mergers_carried_whole(tiny_qwen3_vl):
    hf_config, hf_sd = tiny_qwen3_vl
    config = McaModelConfig.from_hf(hf_config)
    assert (config.position_embedding_type, config.mrope_section, config.kv_channels) == ("mrope", [2, 3, 3], 16)
    assert (config.num_layers, config.qk_layernorm, config.add_qkv_bias, config.rotary_base) == (4, True, False, 5e5)
    assert not config.tie_embeddings_and_output_weights
    template = get_template("qwen3_vl")
    mca_sd = template.hf_to_mca(hf_sd, config)
    vision = {name for name in hf_sd if name.startswith("model.visual.")}
    # patch embed (weight, bias), position table, 2 blocks of 12, merger and 2 deepstack mergers of 6
    assert len(vision) == 3 + 2 * 12 + 3 * 6
    assert all(torch.equal(mca_sd[name.removeprefix("model.")], hf_sd[name]) for name in vision)
    assert all(sharding.tp_kind(name.removeprefix("model."), config) == "replicated" for name in vision)
    assert "decoder.layers.3.self_attention.q_layernorm.weight" in mca_sd
    assert not any(name.endswith("linear_qkv.bias") for name in mca_sd)
    back = template.mca_to_hf(mca_sd, config)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[name], tensor) for name, tensor in hf_sd.items())
    with pytest.raises(ModelError, match="'visual.blocks.0.attn.qkv.weight' has no mapping"):  # Qwen2.5-VL's names
        template.hf_to_mca({**hf_sd, "visual.blocks.0.attn.qkv.weight": torch.zeros(1)}, config)


def test_a_lora_adapter_is_named_as_peft_names_it_on_transformers_model(tiny_qwen3_vl):
    """The template's names are already transformers' in-memory ones (``model.language_model.layers``)."""
    from backends.mca.lora.export import hf_adapter_name, hf_layers_prefix

    config = McaModelConfig.from_hf(tiny_qwen3_vl[0])
    key = hf_adapter_name("decoder.layers.3.self_attention.linear_qkv.lora_A.k_proj", config,
                          hf_layers_prefix(tiny_qwen3_vl[0]))
    assert key == "base_model.model.model.language_model.layers.3.self_attn.k_proj.lora_A.weight"


def test_interleaved_mrope_is_transformers_rotary_embedding():
    """cos/sin of the Megatron module against ``Qwen3VLTextRotaryEmbedding`` on positions whose three axes differ
    (head_dim 16: frequencies 1, 4, 7 rotate by height, 2 and 5 by width, 0, 3 and 6 by time, for sections
    2/3/3); Megatron's own chunked M-RoPE (Qwen2.5-VL's layout) differs on the same positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from backends.mca.models.qwen3_vl import InterleavedMultimodalRotaryEmbedding, interleaved_axes

    section, dim, base = [2, 3, 3], 16, 5e5
    assert interleaved_axes(dim // 2, section).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert interleaved_axes(64, [24, 20, 20]).tolist()[57:] == [0, 1, 2, 0, 0, 0, 0]  # Qwen3-VL-8B: H, W end at 59
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # Megatron's formula
    megatron = SimpleNamespace(inv_freq=inv_freq, seq_len_interpolation_factor=None, cp_group=None,
                               rotary_interleaved=False)
    positions = torch.randint(0, 50, (3, 2, 7))
    emb = InterleavedMultimodalRotaryEmbedding(megatron)(positions, section)  # [s, b, 1, d]
    hf = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=dim,
        rope_parameters={"rope_type": "default", "rope_theta": base, "mrope_section": section}))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, d]
    assert torch.equal(emb[:, :, 0].transpose(0, 1).cos(), cos) and torch.equal(emb[:, :, 0].transpose(0, 1).sin(), sin)
    chunked = MultimodalRotaryEmbedding.forward(megatron, positions, section)
    assert not torch.equal(chunked, emb)


def test_positions_are_the_image_grid_offset_by_the_text_before_it(tiny_qwen3_vl):
    """By hand (transformers' Qwen3-VL get_rope_index through roll.mrope): a 1 x 4 x 6-patch image is a 2 x 3 grid of
    merged tokens; after 3 text tokens its tokens get t = 3, h = 3 + row, w = 3 + column; the text after it resumes at
    3 + max(2, 3) = 6."""
    from roll.mrope import mrope_position_ids

    hf_config, _ = tiny_qwen3_vl
    vs, pad, ve = (hf_config[f"{n}_token_id"] for n in ("vision_start", "image", "vision_end"))
    input_ids = torch.tensor([[5, 6, vs, *[pad] * 6, ve, 7, 8]])
    positions = mrope_position_ids(input_ids, torch.tensor([[1, 4, 6]]), hf_config).tolist()
    assert positions[0][0] == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8]  # t
    assert positions[1][0] == [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8]  # h
    assert positions[2][0] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]  # w


def test_splits_taking_deepstack_off_the_first_chunk_and_qwen3_vl_moe_are_refused_cp_and_packing_not(
        tiny_qwen3_vl_dir, tmp_path):
    """4 layers, 2 of them receive deepstack features: PP2 (2 layers a stage) trains, PP4 and PP2 x VPP2 (1 layer a
    chunk) are refused before any model loads, context parallelism and packing are not (the deepstack features
    follow the tokens); the default of transformers' config when config.json names none."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from backends.mca.vision import DEEPSTACK_DEFAULT, deepstack_layers
    from roll.config.parser import resolve
    from roll.errors import ConfigError

    assert tuple(Qwen3VLVisionConfig().deepstack_visual_indexes) == DEEPSTACK_DEFAULT
    assert deepstack_layers({"model_type": "qwen3_vl", "vision_config": {}}) == 3
    recipe = {"model_name_or_path": tiny_qwen3_vl_dir, "stage": "sft", "use_mca": True, "output_dir": str(tmp_path),
              "dataset": "recipes/demo/data/arithmetic_sft.json", "report_to": "none"}
    resolve({**recipe, "pipeline_model_parallel_size": 2, "nproc_per_node": 2}, {}, None)
    for split in ({"pipeline_model_parallel_size": 4, "nproc_per_node": 4},
                  {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "nproc_per_node": 2,
                   "gradient_accumulation_steps": 2}):
        with pytest.raises(ConfigError, match="deepstack features to the first 2 decoder layers.* puts 1 of the 4"):
            resolve({**recipe, **split}, {}, None)
    for split in ({"context_parallel_size": 2, "nproc_per_node": 2}, {"packing": True},
                  {"context_parallel_size": 2, "nproc_per_node": 2, "packing": True}):
        resolve({**recipe, **split}, {}, None)  # deepstack follows the tokens (test_mca_qwen2_5_vl_dist's runs)
    with pytest.raises(ModelError, match="'qwen3_vl_moe' has no Megatron conversion template"):
        get_template("qwen3_vl_moe")


def test_the_adapter_config_names_its_modules_as_peft_does(tiny_qwen3_vl_dir):
    """From 20 adapted modules on PEFT shortens ``target_modules`` to the suffixes that match exactly them (the tower
    has no ``q_proj``...): the mca export writes what PEFT writes on the standard backend (found by
    ``scripts/heldout_vl.py --family qwen3_vl``'s LoRA check: 28 full names against 7 short ones)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from backends.mca.lora.export import peft_target_modules

    with open(os.path.join(tiny_qwen3_vl_dir, "config.json"), encoding="utf-8") as fh:
        hf_config = json.load(fh)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_dir)
    short = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    names = [name for name, _ in model.named_modules()
             if name.startswith("model.language_model.layers.") and name.rsplit(".", 1)[-1] in short]
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=names)).peft_config["default"].target_modules
    assert len(names) == 28 and peft_target_modules(names, hf_config) == sorted(peft) == sorted(short)
    assert peft_target_modules(names[:7], hf_config) == names[:7]  # under PEFT's 20: the full names stay
