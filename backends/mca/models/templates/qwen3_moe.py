"""Qwen3-MoE: Qwen3 attention (qk-norm) with routed experts and no shared expert."""

from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c


def _config_hook(hf: dict, out: dict) -> None:
    c.check_dense_moe_layers(hf, out)
    c.default_rope_only(hf, out)


TEMPLATE = register_template(Template(
    model_type="qwen3_moe",
    on_disk=c.FUSED_EXPERTS,
    config_keys=[*c.CONFIG_KEYS, *c.MOE_CONFIG_KEYS, ConfigKey("attention_bias", "add_qkv_bias")],
    constants={**c.CONSTANTS, **c.MOE_CONSTANTS, "qk_layernorm": True},
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True, qk_norm=True), *c.moe_rows()],
    config_hook=_config_hook,
))
