"""Mistral: the Llama layout; sliding-window attention has no Megatron local-spec equivalent."""

from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c
from roll.errors import ModelError


def _config_hook(hf: dict, out: dict) -> None:
    if hf.get("sliding_window") is not None:
        raise ModelError(f"mistral: sliding_window={hf['sliding_window']} is not supported by the Megatron "
                         "conversion (full causal attention only). Set sliding_window to null in config.json "
                         "if your sequences are shorter than the window.")
    c.default_rope_only(hf, out)


TEMPLATE = register_template(Template(
    model_type="mistral",
    config_keys=[*c.CONFIG_KEYS, ConfigKey("attention_bias", "add_qkv_bias")],
    constants=c.CONSTANTS,
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True), *c.mlp_rows()],
    config_hook=_config_hook,
))
