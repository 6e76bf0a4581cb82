"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (``deepseek_v3``): multi-latent attention (with or without a q LoRA rank,
a decoupled RoPE head part, YaRN), dense first layers, then MoE layers with shared experts behind GLM-4.5's
sigmoid router (score-correction bias, group-limited top-k, scaled scores; see ``glm4_moe``).

Megatron's MLA splits each head's q/k into the ``qk_nope_head_dim`` part and the ``qk_rope_head_dim`` part
as HF does, and its ``linear_kv_down_proj`` outputs HF's ``kv_a_proj_with_mqa`` rows (the latent, then the
shared rope key) unsplit, so every weight maps 1:1. HF's ``rope_interleave`` (its default) rotates even/odd
pairs, which is what Megatron's MLA RoPE does; ``rope_interleave: false`` is refused.
"""

from backends.mca.models.mapping import Rename
from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c
from backends.mca.models.templates.glm4_moe import moe_block_rows
from roll.errors import ModelError

CONFIG_KEYS = [
    ConfigKey("hidden_size", "hidden_size"),
    ConfigKey("intermediate_size", "ffn_hidden_size"),
    ConfigKey("num_hidden_layers", "num_layers"),
    ConfigKey("num_attention_heads", "num_attention_heads"),
    ConfigKey("rms_norm_eps", "layernorm_epsilon"),
    ConfigKey("vocab_size", "vocab_size"),
    ConfigKey("max_position_embeddings", "max_sequence_length"),
    ConfigKey("rope_parameters.rope_theta", "rotary_base"),
    ConfigKey("rope_theta", "rotary_base"),
    ConfigKey("tie_word_embeddings", "tie_embeddings_and_output_weights"),
    ConfigKey("attention_dropout", "attention_dropout"),
    ConfigKey("hidden_act", "activation"),
    ConfigKey("kv_lora_rank", "kv_lora_rank"),
    ConfigKey("qk_nope_head_dim", "qk_head_dim"),  # Megatron's qk_head_dim is the part without RoPE
    ConfigKey("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    ConfigKey("v_head_dim", "v_head_dim"),
    ConfigKey("n_routed_experts", "num_moe_experts"),
    ConfigKey("num_experts_per_tok", "moe_router_topk"),
    ConfigKey("moe_intermediate_size", "moe_ffn_hidden_size"),
    ConfigKey("routed_scaling_factor", "moe_router_topk_scaling_factor"),
]

CONSTANTS = {
    **c.CONSTANTS, "multi_latent_attention": True, "qk_layernorm": True, "rotary_interleaved": False,
    "moe_token_dispatcher_type": "alltoall", "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0, "moe_router_dtype": "fp32",
    "moe_router_load_balancing_type": "none",
}
_YARN = {"factor": "rotary_scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
         "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def _config_hook(hf: dict, out: dict) -> None:
    if hf.get("attention_bias"):
        raise ModelError("deepseek_v3: attention_bias=true is not supported by the Megatron conversion (Megatron's "
                         "multi-latent attention has no biases). Use attention_bias: false.")
    if hf.get("quantization_config"):
        raise ModelError("deepseek_v3: quantization_config is set (the released DeepSeek-V3/R1 weights are FP8 with "
                         "per-block weight_scale_inv tensors); the Megatron conversion reads unquantised weights "
                         "only. Dequantise the checkpoint to bf16 first.")
    if hf.get("rope_interleave", True) is False:
        raise ModelError("deepseek_v3: rope_interleave=false is not supported by the Megatron conversion (Megatron's "
                         "multi-latent attention rotates interleaved pairs, HF's default). Use rope_interleave: true.")
    out.update(q_lora_rank=hf.get("q_lora_rank"), num_query_groups=hf["num_attention_heads"],
               kv_channels=hf["v_head_dim"])  # MLA has no key/value groups; a head's output is v_head_dim wide
    _rope(hf, out)
    c.sigmoid_router(hf, out)
    c.dense_first_layers(hf, out)


def _rope(hf: dict, out: dict) -> None:
    rope, kind = c.rope_config(hf)
    if kind == "default":  # no scaling: factor 1 makes Megatron's softmax scale 1 / sqrt(q head dim), as HF's
        out.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        return
    if kind != "yarn":
        raise ModelError(f"deepseek_v3: rope_type {kind!r} is not supported by the Megatron conversion (supported: "
                         "default, yarn).")
    unknown = sorted(set(rope) - set(_YARN) - {"rope_type", "type", "rope_theta", "truncate"})
    mscale, all_dim = rope.get("mscale") or 1.0, rope.get("mscale_all_dim") or 0.0
    if unknown or rope.get("truncate", True) is False or (mscale != 1.0 and not all_dim):
        raise ModelError(f"deepseek_v3: yarn rope parameters {rope} are not supported by the Megatron conversion: "
                         "keys other than factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, "
                         "mscale_all_dim, truncate: false, or mscale != 1 without mscale_all_dim scale RoPE "
                         "differently in Megatron.")
    out["rope_type"] = "yarn"
    out.update({mca: float(rope[hf_key]) for hf_key, mca in _YARN.items() if rope.get(hf_key) is not None})
    out.update(mscale=float(mscale), mscale_all_dim=float(all_dim))
    if "original_max_position_embeddings" in out:
        out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])


def _attention_rows() -> list:
    a, s = c.L + "self_attn.", c.M + "self_attention."
    return [
        Rename(c.L + "input_layernorm.weight", c.M + "input_layernorm.weight"),
        Rename(a + "q_proj.weight", s + "linear_q_proj.weight"),  # q_lora_rank null
        Rename(a + "q_a_proj.weight", s + "linear_q_down_proj.weight"),
        Rename(a + "q_a_layernorm.weight", s + "q_layernorm.weight"),
        Rename(a + "q_b_proj.weight", s + "linear_q_up_proj.weight"),
        Rename(a + "kv_a_proj_with_mqa.weight", s + "linear_kv_down_proj.weight"),
        Rename(a + "kv_a_layernorm.weight", s + "kv_layernorm.weight"),
        Rename(a + "kv_b_proj.weight", s + "linear_kv_up_proj.weight"),
        Rename(a + "o_proj.weight", s + "linear_proj.weight"),
        Rename(c.L + "post_attention_layernorm.weight", c.M + "pre_mlp_layernorm.weight"),
    ]


TEMPLATE = register_template(Template(
    model_type="deepseek_v3",
    on_disk=c.FUSED_EXPERTS,
    config_keys=CONFIG_KEYS,
    constants=CONSTANTS,
    weights=[*c.model_rows(), *_attention_rows(), *c.mlp_rows(), *moe_block_rows()],
    config_hook=_config_hook,
    config_class="McaMLAModelConfig",
))
