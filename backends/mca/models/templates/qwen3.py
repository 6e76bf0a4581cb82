"""Qwen3: no qkv bias (unless attention_bias), RMSNorm on each head's q and k (qk-norm)."""

from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c

TEMPLATE = register_template(Template(
    model_type="qwen3",
    config_keys=[*c.CONFIG_KEYS, ConfigKey("attention_bias", "add_qkv_bias")],
    constants={**c.CONSTANTS, "qk_layernorm": True},
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True, qk_norm=True), *c.mlp_rows()],
    config_hook=c.default_rope_only,
))
