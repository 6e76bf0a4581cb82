"""McaModelConfig: built from HF configs through templates, validated, saved and reloaded."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models.config import McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.errors import ConfigError, ModelError  # noqa: E402
from roll.demo.tiny_model import tiny_config  # noqa: E402
from tests.helpers import ON_ACCELERATOR  # noqa: E402


def _hf(kind: str, vocab_size: int = 512, **overrides) -> dict:
    import json

    return json.loads(tiny_config(kind, vocab_size, **overrides).to_json_string())


def test_key_table_maps_architecture_fields():
    config = McaModelConfig.from_hf(_hf("qwen3_moe", num_hidden_layers=4))
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_query_groups) == (4, 64, 4, 2)
    assert (config.kv_channels, config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (16, 4, 2, 32)
    assert config.qk_layernorm and not config.add_qkv_bias and config.vocab_size == 512
    assert config.tie_embeddings_and_output_weights


def test_llama3_rope_scaling_keeps_the_real_factor():
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = McaModelConfig.from_hf(_hf("llama", max_position_embeddings=131072, rope_parameters=rope))
    assert config.rope_scaling and config.rope_scaling_factor == 32.0 and config.rotary_base == 500000.0
    assert not McaModelConfig.from_hf(_hf("llama")).rope_scaling  # plain RoPE stays plain


def test_unsupported_rope_type_is_an_error():
    with pytest.raises(ModelError, match="yarn"):
        McaModelConfig.from_hf(_hf("qwen2", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))


def test_family_without_template_lists_supported_ones():
    hf = _hf("qwen2")
    hf["model_type"] = "gemma3"
    with pytest.raises(ModelError, match=r"'gemma3'.*llama, mistral, mixtral, qwen2, qwen2_5_vl, qwen2_moe, qwen2_vl, "
                                         r"qwen3, qwen3_moe, qwen3_vl"):
        McaModelConfig.from_hf(hf)


def test_tp_not_dividing_heads_names_the_numbers():
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size\(4\) does not divide num_query_groups\(2\)"):
        McaModelConfig.from_hf(_hf("qwen2"), tensor_model_parallel_size=4)


def test_layers_not_divisible_by_pp_vpp_names_the_numbers():
    with pytest.raises(ConfigError, match=r"num_layers\(2\).*\(2\) \* .*\(2\) = 4"):
        McaModelConfig.from_hf(_hf("qwen2"), pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)


def test_sp_rule_is_checked_not_rederived_and_vocab_padded_to_tp():
    # ParallelLayout applies the rule once; a config built by hand must already obey it.
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size\(2\) > 1 with expert_model_parallel_size\(2\)"):
        McaModelConfig.from_hf(_hf("qwen3_moe", vocab_size=511), tensor_model_parallel_size=2,
                               expert_model_parallel_size=2)
    with pytest.raises(ConfigError, match="sequence_parallel=true needs tensor_model_parallel_size > 1"):
        McaModelConfig.from_hf(_hf("qwen3_moe"), sequence_parallel=True)
    config = McaModelConfig.from_hf(_hf("qwen3_moe", vocab_size=511), tensor_model_parallel_size=2,
                                    expert_model_parallel_size=2, sequence_parallel=True)
    assert config.sequence_parallel and config.padded_vocab_size == 512 and config.vocab_size == 511
    assert McaModelConfig.from_hf(_hf("qwen2", vocab_size=511), tensor_model_parallel_size=2,
                                  make_vocab_size_divisible_by=128).padded_vocab_size == 512
    assert McaModelConfig.from_hf(_hf("qwen2", vocab_size=600), tensor_model_parallel_size=2,
                                  make_vocab_size_divisible_by=128).padded_vocab_size == 768


def test_mca_config_json_round_trip_and_layout_match(tmp_path):
    config = McaModelConfig.from_hf(_hf("qwen2_moe"), expert_model_parallel_size=2)
    config.save_pretrained(str(tmp_path))
    loaded = McaModelConfig.from_pretrained(str(tmp_path))
    assert loaded.to_dict() == config.to_dict()
    assert loaded.distribute_config_match(config)
    other = McaModelConfig.from_dict(loaded.to_dict(), expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    assert not loaded.distribute_config_match(other)


def test_hf_config_restored_on_export():
    hf = _hf("qwen2", num_hidden_layers=4)
    config = McaModelConfig.from_hf(hf, tensor_model_parallel_size=2)
    restored = get_template("qwen2").hf_config_dict(config)
    assert restored == hf


def test_auto_config_takes_megatron_settings_and_precision(tiny_model_dir, tmp_path):
    import torch

    from backends.mca.models.auto import AutoConfig
    from roll.config import MegatronArguments

    args = MegatronArguments(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                             make_vocab_size_divisible_by=64, recompute_granularity="full",
                             moe_token_dispatcher_type="allgather")
    config = AutoConfig.from_pretrained(tiny_model_dir, args, bf16=True)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert config.make_vocab_size_divisible_by == 64 and config.padded_vocab_size % 128 == 0
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 1)
    assert config.moe_token_dispatcher_type == "allgather" and config.calculate_per_token_loss
    assert config.params_dtype == torch.bfloat16
    if not ON_ACCELERATOR:  # with a GPU, "auto" picks Transformer Engine where it is installed
        assert config.transformer_impl == "local"
    default = AutoConfig.from_pretrained(tiny_model_dir)  # None: MegatronArguments() defaults
    assert (default.tensor_model_parallel_size, default.params_dtype) == (1, torch.float32)
    assert default.moe_token_dispatcher_type == "alltoall" and not default.sequence_parallel
    assert config.hf_model_type == "qwen2" and config.add_qkv_bias
    with pytest.raises(ModelError, match="neither mca_config.json nor config.json"):
        AutoConfig.from_pretrained(str(tmp_path))


def test_varying_sequence_lengths_switch_moe_to_alltoall():
    config = McaModelConfig.from_hf(_hf("qwen3_moe"), variable_seq_lengths=True, moe_token_dispatcher_type="allgather")
    assert config.moe_token_dispatcher_type == "alltoall"
    fixed = McaModelConfig.from_hf(_hf("qwen3_moe"), moe_token_dispatcher_type="allgather")
    assert fixed.moe_token_dispatcher_type == "allgather"


@pytest.mark.parametrize("option", ["--tp", "--pp", "--vpp", "--ep", "--etp", "--seq-len"])
def test_roll_convert_refuses_non_positive_sizes(option, capsys):
    from backends.mca.convert_cli import _parser

    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["check", "--input", "model", option, "0"])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err


def test_moe_aux_loss_coefficient_is_hf_router_aux_loss_coef_at_any_tp():
    """The load-balancing coefficient is the HF config's ``router_aux_loss_coef``, or the recipe's
    ``moe_aux_loss_coeff`` when it sets one, at TP1 and TP2 alike: a layout splits the work, it does not
    change the objective (a coefficient scaled by the TP size trains TP2 towards another model)."""
    from backends.mca.models.config import parallel_overrides
    from roll.config import MegatronArguments

    hf = _hf("qwen3_moe", router_aux_loss_coef=0.02)
    for tp in (1, 2):
        config = McaModelConfig.from_hf(hf, **parallel_overrides(MegatronArguments(tensor_model_parallel_size=tp)))
        assert (config.tensor_model_parallel_size, config.moe_aux_loss_coeff) == (tp, 0.02)
        recipe = MegatronArguments(tensor_model_parallel_size=tp, moe_aux_loss_coeff=0.05)
        assert McaModelConfig.from_hf(hf, **parallel_overrides(recipe)).moe_aux_loss_coeff == 0.05
    # the router z-loss only when the recipe asks (Megatron computes it for any coefficient but None); routing
    # stays drop-less (no capacity factor: the standard backend's HF models have none)
    assert McaModelConfig.from_hf(hf, **parallel_overrides(MegatronArguments())).moe_z_loss_coeff is None
    config = McaModelConfig.from_hf(hf, **parallel_overrides(MegatronArguments(moe_z_loss_coeff=0.01)))
    assert config.moe_z_loss_coeff == 0.01 and config.moe_expert_capacity_factor is None
