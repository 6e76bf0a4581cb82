"""backends.mca.lora.utils on module trees built without Megatron: layer patterns, TE classes matched by
name (no Transformer Engine installed), and lora_target resolution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from backends.mca.lora.utils import (find_all_embedding_modules, find_all_linear_modules, find_all_router_modules,
                                     find_layers, normalize_name, resolve_lora_targets, set_linear_is_expert)
from roll.errors import ConfigError


class TELayerNormColumnParallelLinear(nn.Linear):  # stand-ins named like megatron.core's TE wrappers
    pass


class TERowParallelLinear(nn.Linear):
    pass


class TEColumnParallelLinear(nn.Linear):
    pass


class TEGroupedLinear(nn.Module):
    pass


class Router(nn.Module):
    pass


class TopKRouter(Router):
    pass


class LanguageModelEmbedding(nn.Module):
    pass


def _layer(moe: bool) -> nn.Module:
    layer = nn.Module()
    layer.self_attention = nn.Module()
    layer.self_attention.linear_qkv = TELayerNormColumnParallelLinear(4, 12)
    layer.self_attention.linear_proj = TERowParallelLinear(4, 4)
    layer.mlp = nn.Module()
    if moe:
        layer.mlp.router = TopKRouter()
        layer.mlp.experts = nn.Module()
        layer.mlp.experts.linear_fc1, layer.mlp.experts.linear_fc2 = TEGroupedLinear(), TEGroupedLinear()
    else:
        layer.mlp.linear_fc1, layer.mlp.linear_fc2 = TELayerNormColumnParallelLinear(4, 16), TERowParallelLinear(8, 4)
    return layer


def gpt(moe: bool = False) -> nn.Module:
    model = nn.Module()
    model.embedding = LanguageModelEmbedding()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList([_layer(moe), _layer(moe)])
    model.output_layer = TEColumnParallelLinear(4, 32)
    return model


@pytest.mark.parametrize("name, pattern", [
    ("decoder.layers.3.self_attention.linear_qkv", "self_attention.linear_qkv"),
    ("decoder.layers.0.mlp.experts.local_experts.5.linear_fc1", "mlp.experts.local_experts.linear_fc1"),
    ("embedding", "embedding"), ("output_layer", "output_layer"),
])
def test_normalize_name(name, pattern):
    assert normalize_name(name) == pattern


def test_dense_names_te_classes_by_name():
    model = gpt()
    assert find_all_linear_modules(model) == ["self_attention.linear_qkv", "self_attention.linear_proj",
                                              "mlp.linear_fc1", "mlp.linear_fc2"]
    assert find_all_linear_modules(model, include_output_layer=True)[-1] == "output_layer"
    assert find_all_embedding_modules(model) == ["embedding"]
    assert find_all_router_modules(model) == []
    assert find_layers(model, lambda name, m: name.endswith("linear_proj")) == ["self_attention.linear_proj"]
    assert set_linear_is_expert(model) == 0


def test_moe_names_and_expert_marking():
    model = gpt(moe=True)
    assert find_all_linear_modules(model) == ["self_attention.linear_qkv", "self_attention.linear_proj",
                                              "mlp.experts.linear_fc1", "mlp.experts.linear_fc2"]
    assert find_all_router_modules(model) == ["mlp.router"]
    assert set_linear_is_expert(model) == 4
    assert model.decoder.layers[1].mlp.experts.linear_fc2.is_expert
    assert not hasattr(model.decoder.layers[1].self_attention.linear_qkv, "is_expert")


def test_resolve_lora_targets(roll_warnings):
    model = gpt()
    assert resolve_lora_targets(model, "all") == {
        "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"), "self_attention.linear_proj": ("o_proj",),
        "mlp.linear_fc1": ("gate_proj", "up_proj"), "mlp.linear_fc2": ("down_proj",)}
    assert resolve_lora_targets(model, ["v_proj", "q_proj", "down_proj"]) == {
        "self_attention.linear_qkv": ("q_proj", "v_proj"), "mlp.linear_fc2": ("down_proj",)}
    assert resolve_lora_targets(model, ["linear_qkv"]) == {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj")}
    assert resolve_lora_targets(gpt(moe=True), "all") == {
        "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"), "self_attention.linear_proj": ("o_proj",)}
    assert "no HF adapter mapping for mlp.experts.linear_fc1" in roll_warnings.text


@pytest.mark.parametrize("target, message", [
    (["lm_head"], "lora_target 'lm_head' is not supported"),
    (["gate_proj"], "this model has no 'mlp.linear_fc1' or 'mlp.shared_experts.linear_fc1' module"),
    (["q_a_proj"], "this model has no 'self_attention.linear_q_down_proj' module"),
])
def test_resolve_lora_targets_errors_name_the_key(target, message):
    with pytest.raises(ConfigError, match=message):
        resolve_lora_targets(gpt(moe=True), target)


def _mla_gpt(q_lora_rank: bool, shared_gate: bool = False) -> nn.Module:
    """DeepSeek-V3's layer under Transformer Engine's names (megatron-core 0.16.1's TE spec with
    ``multi_latent_attention=True``): duplicated TELinear down-projections, the q/kv latent norms fused into
    TELayerNormColumnParallelLinear up-projections; a dense first layer, then an MoE layer with shared experts."""
    model = nn.Module()
    model.decoder = nn.Module()
    layers = []
    for moe in (False, True):
        layer = nn.Module()
        attn = layer.self_attention = nn.Module()
        if q_lora_rank:
            attn.linear_q_down_proj, attn.linear_q_up_proj = TELinear(4, 3), TELayerNormColumnParallelLinear(3, 8)
        else:
            attn.linear_q_proj = TEColumnParallelLinear(4, 8)
        attn.linear_kv_down_proj, attn.linear_kv_up_proj = TELinear(4, 3), TELayerNormColumnParallelLinear(3, 8)
        attn.linear_proj = TERowParallelLinear(4, 4)
        layer.mlp = nn.Module()
        owner = layer.mlp
        if moe:
            layer.mlp.experts = nn.Module()
            layer.mlp.experts.linear_fc1, layer.mlp.experts.linear_fc2 = TEGroupedLinear(), TEGroupedLinear()
            owner = layer.mlp.shared_experts = nn.Module()
            if shared_gate:
                owner.gate_weight = nn.Parameter(torch.zeros(1, 4))
        owner.linear_fc1, owner.linear_fc2 = TEColumnParallelLinear(4, 16), TERowParallelLinear(8, 4)
        layers.append(layer)
    model.decoder.layers = nn.ModuleList(layers)
    return model


_MLA_ALL = {"self_attention.linear_proj": ("o_proj",), "self_attention.linear_kv_down_proj": ("kv_a_proj_with_mqa",),
            "self_attention.linear_kv_up_proj": ("kv_b_proj",), "mlp.linear_fc1": ("gate_proj", "up_proj"),
            "mlp.linear_fc2": ("down_proj",), "mlp.shared_experts.linear_fc1": ("gate_proj", "up_proj"),
            "mlp.shared_experts.linear_fc2": ("down_proj",)}


def test_resolve_lora_targets_on_latent_attention_and_shared_experts(roll_warnings):
    """Multi-latent attention's linears stand for DeepSeek-V3's HF projections (TE names, as the TE spec builds
    them); a projection name selects every module computing it (PEFT matches the last name: gate_proj is the
    dense MLP's and the shared experts'); Qwen2-MoE's shared-expert gate, an nn.Linear PEFT's ``all`` adapts,
    makes ``all`` an error that names the targets to use."""
    with_q = resolve_lora_targets(_mla_gpt(q_lora_rank=True), "all")
    assert with_q == {"self_attention.linear_q_down_proj": ("q_a_proj",),
                      "self_attention.linear_q_up_proj": ("q_b_proj",), **_MLA_ALL}
    assert resolve_lora_targets(_mla_gpt(q_lora_rank=False), "all") == {
        "self_attention.linear_q_proj": ("q_proj",), **_MLA_ALL}
    assert "mlp.experts.linear_fc1" in roll_warnings.text
    assert resolve_lora_targets(_mla_gpt(q_lora_rank=False), ["q_proj", "kv_b_proj", "up_proj"]) == {
        "self_attention.linear_q_proj": ("q_proj",), "self_attention.linear_kv_up_proj": ("kv_b_proj",),
        "mlp.linear_fc1": ("up_proj",), "mlp.shared_experts.linear_fc1": ("up_proj",)}
    assert resolve_lora_targets(_mla_gpt(q_lora_rank=True), ["linear_fc2"]) == {
        "mlp.linear_fc2": ("down_proj",), "mlp.shared_experts.linear_fc2": ("down_proj",)}
    targets = "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj"
    with pytest.raises(ConfigError, match=f"adapt shared_expert_gate .* lora_target: {targets}\\."):
        resolve_lora_targets(_mla_gpt(q_lora_rank=False, shared_gate=True), "all")


@pytest.mark.parametrize("target", ["all", ["q_a_proj", "down_proj"]])
def test_mlp_targets_refused_where_peft_moves_them_to_the_routed_experts(target):
    """On deepseek_v3 (also glm4_moe, qwen3_moe) PEFT 0.21 with transformers 5 applies gate/up/down_proj to the
    routed experts' fused parameters, not to the dense MLP and shared experts that carry those names on mca."""
    model = _mla_gpt(q_lora_rank=True)
    model.config = SimpleNamespace(hf_model_type="deepseek_v3")
    with pytest.raises(ConfigError, match="routed experts.*lora_target: q_a_proj,q_b_proj,kv_a_proj_with_mqa,"
                                          "kv_b_proj,o_proj\\."):
        resolve_lora_targets(model, target)
    assert resolve_lora_targets(model, ["q_b_proj", "linear_proj"]) == {
        "self_attention.linear_q_up_proj": ("q_b_proj",), "self_attention.linear_proj": ("o_proj",)}


def test_peft_moves_mlp_targets_to_experts_on_exactly_these_families():
    """backends.mca.lora.utils.PEFT_EXPERT_MLP_FAMILIES against the installed peft/transformers: the families
    whose gate_proj/up_proj/down_proj targets PEFT converts to the fused routed experts."""
    pytest.importorskip("peft")
    from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING

    from backends.mca.lora.utils import PEFT_EXPERT_MLP_FAMILIES
    from backends.mca.models.template import FAMILY_MODULES

    moved = {family for family in FAMILY_MODULES
             if "gate_proj" in _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(family), {})}
    assert moved == set(PEFT_EXPERT_MLP_FAMILIES)


class TELinear(nn.Linear):
    """Stand-in for Transformer Engine's replicated linear: returns (output, bias) like Megatron's linears."""

    parallel_mode, tp_group = "duplicated", None

    def forward(self, x):
        return super().forward(x), None


@pytest.mark.parametrize("rslora, scaling", [(False, 8.0 / 4), (True, 8.0 / 2)])
def test_lora_output_is_base_plus_alpha_over_rank_times_b_a(rslora, scaling):
    """The adapter adds ``(alpha / r) * B A x`` (LoRA's and PEFT's scaling), or with use_rslora
    ``(alpha / sqrt(r)) * B A x`` (rank-stabilised LoRA, PEFT's use_rslora), computed here by hand."""
    pytest.importorskip("megatron.core")
    import torch

    from backends.mca.lora.layers import add_lora

    torch.manual_seed(0)
    module = TELinear(6, 5)
    x = torch.randn(3, 6)
    base = module(x)[0].detach()
    add_lora(module, {"proj": 5}, rank=4, alpha=8.0, rslora=rslora)
    a, b = torch.randn(4, 6), torch.randn(5, 4)
    with torch.no_grad():
        module.lora_A["proj"].copy_(a)
        module.lora_B["proj"].copy_(b)
    out, bias = module(x)
    assert bias is None
    torch.testing.assert_close(out, base + scaling * x @ a.t() @ b.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_adapters_of_a_duplicated_linear_follow_its_sequence_parallel_tag(sequence_parallel):
    """Under TE, latent attention's down-projections are duplicated TELinears: with sequence parallelism each
    TP rank computes its part of the sequence and Megatron sums the weight's gradient over TP (its
    ``sequence_parallel`` tag); the adapters must be summed the same way, and only then."""
    pytest.importorskip("megatron.core")
    from backends.mca.lora.layers import add_lora, linear_kind

    module = TELinear(6, 5)
    module.weight.sequence_parallel = sequence_parallel
    assert linear_kind(module) == "replicated"
    add_lora(module, {"kv_a_proj_with_mqa": 5}, rank=2, alpha=4.0)
    adapters = [*module.lora_A.values(), *module.lora_B.values()]
    assert [getattr(p, "sequence_parallel", False) for p in adapters] == [sequence_parallel] * 2
    assert not any(getattr(p, "tensor_model_parallel", False) for p in adapters)
