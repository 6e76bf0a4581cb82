"""``pref_loss: orpo`` and ``pref_loss: simpo`` on the standard backend: RollDPOTrainer's loss for them.

TRL 1.16's DPOTrainer has neither loss, and its ORPO and CPO trainers (``trl.experimental``) tokenize their
own data, take log-probs of the model-dtype logits and define ORPO's NLL over the prompt tokens too
(``roll.preference`` says why roll follows LLaMA-Factory there). So for these two RollDPOTrainer replaces TRL's
``_compute_loss`` with ``reference_free_loss``: one policy forward through TRL's fused-head call (which
``dpo_logps.use_roll_log_probs`` routes through roll.loss, as for every DPO loss), each row's float64 log-prob
sum and response tokens, ``roll.preference.reference_free_losses`` (the mca backend calls the same), their
mean over the micro-batch's pairs, and TRL's way of logging: per micro-batch, each metric's mean over the pairs
of every process. No reference model exists: the backend loads none, and TRL's reference log-probs are
declared precomputed (``hf_args``; RollDPOTrainer fills them with zeros that this loss never reads), so TRL
builds none either.
"""

from __future__ import annotations

import torch

from roll import IGNORE_INDEX, preference
from roll import loss as roll_loss

NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
"""Batch columns that are not model inputs (PreferenceBatch's)."""


def reference_free_loss(trainer, model, inputs: dict, return_outputs: bool, *, gamma: float | None, ftx: float):
    """The micro-batch's loss (and TRL's ``outputs`` with ``return_outputs``) for ``trainer`` (a RollDPOTrainer
    whose pref_loss is orpo or simpo; ``gamma``: simpo_gamma, ``ftx``: pref_ftx); logs its metrics."""
    mode = "train" if trainer.model.training else "eval"
    completion_mask = inputs["completion_mask"]
    kwargs = {key: value for key, value in inputs.items() if key not in NON_MODEL_KEYS}
    kwargs["use_cache"] = False
    if trainer.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    labels = inputs["input_ids"].masked_fill(completion_mask == 0, IGNORE_INDEX)
    outputs = model(**kwargs, labels=labels, fused_lm_head=True)
    width = completion_mask.shape[1] - 1  # prompt-learning PEFT prepends virtual tokens: keep the real ones
    log_probs, mask = outputs.log_probs[:, -width:], outputs.label_mask[:, -width:]
    logps, tokens = roll_loss.sequence_sums(log_probs), mask.sum(-1)  # rows: chosen, then rejected
    (chosen, rejected), (chosen_tokens, rejected_tokens) = logps.chunk(2), tokens.chunk(2)
    losses, metrics = preference.reference_free_losses(
        chosen, rejected, chosen_tokens, rejected_tokens, loss_type=trainer.loss_types[0], beta=trainer.beta,
        gamma=gamma, label_smoothing=trainer.label_smoothing, ftx=ftx)
    loss = losses.mean()
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * outputs.aux_loss
    for name, values in metrics.items():
        trainer._metrics[mode][name].append(trainer.accelerator.gather(values).mean().item())
    if not return_outputs:
        return loss
    with torch.no_grad():  # TRL's own path: the fused head builds no logits, a plain forward does
        return loss, model(**{key: value for key, value in kwargs.items() if key != "output_router_logits"})
