"""One loss arithmetic for both backends (DESIGN.md section 1): per-token log-probabilities and their sums.

Both backends compute every pt/sft token loss and every DPO log-probability with these functions, so the
same logits give the same numbers on both, and the number logged is the number optimised.

- **Per token**: ``log p(label) = (x_label - m) - log(sum_v exp(x_v - m))`` in float32 (logits of lower
  precision are upcast), ``m`` the row's largest logit, the sum a tree reduction (``Tensor.sum``). This is
  Megatron's vocab-parallel cross entropy with the vocabulary in one piece: with tensor parallelism the mca
  backend keeps Megatron's kernel, whose steps are these (max, subtract, exp, sum, log) with the max and the
  sum all-reduced over the vocabulary shards. ``F.cross_entropy`` in float32 (what a Hugging Face model's own
  loss calls) accumulates its log-sum-exp less carefully: on a real 255-token sample of SmolLM2-135M, 5.7e-6
  relative off a float64 reference, against 2e-8 for this arithmetic; trained models' peaked distributions
  are where that shows.
- **Sums**: token log-probabilities are summed in float64 (a row's sum for DPO, a micro-batch's for pt/sft),
  so the sum's error does not grow with the number of tokens; the global per-token mean divides the float64
  sum by the global batch's trainable tokens (the contract's count).

Labels are aligned with the logits passed in (the caller shifts); ``IGNORE_INDEX`` positions get 0.
"""

from __future__ import annotations

import torch

from roll import IGNORE_INDEX


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, mask)``: float32 log-probability of each label under ``logits [..., V]`` (0 where the
    label is IGNORE_INDEX) and the mask of trainable labels, both of ``labels``' shape ``[...]``."""
    mask = labels != IGNORE_INDEX
    logits = logits.float()
    # The max only shifts the exponent range: no gradient flows through it (as in Megatron's kernel).
    shifted = logits - logits.max(dim=-1, keepdim=True).values.detach()
    predicted = shifted.gather(-1, labels.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    log_sum = shifted.exp().sum(dim=-1).log()
    return (predicted - log_sum).masked_fill(~mask, 0.0), mask


def loss_sum(log_probs: torch.Tensor) -> torch.Tensor:
    """The float64 sum of the token losses (``-log_probs``, masked positions 0) of a micro-batch."""
    return -log_probs.double().sum()


def sequence_sums(log_probs: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability ``[rows]``, summed in float64 (``log_probs [rows, s]``): the DPO policy and
    reference log-probs; the DPO loss is taken in float64 from them."""
    return log_probs.double().sum(dim=-1)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float64 token-loss sum, trainable tokens)`` of a causal LM batch with HF-aligned ``labels [b, s]``
    (position ``t``'s logits ``[b, s, V]`` predict label ``t + 1``: shifted here, once)."""
    log_probs, mask = token_log_probs(logits[:, :-1], labels[:, 1:])
    return loss_sum(log_probs), mask.sum()


def chosen_sft_losses(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """DPO's ``pref_ftx`` term of each pair ``[pairs]``: the chosen response's mean per-token negative
    log-likelihood, ``-chosen_logps / chosen_tokens`` (its log-prob sum over its response tokens; 0 for a pair
    without any). Both backends add ``pref_ftx`` times it to each pair's preference loss before the mean over
    pairs: LLaMA-Factory's ``ftx_gamma * sft_loss``, the same for every ``pref_loss`` (TRL's ``sft`` loss type
    instead averages over the micro-batch's chosen tokens, which weights long responses more)."""
    return -chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, valid: torch.Tensor | None) -> torch.Tensor:
    """The MoE load-balancing loss of one micro-batch, before its coefficient: Megatron-Core's ``aux_loss``
    (the Switch Transformer loss of each MoE layer, summed over the layers), float32.

    For each layer's router logits ``[tokens, E]``: ``p = softmax(logits)``, the top-``top_k`` experts of each
    token by ``p``, and ``E / (top_k * T^2) * sum_e (sum_t p_te) * (tokens routed to e)`` over the ``T`` tokens
    where ``valid [tokens]`` is true (None: all). A balanced router gives 1 per layer. Hugging Face's MoE models
    pool all layers into one such sum without the ``1 / top_k``; a pipeline stage cannot compute that pooled
    loss (it holds only its layers), so both backends take this per-layer one (docs/mca-training.md)."""
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        routed = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
        if valid is not None:
            routed, probs = routed * valid.unsqueeze(-1), probs * valid.unsqueeze(-1)
        tokens = (routed.sum() / top_k).clamp(min=1)  # a micro-batch of padding only: 0, not 0 / 0
        total = total + (probs.sum(0) * routed.sum(0)).sum() * (logits.shape[-1] / (top_k * tokens * tokens))
    return total
