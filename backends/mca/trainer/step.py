"""One pass through Megatron's schedules, and what a step optimises (the objective).

``run_schedule`` feeds a list of micro-batches to ``get_forward_backward_func()``: no pipelining,
1F1B, or interleaved with a virtual pipeline (one iterator per chunk over the same micro-batches).

An objective gives the schedule its loss function for each micro-batch (returning the loss sum,
the count it is normalised by, and a report vector) and turns the report vectors summed over the
global batch into the logged metrics:

- ``LanguageModelObjective`` (pt, sft): token losses summed, divided by the trainable tokens;
- ``DPOObjective`` (dpo): per-pair DPO losses summed, divided by the pairs; before the policy pass
  the frozen reference chunks run forward-only over the same micro-batches (through the same
  pipeline schedule), and their sequence log-probs wait on the last stage, where the loss is taken.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from backends.mca.trainer import loss as L

REPORT = "report"
"""Key of the report vector in what a loss function hands back to the schedule."""


def pair_loss_output(losses: torch.Tensor, stats: torch.Tensor, pairs: torch.Tensor):
    """A pairwise objective's loss-function result (dpo, rm): the loss sum, the pairs it counts, and the report
    [loss sum, pairs, *stats] that ``pair_metrics`` turns into per-pair means."""
    loss_sum = losses.sum()
    report = torch.cat([torch.stack([loss_sum.detach(), pairs.double()]), stats.double()])
    return loss_sum.float(), pairs.to(torch.int), {REPORT: report}


def pair_metrics(sums: list[float], names) -> dict[str, float]:
    """The summed reports of ``pair_loss_output`` as per-pair means: loss, then ``names`` for the stats."""
    pairs = max(sums[1], 1.0)
    return {"loss": sums[0] / pairs, **{name: value / pairs for name, value in zip(names, sums[2:])}}


def run_schedule(chunks: list[torch.nn.Module], micro: list[dict], forward_step: Callable, *,
                 forward_only: bool, seq_length: int) -> list[dict]:
    """Forward (and backward) over ``micro``; the loss functions' reports, on the last stage only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = micro[0]["input_ids"].shape[0]
    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=len(micro),
        seq_length=seq_length, micro_batch_size=rows, forward_only=forward_only)


class LanguageModelObjective:
    """pt / sft: the per-token mean over the global batch (report: [loss sum, tokens])."""

    report_size = 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def prepare(self, micro: list[dict], seq_length: int) -> None:
        """Nothing to compute before the policy pass."""

    def loss_func(self, labels: torch.Tensor, micro: dict) -> Callable:
        def loss_func(logits: torch.Tensor):
            loss_sum, count = L.lm_loss(logits, labels, self.vocab_size)
            # The schedule backpropagates the float32 sum (its gradient is the same); the report keeps float64.
            return loss_sum.float(), count, {REPORT: torch.stack([loss_sum.detach(), count.double()])}

        return loss_func

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return {"loss": sums[0] / max(sums[1], 1.0)}


class DPOObjective:
    """dpo: TRL's losses and metrics on (chosen rows, then rejected rows) micro-batches.

    ``ref_chunks`` None means reference-free (reference log-probs 0). ``ref_mode``, when given, is
    entered around the reference pass (LoRA: the policy's own chunks with the adapters disabled, so
    no second model is held). Report: [loss sum, pairs, and the sums of chosen / rejected rewards,
    accuracies, margins, chosen / rejected log-probs; orpo: also its NLL and odds-ratio terms
    (``roll.preference.METRICS``)].
    """

    _METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")

    def __init__(self, vocab_size: int, settings: L.DPOSettings, ref_chunks: list[torch.nn.Module] | None,
                 ref_mode: Callable[[], ContextManager] | None = None) -> None:
        from roll import preference

        self.vocab_size, self.settings, self.ref_chunks, self.ref_mode = vocab_size, settings, ref_chunks, ref_mode
        self.metric_names = preference.METRICS.get(settings.loss_type, self._METRICS)
        self.report_size = 2 + len(self.metric_names)

    def prepare(self, micro: list[dict], seq_length: int) -> None:
        """Reference log-probs of every micro-batch, attached to it (on the last pipeline stage)."""
        if self.ref_chunks is None:
            return
        with torch.no_grad(), (self.ref_mode() if self.ref_mode else contextlib.nullcontext()):
            reports = run_schedule(self.ref_chunks, micro, self._reference_step, forward_only=True,
                                   seq_length=seq_length)
        for batch, report in zip(micro, reports):  # empty on the other stages: they never take the loss
            batch["ref_logps"] = report["logps"]

    def _reference_step(self, data_iterator, model):
        inputs = dict(next(data_iterator))
        labels = inputs.pop("labels")
        inputs.pop("ref_logps", None)
        output = model(**inputs)

        def loss_func(logits: torch.Tensor):
            logps, _ = L.sequence_log_probs(logits, labels, self.vocab_size)
            return torch.zeros((), device=logits.device), torch.zeros((), dtype=torch.int), {"logps": logps}

        return output, loss_func

    def loss_func(self, labels: torch.Tensor, micro: dict) -> Callable:
        ref_logps = micro.get("ref_logps")

        def loss_func(logits: torch.Tensor):
            logps, tokens = L.sequence_log_probs(logits, labels, self.vocab_size)
            reference = torch.zeros_like(logps) if ref_logps is None else ref_logps.to(logps)
            return pair_loss_output(*L.dpo_losses(logps, reference, tokens, self.settings))

        return loss_func

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return pair_metrics(sums, self.metric_names)
