"""GLM-4.5 (``glm4_moe``) on Megatron: its config in Megatron's terms, the configs refused, and weights loaded
by a pipeline stage of dense first layers only, and the multi-token-prediction layers' rule (in-process)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models import layout  # noqa: E402
from backends.mca.models.config import McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.demo.tiny_model import tiny_config  # noqa: E402
from roll.errors import ConfigError, ModelError  # noqa: E402
from tests.helpers import random_checkpoint  # noqa: E402
from tests.unit.test_mca_templates import _fake_chunk  # noqa: E402


def _hf(**overrides) -> dict:
    return json.loads(tiny_config("glm4_moe", 512, **overrides).to_json_string())


def test_config_maps_partial_rotary_dense_first_layers_and_sigmoid_routing():
    hf = _hf(num_hidden_layers=4, first_k_dense_replace=2)
    assert "partial_rotary_factor" not in hf  # transformers 5 keeps it in rope_parameters
    config = McaModelConfig.from_hf(hf)
    assert (config.hidden_size, config.num_attention_heads, config.num_query_groups, config.kv_channels) == \
        (48, 4, 2, 16)
    assert config.rotary_percent == 0.25 and config.add_qkv_bias and not config.qk_layernorm
    assert config.moe_layer_freq == [0, 0, 1, 1]
    assert [config.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.moe_shared_expert_intermediate_size, config.ffn_hidden_size) == (4, 2, 32, 32, 128)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias,
            config.moe_router_bias_update_rate, config.moe_router_topk_scaling_factor) == ("sigmoid", True, 0.0, 2.5)
    assert config.moe_router_num_groups is None and config.moe_router_load_balancing_type == "none"
    # a hub config.json writes the factor at the top level; without one it is the config class's 0.5
    rope = {k: v for k, v in hf["rope_parameters"].items() if k != "partial_rotary_factor"}
    assert McaModelConfig.from_hf({**hf, "rope_parameters": rope, "partial_rotary_factor": 0.75}).rotary_percent == 0.75
    assert McaModelConfig.from_hf({**hf, "rope_parameters": rope}).rotary_percent == 0.5
    # both (a transformers 5 save whose top-level key was edited): transformers' model rotates rope_parameters' share
    assert McaModelConfig.from_hf({**hf, "partial_rotary_factor": 0.5}).rotary_percent == 0.25
    grouped = McaModelConfig.from_hf(_hf(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4))
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk) == (4, 2)
    # the HF config round-trips through mca_config.json unchanged
    assert get_template("glm4_moe").hf_config_dict(McaModelConfig.from_dict(config.to_dict())) == hf


@pytest.mark.parametrize("overrides,field", [
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok"),
    (dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2), "topk_group"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "rope_type"),
])
def test_configs_megatron_routes_or_rotates_differently_are_refused(overrides, field):
    with pytest.raises(ModelError, match=field):
        McaModelConfig.from_hf(_hf(**overrides))


def test_a_load_balancing_loss_is_refused_naming_the_key():
    """The model has none in HF: a coefficient would train another objective on mca than on the standard
    backend (which has nothing to apply it to), so both refuse it (the standard backend: below)."""
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff"):
        McaModelConfig.from_hf(_hf(), moe_aux_loss_coeff=0.01)
    assert McaModelConfig.from_hf(_hf(), moe_aux_loss_coeff=0.0).moe_aux_loss_coeff == 0.0


def test_names_of_dense_and_moe_layers(tiny_model_factory):
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("glm4_moe"))
    config = McaModelConfig.from_hf(hf_config)
    mca_sd = get_template("glm4_moe").hf_to_mca(hf_sd, config)
    layer0 = {n.removeprefix("decoder.layers.0.") for n in mca_sd if n.startswith("decoder.layers.0.")}
    layer1 = {n.removeprefix("decoder.layers.1.") for n in mca_sd if n.startswith("decoder.layers.1.")}
    attention = {"input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"}
    assert layer0 == attention | {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    assert layer1 == attention | {"mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.linear_fc1.weight",
                                  "mlp.shared_experts.linear_fc2.weight"} | {
        f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)}
    assert torch.equal(mca_sd["decoder.layers.1.mlp.router.expert_bias"],
                       hf_sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    te = McaModelConfig.from_hf(hf_config, transformer_impl="transformer_engine")
    # under TE the dense first layer fuses its pre-MLP norm into fc1; the MoE layer keeps it
    assert layout.to_impl_name("decoder.layers.0.pre_mlp_layernorm.weight", te) == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert layout.to_impl_name("decoder.layers.1.pre_mlp_layernorm.weight", te) == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    assert layout.from_impl_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", te) == \
        "decoder.layers.0.pre_mlp_layernorm.weight"


def _load_stage(tmp_path, name: str, hf_config: dict, hf_sd: dict, pp_rank: int):
    """Load pipeline stage ``pp_rank`` of 2 (a fake chunk of exactly its canonical tensors) from a checkpoint."""
    from safetensors.torch import save_file

    from backends.mca.models.loader import load_hf_weights

    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    save_file(hf_sd, str(model_dir / "model.safetensors"))
    config = McaModelConfig.from_hf(hf_config, pipeline_model_parallel_size=2)
    place = layout.placement(config, pp_rank=pp_rank, vpp_stage=0, ep_rank=0)
    canonical = get_template("glm4_moe").hf_to_mca({n: t for n, t in hf_sd.items() if ".layers.4." not in n}, config)
    local = {}
    for canonical_name, tensor in canonical.items():
        if canonical_name.startswith("decoder.layers."):
            index = layout.layer_index(canonical_name) - place.layer_offset
            if not 0 <= index < config.num_layers_per_chunk:
                continue
            canonical_name = canonical_name.replace(f"layers.{index + place.layer_offset}.", f"layers.{index}.", 1)
        elif canonical_name.startswith("embedding.") != place.pre_process:
            continue
        local[canonical_name] = tensor
    chunk = _fake_chunk({n: tuple(t.shape) for n, t in local.items()})
    coords = {"tp_size": 1, "tp_rank": 0, "etp_size": 1, "etp_rank": 0}
    report = load_hf_weights([chunk], config, str(model_dir), placements=[place], coords=coords)
    assert report.params_loaded == len(local)
    assert all(torch.equal(chunk.state_dict()[n], t) for n, t in local.items())
    return local


def test_a_stage_of_dense_layers_only_loads_and_mtp_layers_are_left_out_saying_so(
        tiny_model_factory, tmp_path, roll_warnings):
    """PP2 of 4 layers with 2 dense first layers: stage 0 holds no MoE layer, yet the MoE layers' tensors are
    the other stage's, not unused. The multi-token-prediction layer after the last decoder layer (what GLM-4.5
    and DeepSeek-V3 checkpoints hold) is left out with a warning when config.json declares it, an error when not."""
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("glm4_moe", num_layers=4, first_k_dense_replace=2))
    stage0 = _load_stage(tmp_path, "stage0", hf_config, hf_sd, pp_rank=0)
    assert not any(".mlp.router." in n for n in stage0)
    stage1 = _load_stage(tmp_path, "stage1", hf_config, hf_sd, pp_rank=1)
    assert "decoder.layers.1.mlp.router.expert_bias" in stage1  # global layer 3
    mtp = {"model.layers.4.eh_proj.weight": torch.randn(48, 96), "model.layers.4.enorm.weight": torch.randn(48),
           "model.layers.4.mlp.gate.weight": torch.randn(4, 48)}
    _load_stage(tmp_path, "mtp", {**hf_config, "num_nextn_predict_layers": 1}, {**hf_sd, **mtp}, pp_rank=1)
    assert "3 tensors of the 1 multi-token-prediction layer(s) model.layers.4.*" in roll_warnings.text
    with pytest.raises(ModelError, match=r"3 checkpoint tensor\(s\) are not used by the model"):
        _load_stage(tmp_path, "undeclared_mtp", hf_config, {**hf_sd, **mtp}, pp_rank=1)


def test_the_standard_backend_refuses_a_load_balancing_loss_too():
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from backends.standard.models import moe_loss_coefficients

    model = AutoModelForCausalLM.from_config(tiny_config("glm4_moe", 512))
    recipe = lambda aux: SimpleNamespace(moe_aux_loss_coeff=aux, moe_z_loss_coeff=None)  # noqa: E731
    assert moe_loss_coefficients(model, recipe(None), "sft") == (0.0, 0.0)
    assert moe_loss_coefficients(model, recipe(0.0), "sft") == (0.0, 0.0)
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff=0.01: model_type 'glm4_moe' has no load-balancing"):
        moe_loss_coefficients(model, recipe(0.01), "sft")
