"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``): GQA with q/k/v bias and partial RoPE, dense first layers, then MoE
layers of routed experts plus shared experts behind a sigmoid router with a score-correction bias.

HF's router (``Glm4MoeTopkRouter``) is Megatron's sigmoid router with an expert bias: sigmoid scores, top-k
on ``scores + e_score_correction_bias``, the unbiased scores of the chosen experts divided by their sum, times
``routed_scaling_factor``. The bias is a constant of the checkpoint here, as in HF's model (which never
updates it): ``moe_router_bias_update_rate`` is 0, and the model has no load-balancing loss.
"""

from backends.mca.models.mapping import Rename
from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c

CONFIG_KEYS = [
    *c.CONFIG_KEYS,
    ConfigKey("attention_bias", "add_qkv_bias"),
    ConfigKey("use_qk_norm", "qk_layernorm"),
    ConfigKey("n_routed_experts", "num_moe_experts"),
    ConfigKey("num_experts_per_tok", "moe_router_topk"),
    ConfigKey("moe_intermediate_size", "moe_ffn_hidden_size"),
    ConfigKey("routed_scaling_factor", "moe_router_topk_scaling_factor"),
]

CONSTANTS = {
    **c.CONSTANTS, "moe_token_dispatcher_type": "alltoall", "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0, "moe_router_dtype": "fp32",
    "moe_router_load_balancing_type": "none",
}


def _config_hook(hf: dict, out: dict) -> None:
    c.default_rope_only(hf, out)
    out["rotary_percent"] = c.partial_rotary_factor(hf, default=0.5)
    c.sigmoid_router(hf, out)
    c.dense_first_layers(hf, out)


def moe_block_rows() -> list:
    """The MoE layers' router (with its correction bias), routed experts and shared experts."""
    return [*c.moe_rows(),
            Rename(c.L + "mlp.gate.e_score_correction_bias", c.M + "mlp.router.expert_bias"),
            *c.mlp_rows(c.L + "mlp.shared_experts.", c.M + "mlp.shared_experts.")]


TEMPLATE = register_template(Template(
    model_type="glm4_moe",
    on_disk=c.FUSED_EXPERTS,
    config_keys=CONFIG_KEYS,
    constants=CONSTANTS,
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True, qk_norm=True), *c.mlp_rows(), *moe_block_rows()],
    config_hook=_config_hook,
))
