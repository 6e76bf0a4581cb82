"""Which Megatron parameters get weight decay: Hugging Face Trainer's rule, applied by HF name.

HF Trainer (``Trainer.get_decay_parameter_names``) decays every trainable parameter except biases and
the weights of norm layers (``nn.LayerNorm`` modules, and names matching ``bias``, ``layernorm``,
``rmsnorm``, ``norm``, ``_norm``). The mca backend does not re-derive that rule on Megatron names: it
builds the HF model of the run on the meta device (no memory, no weights), asks HF's own helper which
of its parameters are decayed, and maps each Megatron parameter to the HF parameters it holds through
the family's conversion template (``linear_qkv.bias`` -> ``q_proj.bias``, ``k_proj.bias``,
``v_proj.bias``; TE's ``linear_qkv.layer_norm_weight`` -> ``input_layernorm.weight``). A Megatron
parameter is decay-free when the HF parameters it holds are. Frozen parameters are not in the
optimizer on either backend. LoRA adapter weights (``lora_A`` / ``lora_B``) are linear weights under
PEFT and decay there, so they decay here (``test_mca_param_groups`` checks both backends' sets).

Megatron only applies a group's ``wd_mult`` through its own LR scheduler, which roll does not use, so
``apply_weight_decay`` sets each group's ``weight_decay`` (the schedule calls it every step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backends.mca.lora.apply import is_lora_param
from backends.mca.models.gpt import canonical_tensors
from backends.mca.models.template import get_template
from backends.mca.models.unwrap import unwrap_model

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig


def hf_no_decay_names(hf_config: dict) -> set[str]:
    """HF names of the parameters HF Trainer leaves undecayed, for the model of ``hf_config``."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    config = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # get_decay_parameter_names reads nothing from the Trainer: the rule is a function of the model.
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    return {name for name, _ in model.named_parameters()} - decayed


def hf_names_of(name: str, config: McaModelConfig) -> tuple[str, ...]:
    """The HF parameters a Megatron parameter (canonical global name) holds; () for a LoRA adapter."""
    if is_lora_param(name):
        return ()
    return get_template(config.hf_model_type).match_mca(name).hf_names


def no_decay_parameters(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """This rank's trainable parameters HF Trainer would not decay (biases, norm weights)."""
    config: McaModelConfig = unwrap_model(chunks[0]).config
    undecayed = hf_no_decay_names(config.hf_config)
    out = []
    for name, tensor in canonical_tensors(chunks, config):
        if not isinstance(tensor, torch.nn.Parameter) or not tensor.requires_grad:
            continue
        hf_names = hf_names_of(name, config)
        flags = {hf_name in undecayed for hf_name in hf_names}
        if len(flags) > 1:  # a fused tensor must not mix decayed and undecayed HF parameters
            raise AssertionError(f"{name} holds HF parameters {hf_names} with different weight decay")
        if flags == {True}:
            out.append(tensor)
    return out


def config_overrides(chunks: list[torch.nn.Module]) -> dict:
    """``get_megatron_optimizer``'s ``config_overrides``: ``wd_mult`` 0 for HF's undecayed parameters
    (replacing Megatron's default rule, "every 1-D parameter and every bias")."""
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    undecayed = {id(param) for param in no_decay_parameters(chunks)}
    key = ParamKey(predicate=ParamPredicate(name="hf_no_decay", fn=lambda param: id(param) in undecayed))
    return {key: ParamGroupOverride(wd_mult=0.0)}


def apply_weight_decay(optimizer, weight_decay: float) -> None:
    """Each group's decay: the recipe's ``weight_decay`` times the group's ``wd_mult`` (0 or 1)."""
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
