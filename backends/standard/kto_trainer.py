"""RollKTOTrainer: stage kto on the standard backend, with roll.kto's loss and metrics (the mca backend's).

It subclasses TRL 1.16's ``KTOTrainer`` for what TRL sets up around the loss, as ``RollDPOTrainer`` does: the
frozen reference (a second load prepared for DeepSpeed / accelerate; under LoRA without ``ref_model`` TRL's
frozen copy ``ref`` of the fresh adapter, which adds zero: the base model), dropout off in both models, its
evaluation plumbing. roll's rows come tokenized (``_prepare_dataset`` returns them as they are) and collated by
``roll.data.feedback.FeedbackCollator``: ``[2B, L]`` rows (the micro-batch, then its mismatched rows) and
``kto_tags [B]``.

The loss is ``roll.kto``'s on ``roll.loss``'s float64 response log-prob sums, as on the mca backend. TRL's own
``_compute_loss`` gives the same loss, reference point and rewards on one micro-batch
(tests/unit/test_kto.py); what differs is the metrics' reduction over a step's micro-batches: TRL logs a
mean of per-micro-batch means, roll (both backends) the step's sums over its counts (``roll.kto.metrics``),
each step's numbers then averaged over the steps since the last log. ``eval_loss`` is the mean over the eval
set's rows, as the mca backend computes it.
"""

from __future__ import annotations

import contextlib

import torch

from backends.standard.reliability import SafeCheckpointMixin, SafeStepMixin
from backends.standard._compat import kto_trainer_accepts_one_row
from backends.standard.trainers import RollTrainerMixin
from roll import kto as roll_kto
from roll import loss as roll_loss


def sequence_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's float64 response log-prob sum, its response tokens) by ``roll.loss`` from the model's logits
    (HF-aligned ``labels``: shifted once there)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    log_probs, mask = roll_loss.causal_log_probs(logits, labels)
    return roll_loss.sequence_sums(log_probs), mask.sum(-1)


def make_kto_trainer_class():
    """Build RollKTOTrainer lazily: importing trl costs seconds and pt/sft runs never need it."""
    from accelerate.utils import is_peft_model
    from trl import KTOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    class RollKTOTrainer(SafeCheckpointMixin, SafeStepMixin, RollTrainerMixin, KTOTrainer):
        """roll.kto's KTO on roll's kto batches (see the module docstring)."""

        def __init__(self, *args, **kwargs) -> None:
            hf_args = kwargs["args"]
            one_row = hf_args.per_device_train_batch_size < 2  # kto_mismatched_rows: llamafactory (roll.config)
            with kto_trainer_accepts_one_row(hf_args) if one_row else contextlib.nullcontext():
                super().__init__(*args, **kwargs)
            self.loss_type, self.calculate_KL = hf_args.loss_type, True
            self.roll_kto = roll_kto.KTOSettings(beta=self.args.beta, desirable_weight=self.args.desirable_weight,
                                                 undesirable_weight=self.args.undesirable_weight)
            self._roll_reports: dict[str, dict[int, torch.Tensor]] = {"train": {}, "eval": {}}
            """Per mode: step -> the sum of its micro-batches' roll.kto reports on this rank (eval: one entry)."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # roll.data tokenized it already; TRL's prompt/completion path does not apply

        @contextlib.contextmanager
        def _roll_reference(self):
            """The reference model, frozen: ``ref_model``, or under LoRA the policy through TRL's ``ref`` adapter
            (the adapters off when there is none)."""
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                if self.ref_model is not None:
                    yield self.ref_model
                    return
                assert is_peft_model(self.model), "TRL keeps a reference model unless the policy is a PEFT model"
                unwrapped = self.accelerator.unwrap_model(self.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    yield self.model

        def _compute_loss(self, model, inputs, return_outputs):
            rows = inputs["kto_tags"].shape[0]
            ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
            main, mismatched = (ids[:rows], mask[:rows], labels[:rows]), (ids[rows:], mask[rows:], labels[rows:])
            with torch.no_grad():
                kl_logps, kl_tokens = sequence_log_probs(model, *mismatched)
            logps, tokens = sequence_log_probs(model, *main)
            with self._roll_reference() as reference:
                ref_logps, _ = sequence_log_probs(reference, *main)
                ref_kl_logps, _ = sequence_log_probs(reference, *mismatched)
            group = torch.distributed.group.WORLD if self.args.world_size > 1 else None
            z = roll_kto.kl_reference_points(kl_logps[None], ref_kl_logps[None], (kl_tokens > 0)[None], group)[0]
            valid = tokens > 0
            losses, report = roll_kto.kto_losses(logps, ref_logps, inputs["kto_tags"], valid, z, self.roll_kto)
            self._roll_record(report)
            loss = (losses.sum() / valid.sum().clamp(min=1)).float()
            return (loss, None) if return_outputs else loss

        def _roll_record(self, report: torch.Tensor) -> None:
            mode = "train" if self.model.training else "eval"
            step = self.state.global_step if mode == "train" else 0  # every micro-batch of a step sees its number
            reports = self._roll_reports[mode]
            reports[step] = report if step not in reports else reports[step] + report

        def _roll_metrics(self, mode: str) -> dict[str, float]:
            """roll.kto's metrics of each recorded step, summed over ranks, averaged over the steps (a metric over
            the steps that have it); collective."""
            reports, self._roll_reports[mode] = self._roll_reports[mode], {}
            if not reports:
                return {}
            sums = torch.stack([reports[step] for step in sorted(reports)])
            if self.args.world_size > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            steps = [roll_kto.metrics(row) for row in sums.tolist()]
            names = dict.fromkeys(name for step in steps for name in step)
            return {name: sum(s[name] for s in steps if name in s) / sum(name in s for s in steps)
                    for name in names}

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if "loss" in logs and self.model.training:
                logs.update({k: v for k, v in self._roll_metrics("train").items() if k != "loss"})  # HF's loss stays
            super().log(logs, start_time)

        def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                            metric_key_prefix="eval"):
            self._roll_reports["eval"] = {}
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in self._roll_metrics("eval").items()})
            return output

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad(), self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs)
            return loss.detach(), None, None

    return RollKTOTrainer
