"""The reference-free preference losses of stage dpo, ``pref_loss: orpo`` and ``pref_loss: simpo``: one
definition, computed by both backends (DESIGN.md section 1) from the float64 response log-prob sums and
response-token counts that roll.loss gives each row, so no reference model is built or run for them.

Per pair, ``A = S / n`` is a response's mean token log-probability (``S`` the sum of its ``n`` response tokens'
log-probabilities; prompt tokens are not scored), ``c`` the chosen response, ``r`` the rejected one, ``beta``
is ``pref_beta``. The loss of a micro-batch is the mean of these per-pair losses, as for sigmoid/ipo/hinge.

- **orpo** (Hong et al. 2024), LLaMA-Factory's definition (ROLL's too):
  ``-A_c + beta * -log sigmoid(log_odds)``, ``log_odds = (A_c - A_r) - (log(1 - exp(A_c)) - log(1 - exp(A_r)))``:
  each chosen response's mean token NLL, plus ``beta`` times the odds-ratio term. TRL 1.16's ORPOTrainer has
  the same odds-ratio term, but its NLL is one token mean over the micro-batch's chosen rows, prompt tokens
  included (the paper's code; TRL#1676): a long chosen response or a long prompt weighs more there. A recipe
  written for LLaMA-Factory trains LLaMA-Factory's objective, so that is the one here.
  ``log(1 - exp(x))`` is ``log1mexp`` below, in float64 (the sums' dtype): LLaMA-Factory's
  ``log1p(-exp(x))`` is -inf, and the loss NaN, as ``A`` nears 0 (TRL#1473).
- **simpo** (Meng et al. 2024): ``-log sigmoid(beta * (A_c - A_r) - gamma)``, ``gamma`` = ``simpo_gamma``, an
  absolute margin on the ``beta``-scaled difference (TRL and LLaMA-Factory subtract ``gamma / beta`` before
  multiplying by ``beta``: the same number; the SimPO paper's ``gamma_beta_ratio`` is ``gamma / beta``). As
  LLaMA-Factory's simpo and TRL 1.16's ``CPOTrainer(loss_type="simpo", cpo_alpha=0)``: no NLL term (CPO's
  default ``cpo_alpha=1`` adds a token-mean NLL; here only ``pref_ftx`` adds one). With
  ``pref_label_smoothing`` eps TRL's CPO form: ``-(1 - eps) log sigmoid(m) - eps log sigmoid(-m)``
  (LLaMA-Factory refuses label smoothing for simpo).
- ``pref_ftx`` adds ``pref_ftx * -A_c`` to each pair's loss (``roll.loss.chosen_sft_losses``), as for every
  pref_loss; with orpo the chosen NLL's weight is then ``1 + pref_ftx`` (LLaMA-Factory adds it the same way).

Metrics (per pair; the backends average them over the pairs): ``rewards/chosen = beta * A_c``,
``rewards/rejected = beta * A_r``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen = A_c``,
``logps/rejected = A_r`` (the means, as TRL's ORPO/CPO and LLaMA-Factory log them for these losses); orpo adds
TRL's ``nll_loss`` (``-A_c``), ``log_odds_ratio`` (``log sigmoid(log_odds)``, <= 0; LLaMA-Factory logs its
negation as ``odds_ratio_loss``) and ``log_odds_chosen`` (``log_odds``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from roll import loss as roll_loss
from roll.config.finetuning import REFERENCE_FREE_LOSSES

_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected")
METRICS = {"orpo": (*_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"), "simpo": _METRICS}
"""The metrics ``reference_free_losses`` returns for each loss, in its order."""

LOG1MEXP_MAX = -1e-30
"""``log1mexp``'s argument is at most this: a mean log-prob of exactly 0 (a filler pair without response tokens,
or a response every token of which the model predicts with probability 1 in float32) gives a finite, very large
log-odds (``log(1 - exp(-1e-30)) = -69``), not -inf and a NaN loss."""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate over the whole range (Maechler 2012): ``log(-expm1(x))``
    above ``-ln 2``, ``log1p(-exp(x))`` below, as TRL's ORPO computes it. Each branch sees only arguments of its
    own range (a ``where`` over a branch that is infinite elsewhere would give NaN gradients)."""
    x = x.clamp(max=LOG1MEXP_MAX)
    near = x > -math.log(2)
    near_zero = torch.log(-torch.expm1(torch.where(near, x, -math.log(2))))
    far = torch.log1p(-torch.exp(torch.where(near, -math.log(2), x)))
    return torch.where(near, near_zero, far)


def reference_free_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
                          rejected_tokens: torch.Tensor, *, loss_type: str, beta: float, gamma: float | None = None,
                          label_smoothing: float = 0.0, ftx: float = 0.0
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses ``[pairs]`` of ``loss_type`` (orpo, simpo) and the per-pair metrics ``METRICS[loss_type]``
    (detached), from each response's log-prob sum (``*_logps``, float64) and response tokens (``*_tokens``;
    0 for a filler pair, whose values are finite). ``gamma``: simpo_gamma (simpo only)."""
    chosen = chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)  # A_c
    rejected = rejected_logps / rejected_tokens.clamp(min=1).to(rejected_logps.dtype)  # A_r
    nll = roll_loss.chosen_sft_losses(chosen_logps, chosen_tokens)  # -A_c
    extra = {}
    if loss_type == "orpo":
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = nll - beta * ratio
        extra = {"nll_loss": nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    elif loss_type == "simpo":
        assert gamma is not None, "simpo needs simpo_gamma (FinetuningArguments sets its default)"
        margin = beta * (chosen - rejected) - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    else:
        raise ValueError(f"{loss_type!r} is not a reference-free loss; choose one of {', '.join(REFERENCE_FREE_LOSSES)}")
    if ftx:
        losses = losses + ftx * nll
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    metrics = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
               "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
               "rewards/margins": chosen_rewards - rejected_rewards, "logps/chosen": chosen.detach(),
               "logps/rejected": rejected.detach(), **{name: value.detach() for name, value in extra.items()}}
    assert tuple(metrics) == METRICS[loss_type]
    return losses, metrics
