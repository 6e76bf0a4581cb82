"""backends.mca.lora.utils on module trees built without Megatron: layer patterns, TE classes matched by
name (no Transformer Engine installed), and lora_target resolution."""

from __future__ import annotations

import pytest
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
    (["gate_proj"], "this model has no 'mlp.linear_fc1' module"),
])
def test_resolve_lora_targets_errors_name_the_key(target, message):
    with pytest.raises(ConfigError, match=message):
        resolve_lora_targets(gpt(moe=True), target)


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
