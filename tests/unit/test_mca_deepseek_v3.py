"""DeepSeek-V3 (``deepseek_v3``) on Megatron: its config in Megatron's MLA terms and the configs refused (in-process;
logits, layouts and training: tests/distributed/test_mca_deepseek_v3_dist.py and the parity sweep)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models.config import McaMLAModelConfig, McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.demo.tiny_model import tiny_config  # noqa: E402
from roll.errors import ModelError  # noqa: E402


def _hf(**overrides) -> dict:
    return json.loads(tiny_config("deepseek_v3", 512, **overrides).to_json_string())


def test_config_maps_latent_attention_yarn_groups_and_dense_first_layers():
    hf = _hf(num_layers=4, first_k_dense_replace=2)
    assert hf["head_dim"] == 8 and hf["num_key_value_heads"] == 4  # what transformers writes: neither is mapped
    config = McaModelConfig.from_hf(hf)
    assert isinstance(config, McaMLAModelConfig) and config.multi_latent_attention and config.qk_layernorm
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim, config.kv_channels, config.num_query_groups) == (16, 16, 8, 8, 12, 12, 4)
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.beta_fast, config.beta_slow, config.mscale, config.mscale_all_dim) == \
        ("yarn", 4.0, 512, 32.0, 1.0, 1.0, 1.0)
    assert config.moe_layer_freq == [0, 0, 1, 1] and not config.rotary_interleaved
    assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk_scaling_factor,
            config.moe_router_bias_update_rate, config.moe_shared_expert_intermediate_size) == (2, 1, 2.5, 0.0, 32)
    # mca_config.json names the class: a Megatron checkpoint reloads as MLA, and the HF config comes back whole
    again = McaModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert isinstance(again, McaMLAModelConfig) and again.q_lora_rank == 16
    assert get_template("deepseek_v3").hf_config_dict(again) == hf
    # no q LoRA rank: Megatron's linear_q_proj (its default would be 512); plain RoPE: softmax scale 1/sqrt(d)
    plain = McaModelConfig.from_hf({**hf, "q_lora_rank": None, "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 10000.0}})
    assert plain.q_lora_rank is None and (plain.rope_type, plain.rotary_scaling_factor) == ("rope", 1.0)


@pytest.mark.parametrize("overrides,field", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quantization_config"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2), "topk_group"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "rope_theta": 10000.0}), "mscale"),
])
def test_configs_megatron_computes_differently_are_refused(overrides, field):
    with pytest.raises(ModelError, match=field):
        McaModelConfig.from_hf(_hf(**overrides))


def test_transformer_engine_is_refused_naming_the_key():
    """TE's MLA fuses the q/kv norms into the up-projections and duplicates the down-projections on every TP
    rank: names and placements the loader does not map yet, so a clear error instead of a wrong load."""
    from roll.errors import ConfigError

    with pytest.raises(ConfigError, match="transformer_impl: local"):
        McaModelConfig.from_hf(_hf(), transformer_impl="transformer_engine")


def test_lora_on_latent_attention_is_refused_on_mca():
    """The MLA projections have no LoRA mapping yet: 'all' would adapt only o_proj and the MLPs on mca, all of
    q_a/q_b/kv_a/kv_b too on the standard backend: refused, not trained differently."""
    from backends.mca.lora.utils import resolve_lora_targets
    from roll.errors import ConfigError

    TELinear = type("TELinear", (torch.nn.Module,), {})  # a parallel linear, as lora.utils recognises TE's by name
    attention = torch.nn.Module()
    for name in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"):
        attention.add_module(name, TELinear())
    layer = torch.nn.Module()
    layer.add_module("self_attention", attention)
    model = torch.nn.Module()
    model.add_module("decoder", torch.nn.Module())
    model.decoder.add_module("layers", torch.nn.ModuleList([layer]))
    for targets in ("all", ["o_proj"]):
        with pytest.raises(ConfigError, match="linear_kv_down_proj.*finetuning_type: full"):
            resolve_lora_targets(model, targets)
