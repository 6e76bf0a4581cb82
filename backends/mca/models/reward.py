"""Stage rm on Megatron: a GPTModel whose output layer is HF's 1-wide ``score`` head (``roll.reward``).

- **Head** (``ScoreHead``): a ``[1, hidden]`` weight without bias in ``output_layer`` of the last pipeline
  stage (the model is built untied: there is no vocabulary projection to share the embedding with). It is
  whole on every tensor-parallel rank, not vocab-parallel: with sequence parallelism the hidden states are
  gathered over the TP group first (Megatron's gather, whose backward keeps this rank's slice of the gradient),
  so every TP rank computes the same scores from the same full sequence and gets the full, identical gradient
  of the head and of the hidden states; nothing is reduced over TP (Megatron's ``finalize_model_grads`` leaves
  an untagged parameter alone, and its gradient norm counts it on TP rank 0 only). Output ``[s, b, 1]``,
  which GPTModel hands back as ``[b, s, 1]``: one score per position; the objective reads it at the scored
  token (``backends.mca.trainer.reward``).
- **Names**: Megatron's ``output_layer.weight``, canonical ``output_layer.score.weight`` (``layout``), HF
  ``score.weight`` (``reward_template``: the family's template with that row in place of ``lm_head``; a
  checkpoint without it starts the head at zero, a causal LM's ``lm_head`` is left unused).
- **Export**: ``save_reward_hf`` writes an HF ``...ForSequenceClassification`` directory; with LoRA,
  ``save_reward_adapter`` a PEFT adapter of task SEQ_CLS holding the trained head as ``modules_to_save``
  (``base_model.model.score.weight``), as PEFT saves it from the standard backend.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn

from backends.mca.models.mapping import Rename
from backends.mca.models.template import Template
from backends.mca.models.unwrap import unwrap_model
from roll import reward
from roll.errors import ConfigError

SCORE = "output_layer.score.weight"
"""The head's canonical Megatron name."""


class ScoreHead(nn.Module):
    """GPTModel's ``output_layer`` for a reward model: ``hidden [s(/tp), b, h] -> scores [s, b, 1]``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.weight = nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))

    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # every TP rank scores the whole sequence (see the module docstring)
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False)
        return nn.functional.linear(input_, self.weight), None


def attach_score_head(model: nn.Module) -> None:
    """Put the score head in place of the vocabulary projection of a freshly built GPTModel's last stage."""
    if getattr(model, "post_process", False):
        model.output_layer = ScoreHead(model.config)


def score_heads(chunks: list[nn.Module]) -> list[ScoreHead]:
    """The score head(s) among this rank's chunks (none off the last pipeline stage)."""
    return [m for chunk in chunks for m in unwrap_model(chunk).modules() if isinstance(m, ScoreHead)]


def train_score_heads(chunks: list[nn.Module]) -> None:
    """LoRA freezes the model and trains adapters; the head of a reward model trains in full."""
    for head in score_heads(chunks):
        head.requires_grad_(True)


class RewardTemplate(Template):
    """A family's template for its reward model; its HF config is a ``...ForSequenceClassification``'s."""

    def hf_config_dict(self, mca) -> dict:
        return reward.export_config(super().hf_config_dict(mca), mca.hf_config.get("pad_token_id"))


_TEMPLATES: dict[str, RewardTemplate] = {}


def reward_template(base: Template) -> RewardTemplate:
    """``base`` with the score row in place of the LM head's (``score.weight`` optional, ``lm_head`` ignored)."""
    if base.model_type not in _TEMPLATES:
        weights = [m for m in base.weights if m.mca != "output_layer.weight"] + [Rename(reward.HEAD, SCORE)]
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                  if f.init and not f.name.startswith("_")}
        _TEMPLATES[base.model_type] = RewardTemplate(**{**fields, "weights": weights, "optional": (reward.HEAD,),
                                                        "ignored": (reward.LM_HEAD,)})
    return _TEMPLATES[base.model_type]


def check_start(path: str) -> None:
    """A Megatron checkpoint of a causal LM cannot start a reward model (its output layer is the vocabulary's);
    an HF directory or a roll reward-model checkpoint can."""
    from backends.mca.models.auto import has_mca_config, has_megatron_weights
    from backends.mca.models.config import McaModelConfig

    if has_mca_config(path) and has_megatron_weights(path) and not McaModelConfig.from_pretrained(path).reward_head:
        raise ConfigError(f"stage rm: model_name_or_path={path!r} is a Megatron checkpoint of a causal LM, whose "
                          "output layer is the vocabulary projection, not a reward head: point it at the HF "
                          "model (config.json + safetensors), e.g. that checkpoint's HF export.")


def save_reward_hf(chunks: list[nn.Module], out_dir: str, *, tokenizer_dir: str | None,
                   pad_token_id: int | None) -> None:
    """The reward model as an HF ``...ForSequenceClassification`` directory (collective)."""
    from backends.mca.models.export import save_hf

    save_hf(chunks, out_dir, tokenizer_dir=tokenizer_dir, config_updates={"pad_token_id": pad_token_id})


def save_reward_adapter(chunks: list[nn.Module], out_dir: str, base_model_name_or_path: str, *,
                        tokenizer_dir: str | None) -> str:
    """The LoRA adapter and the trained head as a PEFT SEQ_CLS adapter (collective; rank 0 writes)."""
    from safetensors.torch import save_file

    from backends.mca.lora.apply import lora_spec_of
    from backends.mca.lora.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, gather_adapter
    from backends.mca.models.export import copy_tokenizer_files, gather_unit
    from roll.outputs import remove_stale_weights

    tensors = gather_adapter(chunks)
    heads = score_heads(chunks)
    head = gather_unit({SCORE: (heads[0].weight, "replicated")} if heads else {})
    if dist.get_rank() == 0:
        tensors[f"base_model.model.{reward.HEAD}"] = head[SCORE].float().contiguous()
        config = lora_spec_of(chunks).peft_config(base_model_name_or_path)
        config.task_type, config.modules_to_save = "SEQ_CLS", ["score"]
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(out_dir)
        remove_stale_weights(out_dir, keep={ADAPTER_WEIGHTS, ADAPTER_CONFIG})
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
    dist.barrier()
    return out_dir
