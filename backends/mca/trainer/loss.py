"""The loss contract on Megatron (DESIGN.md section 1), from vocab-parallel logits.

For pt/sft the loss function returns ``(sum of token losses, number of trainable tokens, report)``; with
``calculate_per_token_loss`` the schedule does not divide, and ``finalize_model_grads`` scales the
gradients by ``1 / tokens of the global batch`` (summed over micro-batches, DP and CP ranks). The
step's loss is therefore the per-token mean over the global batch, as on the standard backend. For
dpo it returns the sum of per-pair losses and the number of pairs: the mean over the pairs of the
global batch.

Padded vocabulary columns (the embedding is padded to a multiple of
``make_vocab_size_divisible_by * TP``) hold no token: they are left out of the softmax (as if their
logits were -inf), so they add nothing to its denominator (Megatron-LM #1754: a zero row adds ``exp(0 - max)``
and the loss differs from Hugging Face's).

The arithmetic is roll.loss's, the standard backend's too, at every TP size: its kernel takes this rank's
slice of the (padded) vocabulary as it is, masks the padding without a masked copy of the logits, and with
TP > 1 all-reduces the max and the sums over the TP group (max-subtracted log-sum-exp in float32, as
Megatron's vocab-parallel kernel does); token log-probs are summed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roll import loss as roll_loss
from roll import preference


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``labels`` under vocab-parallel ``logits``, without gathering
    the vocabulary; 0 where the label is IGNORE_INDEX. Returns ``(log_probs [b, s], mask [b, s])``.

    ``logits`` are ``[b, s, V/tp]`` (GPTModel's output on the last stage), ``labels`` ``[b, s]``. roll.loss's
    kernel on this rank's slice of the vocabulary: columns ``>= vocab_size`` (the padding) are left out of
    the softmax, with TP > 1 the max and the sums are all-reduced over the TP group. Its backward writes the
    gradient into the logits, as Megatron's own cross entropy does: they are not reused.
    """
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return roll_loss.token_log_probs(logits, labels, vocab_size)
    first = logits.shape[-1] * ps.get_tensor_model_parallel_rank()
    return roll_loss.token_log_probs(logits, labels, vocab_size, group=ps.get_tensor_model_parallel_group(),
                                     first=first)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of token losses, trainable tokens) of one pt/sft micro-batch."""
    log_probs, mask = token_log_probs(logits, labels, vocab_size)
    return roll_loss.loss_sum(log_probs), mask.sum()


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of each row's response-token log-probs ``[rows]``, response tokens per row ``[rows]``).

    With context parallelism each CP rank holds a part of every row: the parts are summed over the
    CP group. The sum's backward also sums (every CP rank computes the same loss from the totals), so
    each rank's gradient is CP times its share; the schedule's count is summed over CP ranks too,
    which divides that factor out again in ``finalize_model_grads``.
    """
    from megatron.core import parallel_state as ps

    log_probs, mask = token_log_probs(logits, labels, vocab_size)
    logps, tokens = roll_loss.sequence_sums(log_probs), mask.sum(-1)
    if ps.get_context_parallel_world_size() > 1:
        import torch.distributed.nn.functional as dist_fn

        group = ps.get_context_parallel_group()
        logps = dist_fn.all_reduce(logps, group=group)
        tokens = dist_fn.all_reduce(tokens.float(), group=group).round().long()
    return logps, tokens


@dataclass(frozen=True)
class DPOSettings:
    """The recipe's DPO keys (pref_beta, pref_loss, pref_label_smoothing, pref_ftx, simpo_gamma)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    ftx: float = 0.0
    simpo_gamma: float | None = None


def dpo_losses(logps: torch.Tensor, ref_logps: torch.Tensor, tokens: torch.Tensor,
               settings: DPOSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses of rows [chosen..., rejected...] as TRL computes them, filler pairs (no
    response token) zeroed; returns (losses [pairs], sums of the six logged metrics, real pairs).

    - sigmoid: ``-logsigmoid(beta * delta)``; with label smoothing eps the conservative form
      ``-(1 - eps) logsigmoid(beta * delta) - eps logsigmoid(-beta * delta)``;
    - hinge: ``relu(1 - beta * delta)``;
    - ipo: ``(delta_per_token - 1 / (2 beta))^2`` with each log-ratio divided by its response tokens;

    where ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)`` (log-prob sums); with ``ftx`` > 0
    each pair adds ``ftx`` times its chosen response's mean token NLL (``roll.loss.chosen_sft_losses``).
    orpo and simpo read no reference (``ref_logps`` unused): ``roll.preference``'s losses and metrics.
    """
    chosen, rejected = logps.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    if settings.loss_type in preference.REFERENCE_FREE_LOSSES:
        losses, metrics = preference.reference_free_losses(
            chosen, rejected, chosen_tokens, rejected_tokens, loss_type=settings.loss_type, beta=settings.beta,
            gamma=settings.simpo_gamma, label_smoothing=settings.label_smoothing, ftx=settings.ftx)
        valid = (chosen_tokens > 0).to(losses.dtype)
        return losses * valid, (torch.stack(list(metrics.values())) * valid).sum(-1), valid.sum()
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    beta, eps = settings.beta, settings.label_smoothing
    if settings.loss_type == "sigmoid":
        delta = beta * (chosen_ratio - rejected_ratio)
        losses = -(1 - eps) * F.logsigmoid(delta) - eps * F.logsigmoid(-delta)
    elif settings.loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen_ratio - rejected_ratio))
    elif settings.loss_type == "ipo":
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {settings.loss_type!r}; choose sigmoid, hinge or ipo")
    if settings.ftx:
        losses = losses + settings.ftx * roll_loss.chosen_sft_losses(chosen, chosen_tokens)
    valid = (chosen_tokens > 0).to(losses.dtype)
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack([chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).to(losses.dtype),
                         chosen_rewards - rejected_rewards, chosen.detach(), rejected.detach()])
    return losses * valid, (stats * valid).sum(-1), valid.sum()
