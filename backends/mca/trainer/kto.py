"""stage kto on Megatron: ``KTOObjective``, roll.kto's loss and metrics through the pipeline schedules.

A micro-batch is ``roll.data.feedback.FeedbackCollator``'s ``[2B, L]`` rows (the ``B`` rows, then their
mismatched rows) and ``kto_tags [B]``. Before the policy's training pass, forward-only passes through the same
pipeline schedule (as DPO's reference pass) give the last stage every number the loss needs besides the
policy's own log-probs: the reference's log-probs of all ``2B`` rows, and the policy's of the mismatched rows
(no gradient: the reference point is detached, and the weights do not change within a step, so this is what
TRL's in-step ``no_grad`` forward computes). Each micro-batch's reference point ``z`` is then taken over the
data-parallel group in one all-reduce for the step's micro-batches (``roll.kto.kl_reference_points``), and the
policy pass runs on the ``B`` rows alone. The loss function returns the sum of the rows' weighted losses and
the rows, so the step's loss is the mean over the rows of the global batch, which is TRL's mean of
micro-batch means when every micro-batch is full.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from backends.mca.trainer import loss as L
from backends.mca.trainer.data import LOSS_INPUTS
from backends.mca.trainer.step import REPORT, run_schedule
from roll import kto as roll_kto

ROW_KEYS = ("input_ids", "position_ids", "labels", "padding_mask")
"""The keys of a micro-batch's model inputs that hold one entry per row."""


def take_rows(micro: dict, start: int, stop: int) -> dict:
    """Rows ``[start, stop)`` of a micro-batch's model inputs (unpacked rows: kto refuses packing)."""
    assert micro.get("packed_seq_params") is None, "kto micro-batches are never packed (refused at config time)"
    out = dict(micro)
    for key in ROW_KEYS:
        if out.get(key) is not None:
            out[key] = out[key][start:stop]
    return out


class KTOObjective:
    """kto: roll.kto on (rows, then mismatched rows) micro-batches; see the module docstring.

    ``policy_chunks`` run the mismatched rows forward-only; ``ref_chunks`` the reference pass, inside
    ``ref_mode`` when given (LoRA: the policy's own chunks with the adapters disabled). Report: roll.kto.REPORT.
    """

    report_size = len(roll_kto.REPORT)
    rows_per_sample = 2
    """Rows of the batch per sample (the speed window's mean real tokens per row)."""

    def __init__(self, vocab_size: int, settings: roll_kto.KTOSettings, policy_chunks: list[torch.nn.Module],
                 ref_chunks: list[torch.nn.Module], ref_mode: Callable[[], ContextManager] | None = None) -> None:
        self.vocab_size, self.settings = vocab_size, settings
        self.policy_chunks, self.ref_chunks, self.ref_mode = policy_chunks, ref_chunks, ref_mode

    def prepare(self, micro: list[dict], seq_length: int) -> None:
        """Reference log-probs and the reference point of every micro-batch, attached to it on the last stage;
        every micro-batch cut to its ``B`` rows (on every stage: the pipeline sends one shape)."""
        from megatron.core import parallel_state as ps

        rows = micro[0]["input_ids"].shape[0] // 2
        mismatched = [take_rows(batch, rows, 2 * rows) for batch in micro]
        with torch.no_grad():
            with self.ref_mode() if self.ref_mode else contextlib.nullcontext():
                reference = run_schedule(self.ref_chunks, micro, self._log_probs_step, forward_only=True,
                                         seq_length=seq_length)
            policy = run_schedule(self.policy_chunks, mismatched, self._log_probs_step, forward_only=True,
                                  seq_length=seq_length)
        z = None
        if reference:  # the last stage; its data-parallel group is last-stage ranks only
            kl = torch.stack([report["logps"] for report in policy])
            ref_kl = torch.stack([report["logps"][rows:] for report in reference])
            valid = torch.stack([report["tokens"] > 0 for report in policy])
            z = roll_kto.kl_reference_points(kl, ref_kl, valid, ps.get_data_parallel_group())
        for index, batch in enumerate(micro):
            batch.update(take_rows(batch, 0, rows))
            if z is not None:
                batch["ref_logps"], batch["kto_kl"] = reference[index]["logps"][:rows], z[index]

    def _log_probs_step(self, data_iterator, model):
        inputs = dict(next(data_iterator))
        labels = inputs["labels"]
        output = model(**{key: value for key, value in inputs.items() if key not in LOSS_INPUTS})

        def loss_func(logits: torch.Tensor):
            logps, tokens = L.sequence_log_probs(logits, labels, self.vocab_size)
            zero = torch.zeros((), device=logits.device)
            return zero, torch.zeros((), dtype=torch.int), {"logps": logps, "tokens": tokens}

        return output, loss_func

    def loss_func(self, labels: torch.Tensor, micro: dict) -> Callable:
        ref_logps, z, desirable = micro.get("ref_logps"), micro.get("kto_kl"), micro["kto_tags"]

        def loss_func(logits: torch.Tensor):
            logps, tokens = L.sequence_log_probs(logits, labels, self.vocab_size)
            valid = tokens > 0
            losses, report = roll_kto.kto_losses(logps, ref_logps, desirable, valid, z, self.settings)
            return losses.sum().float(), valid.sum().to(torch.int), {REPORT: report}

        return loss_func

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return roll_kto.metrics(sums)
