"""Mixtral: Llama attention (GQA, no bias) with every MLP a softmax top-k routed MoE, no shared expert.

The checkpoint keeps the original per-expert names (``block_sparse_moe.experts.{e}.w1/w2/w3``: w1 the gate,
w3 the up projection); transformers 5 fuses them in memory only and ``save_pretrained`` writes them back.
HF's router takes the softmax over all experts, the top k, and renormalises them; Megatron's default (top k
of the logits, then their softmax: ``moe_router_pre_softmax`` false) gives the same weights.
"""

from backends.mca.models.fused_experts import Fused, fused_expert_rows
from backends.mca.models.mapping import GateUp, Rename
from backends.mca.models.template import ConfigKey, Template, register_template
from backends.mca.models.templates import _common as c
from roll.errors import ModelError


def _config_hook(hf: dict, out: dict) -> None:
    if hf.get("sliding_window") is not None:
        raise ModelError(f"mixtral: sliding_window={hf['sliding_window']} is not supported by the Megatron "
                         "conversion (full causal attention only). Set sliding_window to null in config.json "
                         "if your sequences are shorter than the window.")
    if hf.get("router_jitter_noise"):
        raise ModelError(f"mixtral: router_jitter_noise={hf['router_jitter_noise']} is not supported by the "
                         "Megatron conversion (HF jitters the hidden states of the router and the experts, "
                         "Megatron's moe_input_jitter_eps only the router's). Set router_jitter_noise to 0 "
                         "in config.json.")
    c.default_rope_only(hf, out)


_MOE = c.L + "block_sparse_moe."
_EXPERT, _MCA_EXPERT = _MOE + "experts.{expert}.", c.M + "mlp.experts.local_experts.{expert}."

TEMPLATE = register_template(Template(
    model_type="mixtral",
    config_keys=[*c.CONFIG_KEYS,
                 ConfigKey("num_local_experts", "num_moe_experts"),
                 ConfigKey("num_experts_per_tok", "moe_router_topk"),
                 ConfigKey("intermediate_size", "moe_ffn_hidden_size"),  # every layer's MLP is the MoE
                 ConfigKey("router_aux_loss_coef", "moe_aux_loss_coeff")],
    constants={**c.CONSTANTS, **c.MOE_CONSTANTS, "moe_router_score_function": "softmax",
               "moe_router_pre_softmax": False},
    weights=[*c.model_rows(), *c.attention_rows(),
             Rename(_MOE + "gate.weight", c.M + "mlp.router.weight"),
             GateUp(_EXPERT + "w1.weight", _EXPERT + "w3.weight", _MCA_EXPERT + "linear_fc1.weight"),
             Rename(_EXPERT + "w2.weight", _MCA_EXPERT + "linear_fc2.weight")],
    config_hook=_config_hook,
    # transformers 5's fused spelling (save_original_format=False): block_sparse_moe renamed mlp, w1/w3 -> gate_up_proj
    on_disk=(*fused_expert_rows(c.L + "mlp.experts.", _EXPERT, gate="w1", up="w3", down="w2"),
             Fused(c.L + "mlp.gate.weight", (_MOE + "gate.weight",))),
))
