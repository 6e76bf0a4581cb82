"""Qwen2 / Qwen2.5: Llama layout with a bias on q/k/v (and only there)."""

from backends.mca.models.template import Template, register_template
from backends.mca.models.templates import _common as c

TEMPLATE = register_template(Template(
    model_type="qwen2",
    config_keys=c.CONFIG_KEYS,
    constants={**c.CONSTANTS, "add_qkv_bias": True},
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True), *c.mlp_rows()],
    config_hook=c.default_rope_only,
))
