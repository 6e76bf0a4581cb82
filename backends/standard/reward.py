"""Stage rm on the standard backend: transformers' ``...ForSequenceClassification`` trained by TRL's
``RewardTrainer`` on roll's rows (the definition: ``roll.reward``).

- ``load_reward_model``: ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)``, held to
  roll's strict weight check (the checkpoint's ``lm_head`` is the one tensor it may leave unused); a head the
  checkpoint lacks starts at zero (also under ZeRO-3, gathered), and ``config.pad_token_id`` is the
  tokenizer's, which transformers pools by.
- ``RollRewardTrainer``: TRL 1.16's ``RewardTrainer`` with its loss as it is (``-logsigmoid(r_c - r_r).mean()``
  over the micro-batch's pairs, no margin column, no centring), fed roll's tokenized pairs (``RewardBatch``:
  the pairwise collator's rows without ``labels``, which only mark the scored token for the mca backend),
  logging ``roll.reward.METRICS`` as global sums over global pair counts (TRL logs ``accuracy`` and ``margin``
  as means of micro-batch means, and min / mean / max reward and a token count, which the mca backend does not
  compute).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from backends.standard.reliability import SafeCheckpointMixin, SafeStepMixin
from backends.standard.trainers import RollTrainerMixin
from roll import reward
from roll.errors import ConfigError, ModelError

HEAD_MODULE = "score"
"""The head's module name in transformers' ``...ForSequenceClassification``."""


def load_reward_model(path: str, *, dtype: torch.dtype, pad_token_id: int | None, trust_remote_code: bool = False,
                      attn_implementation: str | None = None, what: str = "model_name_or_path") -> nn.Module:
    """The reward model of ``path`` (a causal LM, or a reward model trained on; see the module docstring)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from backends.standard.models import check_loading_info

    reward.sequence_classification_class(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
                                         .to_dict())  # a family without one: roll's message, not HF's
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    unused = {name for name in info.get("unexpected_keys") or () if name != reward.LM_HEAD}
    check_loading_info(model, {**info, "unexpected_keys": unused}, path, what=what)
    missing_head = reward.HEAD in set(info.get("missing_keys") or ())
    if missing_head:
        zero_head(model)
    reward.log_head_start(path, not missing_head)
    model.config.pad_token_id = pad_token_id  # transformers pools at the rightmost token that is not this id
    model.config.use_cache = False
    return model


def head_of(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, HEAD_MODULE, None)
    if not isinstance(head, nn.Linear):
        raise ModelError(f"stage rm: {type(base).__name__} has no linear head named {HEAD_MODULE!r} (transformers' "
                         "...ForSequenceClassification layout), which roll trains as the reward head.")
    return head


def zero_head(model: nn.Module) -> None:
    """The reward head at zero (every reward 0: the first loss is ln 2). Under ZeRO-3 the weight is
    partitioned: gathered, zeroed on rank 0 and scattered back (DeepSpeed's GatheredParameters)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    weight = head_of(model).weight
    gathered = contextlib.nullcontext()
    if is_deepspeed_zero3_enabled():
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([weight], modifier_rank=0)
    with gathered, torch.no_grad():
        weight.zero_()


def lora_targets_without_head(finetuning) -> None:
    """LoRA never adapts the reward head (it trains in full): refuse a lora_target that names it."""
    targets = finetuning.lora_targets
    if targets != "all" and HEAD_MODULE in targets:
        raise ConfigError(f"lora_target names {HEAD_MODULE!r}, the reward head, which stage rm trains in full "
                          "(saved in the adapter as modules_to_save): remove it from lora_target.")


def train_head(model: nn.Module) -> nn.Module:
    """finetuning_type freeze: the head trains too (a frozen zero head would never move the loss off ln 2)."""
    head_of(model).requires_grad_(True)
    return model


@dataclass
class RewardBatch:
    """roll's pairwise batch as TRL's RewardTrainer reads it: ``input_ids`` / ``attention_mask`` of shape
    [2B, L], chosen rows first; ``labels`` (the scored-token mark) left out: the HF model pools by the pad id.

    Example (``RewardBatch(PairwiseCollator(pad_token_id=0))``)::

        [{"chosen_input_ids": [5, 6, 7], "chosen_attention_mask": [1, 1, 1], "chosen_labels": [-100, -100, 7],
          "rejected_input_ids": [5, 8], "rejected_attention_mask": [1, 1], "rejected_labels": [-100, 8]}]
        -> {"input_ids": [[5, 6, 7], [5, 8, 0]], "attention_mask": [[1, 1, 1], [1, 1, 0]]}
    """

    collator: Callable[[list[dict]], dict]

    def __call__(self, features: list[dict]) -> dict[str, Any]:
        batch = dict(self.collator(features))
        batch.pop("labels")
        return batch


def make_reward_trainer_class():
    """Build RollRewardTrainer lazily: importing trl costs seconds and pt/sft runs never need it."""
    from trl import RewardTrainer

    class RollRewardTrainer(SafeCheckpointMixin, SafeStepMixin, RollTrainerMixin, RewardTrainer):
        """TRL's reward loss on roll's tokenized pairs, logging ``roll.reward.METRICS`` (module docstring) as
        global sums over global pair counts since the last log (every rank's pairs, the eval set's each once),
        as the mca backend reduces them; TRL's own are means of micro-batch means. ``eval_loss`` likewise: HF's
        weights each eval batch's mean by its rows, counting the rows accelerate repeats to even out the last
        batch over ranks."""

        _roll_sums: dict[str, torch.Tensor] | None = None

        def _roll_flops_config(self):
            return reward.flops_fields(self.model.config.to_dict())

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # roll.data tokenized it already; TRL's text path (it appends an EOS) does not apply

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            self._metrics[mode].clear()  # TRL's accuracy, margin, min / mean / max reward, token count
            chosen, rejected = outputs.logits.detach().squeeze(-1).double().chunk(2)
            margin = chosen - rejected
            pairs = torch.stack([torch.ones_like(chosen), -torch.nn.functional.logsigmoid(margin), (margin > 0).double(),
                                 margin, chosen, rejected], dim=-1)  # [pairs, count + loss + METRICS]
            sums = self.accelerator.gather_for_metrics(pairs).sum(0)
            self._roll_sums = self._roll_sums or {}
            self._roll_sums[mode] = sums + self._roll_sums.get(mode, 0)
            return (loss, outputs) if return_outputs else loss

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            mode = "train" if self.model.training else "eval"
            sums = (self._roll_sums or {}).pop(mode, None)
            if sums is not None:
                count, loss, *totals = sums.tolist()
                prefix = "eval_" if mode == "eval" else ""
                logs.update({prefix + name: total / max(count, 1.0) for name, total in zip(reward.METRICS, totals)})
                if mode == "eval" and "eval_loss" in logs:  # training's loss stays the one optimised (HF's)
                    logs["eval_loss"] = loss / max(count, 1.0)
            super().log(logs, start_time)

    return RollRewardTrainer
