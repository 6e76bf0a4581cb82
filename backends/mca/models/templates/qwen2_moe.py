"""Qwen2-MoE / Qwen1.5-MoE: qkv bias, routed experts plus one shared expert behind a sigmoid gate."""

from backends.mca.models.mapping import Rename
from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c


def _config_hook(hf: dict, out: dict) -> None:
    c.check_dense_moe_layers(hf, out)
    c.default_rope_only(hf, out)


_SHARED = [*c.mlp_rows(c.L + "mlp.shared_expert.", c.M + "mlp.shared_experts."),
           Rename(c.L + "mlp.shared_expert_gate.weight", c.M + "mlp.shared_experts.gate_weight")]

TEMPLATE = register_template(Template(
    model_type="qwen2_moe",
    on_disk=c.FUSED_EXPERTS,
    config_keys=[*c.CONFIG_KEYS, *c.MOE_CONFIG_KEYS,
                 ConfigKey("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")],
    constants={**c.CONSTANTS, **c.MOE_CONSTANTS, "add_qkv_bias": True, "moe_shared_expert_gate": True},
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True), *c.moe_rows(), *_SHARED],
    config_hook=_config_hook,
))
