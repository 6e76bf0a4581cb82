"""Stage rm's objective on Megatron: the Bradley-Terry loss on the score head's output (``roll.reward``).

The model (``backends.mca.models.reward``) gives one score per position, ``[b, s, 1]``; a row's reward is the
score at the position its ``labels`` mark (``roll.data.reward``: the rightmost non-pad token; the mca
backend does not shift labels for this stage). Under context parallelism each rank holds part of every row:
the marked score (0 where the mark is elsewhere) is summed over the CP group, as DPO's log-probs are
(``backends.mca.trainer.loss.sequence_log_probs``: every CP rank then computes the same loss, and the schedule's
count, summed over CP ranks too, divides the CP factor of the gradient out again).

The loss function returns the sum of per-pair losses and the number of pairs (filler pairs past the end of
the data carry no mark and count for nothing), so the step's loss is the mean over the pairs of the global
batch, as on the standard backend (TRL's per-micro-batch mean, micro-batches of equal size).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from backends.mca.trainer.step import pair_loss_output, pair_metrics
from roll import IGNORE_INDEX
from roll.reward import METRICS


def pooled_rewards(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's reward: its score at the marked position, float64 ``[rows]``; marks per row ``[rows]``).

    ``scores`` ``[b, s]`` (this CP rank's positions), ``labels`` ``[b, s]`` with one mark per real row.
    """
    from megatron.core import parallel_state as ps

    marked = labels != IGNORE_INDEX
    rewards = torch.where(marked, scores.double(), 0.0).sum(-1)
    marks = marked.sum(-1)
    if ps.get_context_parallel_world_size() > 1:
        import torch.distributed.nn.functional as dist_fn

        group = ps.get_context_parallel_group()
        rewards = dist_fn.all_reduce(rewards, group=group)
        marks = dist_fn.all_reduce(marks.float(), group=group).round().long()
    return rewards, marks


def reward_losses(rewards: torch.Tensor, marks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses ``-logsigmoid(r_chosen - r_rejected)`` of rows [chosen..., rejected...], filler pairs
    (no mark) zeroed; returns (losses [pairs], the sums of ``roll.reward.METRICS``, real pairs)."""
    chosen, rejected = rewards.chunk(2)
    valid = (marks.chunk(2)[0] > 0).to(rewards.dtype)
    margin = chosen - rejected
    losses = -F.logsigmoid(margin) * valid
    margin, chosen, rejected = margin.detach(), chosen.detach(), rejected.detach()
    stats = torch.stack([(margin > 0).to(rewards.dtype), margin, chosen, rejected])  # as METRICS
    return losses, (stats * valid).sum(-1), valid.sum()


class RewardObjective:
    """rm: per-pair Bradley-Terry losses summed, divided by the pairs (report: [loss sum, pairs, the sums of
    accuracy, margin, chosen and rejected rewards])."""

    report_size = 2 + len(METRICS)
    rows_per_sample = 2
    """Rows of the batch per sample (chosen, rejected): the speed window's mean real tokens per row."""

    def prepare(self, micro: list[dict], seq_length: int) -> None:
        """Nothing to compute before the pass."""

    def loss_func(self, labels: torch.Tensor, micro: dict) -> Callable:
        def loss_func(scores: torch.Tensor):
            rewards, marks = pooled_rewards(scores[..., 0], labels)
            return pair_loss_output(*reward_losses(rewards, marks))

        return loss_func

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return pair_metrics(sums, METRICS)
