"""Load the policy (and DPO reference) model and apply the fine-tuning type: full, lora, freeze.

Checks that a user can fail (a path that is not a causal LM, a LoRA target that matches nothing,
more frozen-training layers than the model has) raise ModelError/ConfigError before training.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from roll.data.loading import hub_offline
from roll.data.vision import VL_MODEL_TYPES
from roll.errors import ConfigError, ModelError
from roll.hf_config import has_hf_config, read_hf_config
from roll.logging import log_rank0, warn_once
from roll.preflight import check_remote_code, check_weight_files

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_causal_lm(path: str | None, *, trust_remote_code: bool = False,
                    what: str = "model_name_or_path") -> None:
    """Raise ModelError unless ``path`` is a local directory (or hub id when online) holding a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not path:
        raise ModelError(f"{what} is not set: point it at a Hugging Face causal LM directory.")
    if not os.path.exists(path) and (hub_offline() or path.startswith((".", "/"))):
        raise ModelError(f"{what}={path!r} does not exist (and the hub is offline). Create a tiny model with "
                         "`python scripts/make_tiny_model.py --out DIR` or point it at a model directory.")
    if os.path.isdir(path) and not has_hf_config(path):
        raise ModelError(f"{what}={path!r} has no config.json: it is not a Hugging Face model directory.")
    if os.path.isdir(path):  # remote code or an unknown architecture: name the key to set (not HF's error)
        check_remote_code(read_hf_config(path), f"{what}={path!r}", trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{what}={path!r} cannot be read as a Hugging Face model config: {exc}") from None
    model_type = getattr(config, "model_type", None)
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in VL_MODEL_TYPES or any(
        arch.endswith("ForCausalLM") for arch in (getattr(config, "architectures", None) or []))
    if not causal:
        architectures = getattr(config, "architectures", None)
        raise ModelError(f"{what}={path!r} is a {model_type!r} model ({architectures}), "
                         "not a causal language model; roll trains decoder-only causal LMs.")
    if os.path.isdir(path):
        check_weight_files(path, use_mca=False, key=what)  # a truncated copy: not safetensors' own error


def resolve_dtype(dtype: str, *, bf16: bool, fp16: bool) -> torch.dtype:
    """Load dtype. 'auto' keeps fp32 master weights: Trainer autocast / DeepSpeed handle bf16/fp16 compute."""
    if dtype == "auto":
        return torch.float32
    return _DTYPES[dtype]


def load_causal_lm(path: str, *, dtype: torch.dtype, trust_remote_code: bool = False,
                   attn_implementation: str | None = None, what: str = "model_name_or_path",
                   auto_class: str = "AutoModelForCausalLM") -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (or another transformers ``auto_class``: a vision-language model's
    ``AutoModelForImageTextToText``); under a live ZeRO-3 config it loads partitioned.

    Strict: a model weight the checkpoint lacks, a checkpoint tensor the model does not use or one of
    another shape is a ModelError (``roll.weights``), not a model trained from random weights."""
    import transformers

    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    # ignore_mismatched_sizes: report shape mismatches to us (below) instead of raising HF's RuntimeError
    model, info = getattr(transformers, auto_class).from_pretrained(path, output_loading_info=True,
                                                                     ignore_mismatched_sizes=True, **kwargs)
    check_loading_info(model, info, path, what=what)
    model.config.use_cache = False  # training never reuses a KV cache
    # a VL model's language model reads its own text_config's: with a cache its mask builder skips the packed-
    # sequence rule, and packed samples would attend to each other (tests/unit/test_vl_data.py's packed test)
    model.config.get_text_config().use_cache = False
    return model


def check_loading_info(model: nn.Module, info: dict, path: str, *, what: str = "model_name_or_path") -> None:
    """transformers' load report (``output_loading_info``) against ``roll.weights``' allowlists."""
    from roll.weights import check_weights_match

    missing, unexpected = set(info.get("missing_keys") or ()), set(info.get("unexpected_keys") or ())
    mismatched = [f"{name}: {tuple(saved)} vs {tuple(wanted)}" for name, saved, wanted in
                  sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])]
    text_config = model.config.get_text_config()
    used = len(model.state_dict()) - len(missing)
    check_weights_match(path, missing=missing, unexpected=unexpected, mismatched=mismatched,
                        model_type=getattr(model.config, "model_type", None),
                        tied=bool(getattr(text_config, "tie_word_embeddings", False)),
                        checkpoint_size=len(unexpected) + max(used, 0), key=what)


def freeze_reference(model: nn.Module) -> nn.Module:
    """A reference model never trains: eval mode, no gradients."""
    model.eval()
    model.requires_grad_(False)
    return model


# ---- LoRA ---------------------------------------------------------------------------------------

def linear_module_names(model: nn.Module) -> list[str]:
    """Short names (last path component) of every nn.Linear except the output head, sorted."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module is not head}
    return sorted(names)


def resolve_lora_targets(model: nn.Module, targets: list[str] | str) -> list[str]:
    """'all' -> every linear layer but the output head; an explicit list is checked against the model."""
    available = linear_module_names(model)
    if targets == "all":
        if not available:
            raise ModelError("lora_target=all found no nn.Linear layers in this model.")
        return available
    all_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in all_names]
    if missing:
        raise ConfigError(f"lora_target {', '.join(missing)} matches no module of this model; linear modules "
                          f"that exist: {', '.join(available)} (or use lora_target: all).")
    head_name = _output_head_name(model)
    if head_name in targets:
        raise ConfigError(f"lora_target includes the output head {head_name!r}; roll does not adapt it "
                          "(TRL's DPO computes log-probs from its weight directly). "
                          "Remove it from lora_target.")
    return list(targets)


def _output_head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if module is head:
            return name.rsplit(".", 1)[-1]
    return None


def apply_lora(model: nn.Module, finetuning, *, head: str | None = None, vision: bool = False) -> nn.Module:
    """Wrap ``model`` in a PEFT LoRA model; trainable (adapter) parameters are kept in fp32. ``head``: a
    sequence-classification model's head (stage rm's ``score``), trained in full and saved in the adapter
    (PEFT's task SEQ_CLS, ``modules_to_save``), never adapted."""
    from peft import LoraConfig, TaskType, get_peft_model

    targets = [target for target in resolve_lora_targets(model, finetuning.lora_targets) if target != head]
    shown = targets
    if vision:  # a vision-language model: the linear layers of the parts not frozen (backends/standard/vision.py)
        from backends.standard.vision import lora_modules

        targets = lora_modules(model, targets, finetuning)
        shown = sorted({name.rsplit(".", 1)[-1] for name in targets})
    task = dict(task_type=TaskType.SEQ_CLS, modules_to_save=[head]) if head else dict(task_type=TaskType.CAUSAL_LM)
    lora_config = LoraConfig(**task, r=finetuning.lora_rank,
                             lora_alpha=finetuning.lora_alpha, lora_dropout=finetuning.lora_dropout,
                             use_rslora=finetuning.use_rslora, target_modules=targets)
    peft_model = get_peft_model(model, lora_config)
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # low-precision adapters lose small updates
    trainable, total = count_parameters(peft_model)
    log_rank0(logger, "LoRA r=%d alpha=%d%s on %s: %d of %d parameters trainable", finetuning.lora_rank,
              finetuning.lora_alpha, " (rsLoRA)" if finetuning.use_rslora else "", ",".join(shown), trainable,
              total)
    return peft_model


# ---- freeze -------------------------------------------------------------------------------------

def apply_freeze(model: nn.Module, num_trainable_layers: int) -> nn.Module:
    """Train only the last ``num_trainable_layers`` decoder layers; embeddings, norm and head stay frozen."""
    num_layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if num_layers is None:
        raise ModelError("finetuning_type=freeze needs config.num_hidden_layers, which this model lacks.")
    if num_trainable_layers > num_layers:
        raise ConfigError(f"freeze_trainable_layers={num_trainable_layers} but the model has only "
                          f"{num_layers} layers; use at most {num_layers} (or finetuning_type=full).")
    trainable_ids = {str(i) for i in range(num_layers - num_trainable_layers, num_layers)}
    for name, param in model.named_parameters():
        parts = name.split(".")
        in_layer = any(parts[i] == "layers" and parts[i + 1] in trainable_ids for i in range(len(parts) - 1))
        param.requires_grad_(in_layer)
    trainable, total = count_parameters(model)
    if trainable == 0:
        raise ModelError("finetuning_type=freeze found no parameters under '...layers.N...'; "
                         "this architecture names its decoder layers differently.")
    log_rank0(logger, "freeze: training the last %d of %d layers (%d of %d parameters)", num_trainable_layers,
              num_layers, trainable, total)
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; ZeRO-3 partitioned parameters report their full size."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", None) or param.numel()
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def moe_loss_coefficients(model: nn.Module, megatron, stage: str) -> tuple[float, float]:
    """(load-balancing, router z-loss) coefficients a pt/sft run adds (``TokenMeanLossMixin``): the recipe's
    ``moe_aux_loss_coeff``, else the model config's ``router_aux_loss_coef`` (Megatron's default too), and the
    recipe's ``moe_z_loss_coeff`` (default off); (0, 0) for a dense model. DPO and rm train without them here (one
    warning when one would apply): see docs/mca-training.md."""
    config = model.config.get_text_config()
    recipe_aux = megatron.moe_aux_loss_coeff
    if recipe_aux and not hasattr(config, "router_aux_loss_coef") and hasattr(config, "output_router_logits") \
            and _has_routers(model):
        raise ConfigError(f"moe_aux_loss_coeff={recipe_aux}: model_type {config.model_type!r} has no "
                          "load-balancing loss (it balances its experts with the router's score-correction bias, "
                          "and its HF implementation computes none). Set moe_aux_loss_coeff: 0 (or leave it out).")
    if not hasattr(config, "router_aux_loss_coef") or not hasattr(config, "output_router_logits") or \
            not _has_routers(model):
        return 0.0, 0.0
    aux = float(config.router_aux_loss_coef if recipe_aux is None else recipe_aux)
    z = float(megatron.moe_z_loss_coeff or 0.0)
    if stage in ("dpo", "kto", "rm") and (aux or z):
        warn_once(logger, f"stage {stage} on the standard backend trains this MoE model without the load-balancing "
                          "loss and the router z-loss (the mca backend adds them): set moe_aux_loss_coeff: 0 "
                          "(and no moe_z_loss_coeff) for the same objective on both backends.")
        return 0.0, 0.0
    return aux, z


def _has_routers(model: nn.Module) -> bool:
    """Whether the model holds a router whose logits transformers records (``_can_record_outputs``). A config
    can name MoE keys for a model whose layers are all dense (e.g. a shallow Flint or DeepSeek-V4: the first
    layers are dense), and asking such a model for ``output_router_logits`` fails inside transformers on the
    empty tuple. Model code that declares no recorder (older or remote code) is trusted to have routers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if not isinstance(target, type):
        return True
    return any(isinstance(module, target) for module in base.modules())

