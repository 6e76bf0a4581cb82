"""The loss contract on Megatron (DESIGN.md section 1), from vocab-parallel logits.

The loss function returns ``(sum of token losses, number of trainable tokens, report)``; with
``calculate_per_token_loss`` the schedule does not divide, and ``finalize_model_grads`` scales the
gradients by ``1 / tokens of the global batch`` (summed over micro-batches, DP and CP ranks). The
step's loss is therefore the per-token mean over the global batch, as on the standard backend.

Padded vocabulary columns (the embedding is padded to a multiple of
``make_vocab_size_divisible_by * TP``) hold no token: their logits are set to -inf before the
softmax, so they add nothing to its denominator (Megatron-LM #1754: a zero row adds ``exp(0 - max)``
and the loss differs from Hugging Face's).
"""

from __future__ import annotations

from typing import Callable

import torch

from roll import IGNORE_INDEX


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits [..., V/tp]`` (this TP rank's vocabulary slice) with columns >= ``vocab_size`` at -inf."""
    from megatron.core import parallel_state as ps

    partition = logits.shape[-1]
    first = partition * ps.get_tensor_model_parallel_rank()
    if first + partition <= vocab_size:
        return logits
    padded = torch.arange(first, first + partition, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, float("-inf"))


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``labels`` under vocab-parallel ``logits``, without gathering
    the vocabulary; 0 where the label is IGNORE_INDEX. Returns ``(log_probs [b, s], mask [b, s])``.

    ``logits`` are ``[b, s, V/tp]`` (GPTModel's output on the last stage), ``labels`` ``[b, s]``.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    mask = labels != IGNORE_INDEX
    logits = mask_padded_vocab(logits.float(), vocab_size)
    # Like Megatron's own loss, the kernel may normalise the logits in place: they are not reused.
    losses = vocab_parallel_cross_entropy(logits, labels.masked_fill(~mask, 0))
    return -losses * mask, mask


def lm_loss_func(labels: torch.Tensor, vocab_size: int) -> Callable[[torch.Tensor], tuple]:
    """The schedule's loss function for one micro-batch of pt/sft."""

    def loss_func(logits: torch.Tensor):
        log_probs, mask = token_log_probs(logits, labels, vocab_size)
        loss_sum = -log_probs.sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    return loss_func
