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
from backends.mca.models.template import template_for
from backends.mca.models.unwrap import unwrap_model

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig


class HfDecayRule:
    """HF Trainer's decision for each HF parameter name of one model (``hf_config``).

    Names the HF model has are decided on the model (module types and names); checkpoint names the
    model fuses away (transformers 5 stores MoE experts as ``experts.gate_up_proj``, the checkpoint as
    ``experts.0.gate_proj.weight``) by the same helper on a module tree holding only that name.
    """

    def __init__(self, hf_config: dict) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        # A vision-language model's in-memory names (transformers 5: model.language_model.*, model.visual.*) are
        # not its checkpoint's: those are decided by name below, as HF's rule decides them (its norms are RMSNorms,
        # which the rule knows by name only).
        auto = AutoModelForImageTextToText if "vision_config" in hf_config else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(AutoConfig.for_model(**hf_config))
        self.known = {name for name, _ in model.named_parameters()}
        self.decayed = set(_decay_parameter_names(model))

    def decays(self, hf_name: str) -> bool:
        if hf_name in self.known:
            return hf_name in self.decayed
        root = torch.nn.Module()
        *parents, leaf = hf_name.split(".")
        module = root
        for part in parents:
            module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(0, device="meta")))
        return bool(_decay_parameter_names(root))


def _decay_parameter_names(model: torch.nn.Module) -> list[str]:
    from transformers import Trainer

    # get_decay_parameter_names reads nothing from the Trainer: the rule is a function of the model.
    return Trainer.get_decay_parameter_names(None, model)


def hf_names_of(name: str, config: McaModelConfig) -> tuple[str, ...]:
    """The HF parameters a Megatron parameter (canonical global name) holds; () for a LoRA adapter."""
    if is_lora_param(name):
        return ()
    return template_for(config).match_mca(name).hf_names


def no_decay_parameters(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """This rank's trainable parameters HF Trainer would not decay (biases, norm weights)."""
    config: McaModelConfig = unwrap_model(chunks[0]).config
    rule = HfDecayRule(config.hf_config)
    out = []
    for name, tensor in canonical_tensors(chunks, config):
        if not isinstance(tensor, torch.nn.Parameter) or not tensor.requires_grad:
            continue
        hf_names = hf_names_of(name, config)
        decays = {rule.decays(hf_name) for hf_name in hf_names}
        if len(decays) > 1:  # a fused tensor must not mix decayed and undecayed HF parameters
            raise AssertionError(f"{name} holds HF parameters {hf_names} with different weight decay")
        if decays == {False}:
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
