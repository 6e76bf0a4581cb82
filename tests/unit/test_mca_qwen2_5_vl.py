"""Qwen2.5-VL's Megatron template (``qwen2_5_vl``) and its M-RoPE positions, in-process: bit-exact HF <-> Megatron
<-> HF on random values in every tensor (the vision tower's included), Transformer Engine's names, the config from
transformers-5 (nested) and hub (flat) config.json alike, what is refused, and the 3-D positions by hand."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models import layout, sharding  # noqa: E402
from backends.mca.models.config import McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.errors import ModelError  # noqa: E402
from tests.helpers import random_checkpoint  # noqa: E402
from roll.mrope import mrope_position_ids  # noqa: E402


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> str:
    from roll.demo.tiny_vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_vl(tiny_vl_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """roll.demo.tiny_vl's saved config.json and tensor names, every tensor redrawn at random (untied)."""
    return random_checkpoint(tiny_vl_dir)


def test_round_trip_is_bit_exact_with_the_vision_tower_carried_whole(tiny_vl):
    hf_config, hf_sd = tiny_vl
    config = McaModelConfig.from_hf(hf_config)
    assert (config.position_embedding_type, config.mrope_section, config.kv_channels) == ("mrope", [2, 3, 3], 16)
    assert (config.hidden_size, config.num_query_groups, config.vocab_size, config.add_qkv_bias) == (64, 2, 516, True)
    assert not config.tie_embeddings_and_output_weights
    template = get_template("qwen2_5_vl")
    mca_sd = template.hf_to_mca(hf_sd, config)
    vision = {name for name in hf_sd if name.startswith("visual.")}
    assert len(vision) == 1 + 2 * 12 + 5 and vision <= set(mca_sd)  # patch embed, 2 blocks, merger: same names
    assert all(torch.equal(mca_sd[name], hf_sd[name]) for name in vision)
    assert all(sharding.tp_kind(name, config) == "replicated" for name in vision)  # whole on every TP rank
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in mca_sd and "output_layer.weight" in mca_sd
    back = template.mca_to_hf(mca_sd, config)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[name], tensor) for name, tensor in hf_sd.items())
    te = McaModelConfig.from_hf(hf_config, transformer_impl="transformer_engine")
    te_names = {layout.to_impl_name(name, te): name for name in mca_sd}
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te_names and vision <= set(te_names)
    assert all(layout.from_impl_name(name, te) == local for name, local in te_names.items())
    with pytest.raises(ModelError, match="'visual.blocks.0.attn.qkv.lora_A.weight' has no mapping"):
        template.hf_to_mca({**hf_sd, "visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(1)}, config)


def test_qwen2_vl_round_trip_is_bit_exact_with_its_own_tower(tmp_path):
    """Qwen2-VL (``qwen2_vl``): the same language model rows, its tower's own names (LayerNorm biases, fc1/fc2),
    every one carried whole, and back bit-exact; the positions are Qwen2-VL's ``get_rope_index``'s."""
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    from backends.mca.models.qwen2_5_vl import sample_batch
    from roll.demo.tiny_vl import make_tiny_qwen2_vl_model
    from roll.mrope import mm_token_type_ids

    path = make_tiny_qwen2_vl_model(str(tmp_path / "qwen2_vl"))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        hf_config = json.load(fh)
    gen = torch.Generator().manual_seed(0)
    hf_sd = {name: torch.randn(t.shape, generator=gen) for name, t in load_file(f"{path}/model.safetensors").items()}
    config = McaModelConfig.from_hf(hf_config)
    assert (config.position_embedding_type, config.mrope_section, config.kv_channels) == ("mrope", [1, 1, 2], 8)
    template = get_template("qwen2_vl")
    mca_sd = template.hf_to_mca(hf_sd, config)
    vision = {name for name in hf_sd if name.startswith("visual.")}
    assert len(vision) == 1 + 2 * 12 + 6 and "visual.blocks.1.mlp.fc2.bias" in vision  # patch, 2 blocks, merger
    assert all(torch.equal(mca_sd[name], hf_sd[name]) for name in vision)
    assert all(sharding.tp_kind(name, config) == "replicated" for name in vision)
    back = template.mca_to_hf(mca_sd, config)
    assert sorted(back) == sorted(hf_sd) and all(torch.equal(back[name], t) for name, t in hf_sd.items())
    batch = sample_batch(hf_config)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path)
    expected, _ = model.model.get_rope_index(batch["input_ids"], mm_token_type_ids(batch["input_ids"], hf_config),
                                             image_grid_thw=batch["image_grid_thw"])
    assert torch.equal(mrope_position_ids(batch["input_ids"], batch["image_grid_thw"], hf_config), expected)


def test_a_flat_hub_config_gives_the_same_model_and_unsupported_rope_is_refused(tiny_vl):
    """Hub configs keep the language model's keys at the top level with ``rope_scaling: {type: mrope}``."""
    hf_config, _ = tiny_vl
    nested = McaModelConfig.from_hf(hf_config)
    text = dict(hf_config["text_config"])
    rope = text.pop("rope_parameters")
    flat = {**{k: v for k, v in hf_config.items() if k != "text_config"}, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}, "model_type": "qwen2_5_vl"}
    fields = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
              "rotary_base", "layernorm_epsilon", "mrope_section", "position_embedding_type", "kv_channels")
    assert {f: getattr(McaModelConfig.from_hf(flat), f) for f in fields} == {f: getattr(nested, f) for f in fields}
    for change, message in ((dict(rope_parameters={**rope, "rope_type": "yarn"}), "rope_type 'yarn'"),
                            (dict(rope_parameters={**rope, "mrope_section": [2, 3, 4]}), "must add up to head_dim / 2"),
                            (dict(use_sliding_window=True), "use_sliding_window=true")):
        bad = {**hf_config, "text_config": {**hf_config["text_config"], **change}}
        with pytest.raises(ModelError, match=message):
            McaModelConfig.from_hf(bad)


def test_mrope_positions_are_the_image_grid_offset_by_the_text_before_it(tiny_vl):
    """By hand: an image of 1 x 4 x 6 patches is a 2 x 3 grid of merged tokens; after 3 text tokens its tokens get
    t = 3, h = 3 + row, w = 3 + column, and the text after it resumes at 3 + max(2, 3) = 6."""
    hf_config, _ = tiny_vl
    vs, pad, ve = (hf_config[f"{n}_token_id"] for n in ("vision_start", "image", "vision_end"))
    input_ids = torch.tensor([[5, 6, vs, *[pad] * 6, ve, 7, 8], [9] * 12])
    mask = torch.tensor([[1] * 12, [1] * 10 + [0] * 2])  # the text-only row padded on the right
    positions = mrope_position_ids(input_ids, torch.tensor([[1, 4, 6]]), hf_config, attention_mask=mask)
    assert positions.tolist()[0][0] == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8]  # t
    assert positions.tolist()[1][0] == [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8]  # h
    assert positions.tolist()[2][0] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]  # w
    assert all(axis[1] == [*range(10), 0, 0] for axis in positions.tolist())  # HF leaves padding at 0
    text_only = mrope_position_ids(input_ids[1:], None, hf_config)
    assert text_only.shape == (3, 1, 12) and all(axis[0] == list(range(12)) for axis in text_only.tolist())
    with pytest.raises(ValueError, match="videos are not supported"):
        mrope_position_ids(torch.tensor([[hf_config["video_token_id"]]]), None, hf_config)


def test_a_run_refuses_lora_on_the_tower_with_a_vl_model(tiny_vl_dir, tmp_path):
    from roll.config.parser import resolve
    from roll.errors import ConfigError

    recipe = {"model_name_or_path": tiny_vl_dir, "stage": "sft", "dataset": "recipes/demo/data/arithmetic_sft.json",
              "use_mca": True, "output_dir": str(tmp_path), "report_to": "none"}
    resolve({**recipe, "finetuning_type": "lora"}, {}, None)  # the language model's layers: fine
    for key in ("freeze_vision_tower", "freeze_multi_modal_projector"):
        with pytest.raises(ConfigError, match="finetuning_type lora with freeze_vision_tower or freeze_multi_modal"):
            resolve({**recipe, "finetuning_type": "lora", key: False}, {}, None)
    resolve({**recipe, "context_parallel_size": 2, "nproc_per_node": 2, "packing": True}, {}, None)  # CP, packing
    resolve(recipe, {}, None)  # full fine-tuning at TP1 is fine


def test_a_vl_lora_adapter_is_named_as_peft_names_it_on_transformers_vl_model(tiny_vl):
    """The mca export's keys and target_modules for a VL model: transformers' ``model.language_model.layers``
    (scripts/heldout_vl.py's lora checks compare the whole adapter with the standard backend's PEFT one)."""
    from backends.mca.lora.export import _full_module_names, hf_adapter_name, hf_layers_prefix

    config = McaModelConfig.from_hf(tiny_vl[0])
    canonical = "decoder.layers.3.self_attention.linear_qkv.lora_A.k_proj"
    assert hf_adapter_name(canonical, config) == "base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight"
    vl = hf_layers_prefix({"model_type": "qwen2_5_vl", "vision_config": {}})
    key = hf_adapter_name(canonical, config, vl)
    assert key == "base_model.model.model.language_model.layers.3.self_attn.k_proj.lora_A.weight"
    assert hf_layers_prefix({"model_type": "qwen2"}) == "model.layers"
    assert _full_module_names({key: None, key.replace("lora_A", "lora_B"): None}) == [
        "model.language_model.layers.3.self_attn.k_proj"]
