"""KTO's loss and metrics, one definition for both backends (docs/kto.md).

TRL 1.16's ``KTOTrainer`` (``loss_type="kto"``), the definition LLaMA-Factory's ``stage: kto`` calls too, on
the response log-prob *sums* ``S`` of the policy and the frozen reference:

- ``rho_i = S_i - S_ref_i``, the reward ``beta * rho_i`` (logged, detached);
- the reference point ``z`` of a micro-batch: the mean over its rows of ``S(x_j, y'_j) - S_ref(x_j, y'_j)``
  on the *mismatched* rows (each prompt with the completion of the micro-batch's previous row:
  ``roll.data.feedback``), averaged over the data-parallel ranks, clamped at 0 and detached
  (``kl_reference_points``);
- a desirable row's loss ``w_D * (1 - sigmoid(beta * (rho_i - z)))``, an undesirable row's
  ``w_U * (1 - sigmoid(beta * (z - rho_i)))``, taken as ``sigmoid(-x)`` (the same number without the
  cancellation of ``1 - sigmoid(x)`` near 1);
- the micro-batch's loss: the mean of its rows' weighted losses, both classes together.

Both backends hand every micro-batch's ``report`` (one float64 vector of sums) to the same reduction: summed
over the step's micro-batches and ranks, ``metrics`` turns the sums into the logged numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REPORT = ("loss", "rows", "desirable", "undesirable", "rewards/chosen", "rewards/rejected", "logps/chosen",
          "logps/rejected", "kl", "kl_batches")
"""The sums in a micro-batch's report, in order: the loss sum over its rows and the rows; the desirable and
undesirable rows; their rewards' and log-probs' sums; ``z`` and 1 (a micro-batch that has rows)."""

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
"""Logged beside ``loss`` (TRL's names); a step without desirable (undesirable) rows logs no ``*/chosen``
(``*/rejected``) and no margin, as TRL does."""


@dataclass(frozen=True)
class KTOSettings:
    """The recipe's KTO keys: pref_beta, kto_desirable_weight, kto_undesirable_weight."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def kl_reference_points(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, valid: torch.Tensor,
                        group=None) -> torch.Tensor:
    """``z`` of each micro-batch ``[M]`` (float64, no gradient) from its mismatched rows' log-prob sums
    ``[M, rows]`` under the policy and the reference; ``valid [M, rows]`` marks real rows (a filler row that
    pads an epoch's last micro-batch counts nothing).

    Each rank takes the mean over its real rows; the means are averaged over the ranks of ``group`` (the
    data-parallel group; None: this process alone) that hold a real row, as TRL averages its ranks' means
    (``gather_for_metrics(kl).mean()``); the result is clamped at 0. One all-reduce for all ``M``."""
    valid = valid.to(torch.float64)
    diff = (kl_logps.detach().double() - ref_kl_logps.detach().double()) * valid
    rows = valid.sum(-1)
    present = (rows > 0).to(torch.float64)
    stats = torch.stack([diff.sum(-1) / rows.clamp(min=1), present])  # [2, M]
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(stats, group=group)
    return (stats[0] / stats[1].clamp(min=1)).clamp(min=0)


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, valid: torch.Tensor,
               z: torch.Tensor, settings: KTOSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's weighted loss ``[rows]``, 0 for a row that is not ``valid``; the micro-batch's ``report``
    ``[len(REPORT)]`` float64) from the rows' response log-prob sums under the policy (``logps``, with
    gradient) and the reference, their labels ``desirable`` (bool) and the micro-batch's ``z``. The
    micro-batch's loss is ``losses.sum() / valid.sum()``."""
    beta = settings.beta
    rho = logps - ref_logps.to(logps)
    wanted = desirable.to(torch.bool)
    margin = torch.where(wanted, rho - z, z - rho)
    weight = torch.where(wanted, torch.full_like(logps, settings.desirable_weight),
                         torch.full_like(logps, settings.undesirable_weight))
    real = valid.to(torch.bool)
    losses = torch.where(real, weight * torch.sigmoid(-beta * margin), torch.zeros_like(logps))
    good, bad = (real & wanted).to(torch.float64), (real & ~wanted).to(torch.float64)
    rewards, sums = beta * rho.detach().double(), logps.detach().double()
    report = torch.stack([losses.detach().double().sum(), real.to(torch.float64).sum(), good.sum(), bad.sum(),
                          (rewards * good).sum(), (rewards * bad).sum(), (sums * good).sum(), (sums * bad).sum(),
                          z.double() * real.any(), real.any().to(torch.float64)])
    return losses, report


def metrics(sums: list[float]) -> dict[str, float]:
    """The logged numbers from ``REPORT``'s sums over a step (or an eval set): ``loss`` the mean over its rows;
    the rewards and log-probs means over each class's rows (left out when the class has none); ``kl`` the
    mean ``z`` of its micro-batches."""
    total = dict(zip(REPORT, sums))
    out = {"loss": total["loss"] / max(total["rows"], 1.0)}
    if total["kl_batches"]:
        out["kl"] = total["kl"] / total["kl_batches"]
    for side, count in (("chosen", total["desirable"]), ("rejected", total["undesirable"])):
        if count:
            out[f"rewards/{side}"] = total[f"rewards/{side}"] / count
            out[f"logps/{side}"] = total[f"logps/{side}"] / count
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
