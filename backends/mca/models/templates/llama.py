"""Llama 2/3.x, including Llama-3 RoPE frequency scaling with the checkpoint's own factor."""

from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c
from roll.errors import ModelError

# Megatron's llama3 scaling takes only the factor; the other three are fixed at these values.
_MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _config_hook(hf: dict, out: dict) -> None:
    rope, kind = c.rope_config(hf)
    if kind == "llama3":
        fixed = {k: rope.get(k) for k in _MEGATRON_LLAMA3_FIXED}
        if any(float(fixed[k]) != v for k, v in _MEGATRON_LLAMA3_FIXED.items() if fixed[k] is not None):
            raise ModelError(f"llama: llama3 rope parameters {fixed} differ from the ones Megatron supports "
                             f"({_MEGATRON_LLAMA3_FIXED}); only 'factor' may vary.")
        out.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif kind != "default":
        raise ModelError(f"llama: rope_type {kind!r} is not supported by the Megatron conversion "
                         "(supported: default, llama3).")
    c.fill_head_dim(hf, out)


TEMPLATE = register_template(Template(
    model_type="llama",
    config_keys=[*c.CONFIG_KEYS, ConfigKey("attention_bias", "add_qkv_bias")],
    constants=c.CONSTANTS,
    weights=[*c.model_rows(), *c.attention_rows(qkv_bias=True), *c.mlp_rows()],
    config_hook=_config_hook,
))
