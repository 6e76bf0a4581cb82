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


class _TEProvider:
    """Stands in for megatron-core's TESpecProvider (not importable without TE): each method returns its own
    name, so a spec built from it says which TE module fills each slot."""

    def __getattr__(self, method: str):
        return lambda *args, **kwargs: f"TE.{method}"

    def grouped_mlp_modules(self, *args):
        return "TE.grouped_mlp", None


def _te_layer_specs(monkeypatch, num_experts):
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _TEProvider, raising=False)
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, qk_layernorm=True, multi_latent_attention=True)


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_transformer_engine_names_follow_megatrons_te_spec(monkeypatch, tiny_model_factory, q_lora_rank):
    """Under TE, megatron-core 0.16.1's MLA layer keeps a separate input norm, fuses the q/kv latent norms into
    the up-projections (TELayerNormColumnParallelLinear; q_layernorm / kv_layernorm Identity) and duplicates
    the down-projections (TELinear); a dense layer fuses its pre-MLP norm into fc1, an MoE layer keeps it. The
    layout renames give exactly those names (both ways), the loader's placement keeps the down-projections
    whole on every TP rank whatever TE tags them, and LoRA maps the TE-named modules."""
    from megatron.core.transformer.identity_op import IdentityOp

    from backends.mca.models import layout, sharding
    from tests.helpers import random_checkpoint

    moe, dense = _te_layer_specs(monkeypatch, 4).submodules, _te_layer_specs(monkeypatch, None).submodules
    attention = moe.self_attention.submodules
    assert moe.input_layernorm == "TE.layer_norm" and moe.pre_mlp_layernorm == "TE.layer_norm"
    assert attention.q_layernorm is IdentityOp and attention.kv_layernorm is IdentityOp
    assert attention.linear_q_up_proj == attention.linear_kv_up_proj == "TE.column_parallel_layer_norm_linear"
    assert attention.linear_q_down_proj == attention.linear_kv_down_proj == "TE.linear"
    assert dense.pre_mlp_layernorm is IdentityOp

    hf_config, hf_sd = random_checkpoint(tiny_model_factory("deepseek_v3", q_lora_rank=q_lora_rank))
    config = McaModelConfig.from_hf(hf_config, transformer_impl="transformer_engine", tensor_model_parallel_size=2)
    mca_sd = get_template("deepseek_v3").hf_to_mca(hf_sd, config)
    te_names = {layout.to_impl_name(name, config): name for name in mca_sd}
    assert len(te_names) == len(mca_sd) and all(layout.from_impl_name(te, config) == n for te, n in te_names.items())
    at = "decoder.layers.{}."
    expected = {at.format(0) + "input_layernorm.weight", at.format(1) + "input_layernorm.weight",
                at.format(0) + "self_attention.linear_kv_up_proj.layer_norm_weight",
                at.format(0) + "mlp.linear_fc1.layer_norm_weight",  # layer 0 dense
                at.format(1) + "pre_mlp_layernorm.weight"}  # layer 1 MoE
    if q_lora_rank:
        expected.add(at.format(1) + "self_attention.linear_q_up_proj.layer_norm_weight")
    assert expected <= te_names.keys()
    assert not any(n.endswith(("q_layernorm.weight", "kv_layernorm.weight", "linear_qkv.layer_norm_weight"))
                   for n in te_names)
    down = at.format(1) + "self_attention.linear_kv_down_proj.weight"
    tagged = torch.zeros(24, 48)
    tagged.tensor_model_parallel, tagged.partition_dim = True, 0  # TE tags every Linear weight
    assert sharding.tp_kind(down, config) == sharding.param_tp_kind(down, tagged, config) == "replicated"
    assert sharding.tp_kind(at.format(1) + "self_attention.linear_kv_up_proj.weight", config) == "column"
    assert torch.equal(sharding.shard_for_rank(down, mca_sd[down], config, (2, 1), (2, 1)), mca_sd[down])
    local = McaModelConfig.from_hf(hf_config, tensor_model_parallel_size=2)
    assert sharding.tp_kind(down, local) == "column"  # the local spec's ColumnParallelLinear
