"""Trainer subclasses: HF Trainer for pt/sft, TRL's DPOTrainer for dpo, fed by roll's data pipeline.

What they add to HF/TRL, and why:

* **Sample order** (DESIGN.md §3). The trainers draw the epoch's rows through ``roll.data.order``'s
  ``EpochSampler``, the permutation accelerate's seedable sampler gives HF's Trainer (``data_seed`` else
  ``seed``, plus the epoch), which the mca loop reads too. accelerate hands micro-batch ``j`` of every rank
  ``r`` batch ``j * world + r``, so global step ``k`` consumes exactly the permutation's positions
  ``[k*B, (k+1)*B)`` with ``B = micro_batch * grad_accum * world``.
* **Loss** (DESIGN.md §1). pt/sft: HF counts the trainable tokens of all micro-batches of a step
  (``num_items_in_batch``, over ``labels[..., 1:]``) and gathers the count over ranks
  (``average_tokens_across_devices``); roll's ``compute_loss_func`` (``TokenMeanLossMixin``) divides the
  token-loss *sum* by it, so the step loss is the per-token mean over the global batch. The token losses
  are roll.loss's, as on the mca backend (the model's own ``F.cross_entropy`` is bypassed), and the logged
  ``loss`` is that mean as optimised, accumulated in float64. dpo: TRL's per-pair mean of the
  micro-batch, divided by grad_accum and averaged over ranks: the mean over pairs of the global
  batch (micro-batches are equal-sized).
* **Eval loss** (pt/sft): ``eval_loss`` is the per-token mean over the whole eval set (the token losses'
  sum over the trainable-token count), as the mca backend computes it, whatever the eval batch size; HF's
  own is a mean of per-batch means. dpo keeps TRL's: the mean over pairs.
* **Speed**: every training log carries roll.perf's ``step_time``, ``tokens_per_second`` (real, non-pad
  tokens only), ``mfu`` and ``peak_memory_gb``, as the mca backend's do; one that cannot be computed
  for a model is ``null`` in train_log.jsonl, with one warning, and never stops the run.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINING_ARGS_NAME

from backends.standard.reliability import SafeCheckpointMixin, SafeStepMixin
from roll import IGNORE_INDEX, redact
from roll import loss as roll_loss
from roll.config.finetuning import REFERENCE_FREE_LOSSES
from roll.data.order import EpochSampler, SampleOrder
from roll.perf import SpeedMeter, SpeedWindow, logged_only, real_tokens, training_dtype
from roll.train_log import append_record, start_train_log, train_log_path

_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def epoch_reaches_sampler(loader):
    """``loader`` (accelerate's ``DataLoaderShard``) with its ``EpochSampler`` installed as accelerate installs its
    own seedable sampler (``set_sampler``), so ``set_epoch`` reaches it also through the ``SkipBatchSampler``
    that ``skip_first_batches`` wraps around the data-parallel ``BatchSamplerShard`` on a resume (without it, a
    run resumed in epoch 1 or later on several ranks read epoch 0's order)."""
    batches = getattr(loader, "batch_sampler", None)  # BatchSampler, or BatchSamplerShard around one
    sampler = getattr(batches, "sampler", None) or getattr(getattr(batches, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, EpochSampler) and hasattr(loader, "set_sampler"):
        loader.set_sampler(sampler)
    return loader


class RollTrainerMixin:
    """The shared sample order and speed metrics; mixed in before HF/TRL's trainer."""

    roll_order: SampleOrder | None = None
    """Set by the backend from the recipe; without it (a trainer built by hand) HF's own seed and no
    shuffle option: ``SampleOrder(data_seed or seed)``."""

    def roll_sample_order(self) -> SampleOrder:
        if self.roll_order is not None:
            return self.roll_order
        return SampleOrder(self.args.data_seed if self.args.data_seed is not None else self.args.seed)

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return EpochSampler(len(dataset), self.roll_sample_order())

    def get_train_dataloader(self):
        return epoch_reaches_sampler(super().get_train_dataloader())

    def training_step(self, model, inputs, num_items_in_batch=None):
        pad_id = getattr(getattr(self, "processing_class", None), "pad_token_id", None)
        # Kept a tensor until the next log: reading it every micro-step would wait for the GPU each time.
        tokens = logged_only("tokens_per_second", "the batch's real (non-pad) tokens",
                             lambda: real_tokens(inputs, pad_id))
        ids = inputs.get("input_ids")
        self._roll_window.begin(self.state.global_step)
        self._roll_window.add(tokens, ids.shape[0] if isinstance(ids, torch.Tensor) else 0)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.model.training:
            # A field that could not be computed is left out here (HF's reporters warn on every None they
            # get) and written as null by JsonlLogCallback.
            logs.update({k: v for k, v in self._throughput().items() if v is not None})
        super().log(logs, start_time)

    def _throughput(self) -> dict[str, float]:
        """roll.perf's speed fields since the last log: real tokens summed over ranks; the attention
        term's sequence length is the mean real tokens per row (a collective: every rank logs)."""
        return self._roll_window.close(self.state.global_step, over_ranks=self._sum_over_ranks)

    def _sum_over_ranks(self, tokens, rows: int) -> tuple[int, int]:
        counts = torch.stack([torch.as_tensor(value, dtype=torch.int64, device=self.args.device)
                              for value in (tokens, rows)])
        if self.args.world_size > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        tokens, rows = counts.tolist()
        return tokens, rows

    def _save(self, output_dir: str | None = None, state_dict=None):
        """HF ends this with a pickle of its TrainingArguments (hub_token included) in
        ``training_args.bin``, in output_dir and every checkpoint; roll writes ``training_args.json`` there
        instead (roll's arguments, secrets redacted: ``roll.redact``). Secrets are blanked while HF saves, so
        none reaches the disk."""
        secrets = {name: value for name, value in vars(self.args).items() if redact.is_secret(name) and value}
        for name in secrets:
            setattr(self.args, name, None)
        try:
            super()._save(output_dir, state_dict)
        finally:
            for name, value in secrets.items():
                setattr(self.args, name, value)
        if self.args.should_save:
            folder = output_dir if output_dir is not None else self.args.output_dir
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, TRAINING_ARGS_NAME))
            redact.save_arguments(getattr(self, "roll_arguments", None) or self.args.to_dict(), folder)

    def train(self, *args, **kwargs):
        self._roll_window = SpeedWindow(SpeedMeter(self._roll_flops_config(), self.args.world_size,
                                                   self.args.device, training_dtype(self.args.bf16, self.args.fp16)))
        return super().train(*args, **kwargs)

    def _roll_flops_config(self):
        """The config roll.perf counts the model's FLOPs from (a reward model's is its own: a 1-wide head)."""
        return self.model.config


class JsonlLogCallback(TrainerCallback):
    """Rank 0 appends each log to OUTPUT_DIR/train_log.jsonl (``roll.train_log``; a resumed run appends)."""

    def __init__(self, output_dir: str, *, fresh: bool) -> None:
        self.output_dir = output_dir
        self.path = train_log_path(output_dir)
        self.fresh = fresh

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            start_train_log(self.output_dir, fresh=self.fresh)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            append_record(self.output_dir, state.global_step, logs)


class TokenMeanEvalMixin:
    """``eval_loss`` as the per-token mean over the eval set: every eval batch's per-row (loss sum, trainable
    tokens) pairs are gathered over ranks (accelerate's ``gather_for_metrics`` drops the rows it repeated
    to even out the last batch) and summed; the loop's metric is replaced by sum / count at its end."""

    _roll_eval_sums: torch.Tensor | None = None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._roll_eval_sums = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            loss_sum, tokens = self._roll_eval_sums.tolist()
        finally:
            self._roll_eval_sums = None
        key = f"{metric_key_prefix}_loss"
        if key in output.metrics and tokens > 0:
            output.metrics[key] = loss_sum / tokens
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self._roll_eval_sums is None or not prediction_loss_only or inputs.get("labels") is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**{key: value for key, value in inputs.items() if key != "labels"})
        rows = token_loss_rows(outputs.logits, inputs["labels"])
        self._roll_eval_sums += self.accelerator.gather_for_metrics(rows).sum(dim=0)
        loss_sum, tokens = rows.sum(dim=0)
        return (loss_sum / tokens.clamp(min=1)).float(), None, None


def token_loss_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[rows, 2] float64: each row's summed causal-LM token loss (roll.loss; labels shifted once, as HF's
    loss shifts them) and its number of trainable tokens (labels other than -100)."""
    log_probs, mask = roll_loss.causal_log_probs(logits, labels)
    return torch.stack([-log_probs.double().sum(dim=-1), mask.sum(dim=-1).double()], dim=-1)


class TokenMeanLossMixin:
    """The pt/sft training loss by roll.loss (``compute_loss_func``: HF then leaves labels out of the model
    call, so the model computes no loss of its own), and ``loss`` logged as that float64 number.

    Each micro-batch returns its token-loss sum over the step's global token count (``num_items_in_batch``);
    HF's logged loss adds those up in float32, so roll keeps a float64 sum beside it and logs that: the mean
    of the step losses since the last log, summed over ranks.

    MoE models (``moe_aux_coeff`` or ``moe_z_coeff`` > 0, the model returning its router logits): each
    training micro-batch adds ``(aux_coeff * aux + z_coeff * z) * T`` to its token-loss sum (``aux``:
    ``roll.loss.load_balancing_loss``, ``z``: ``roll.loss.router_z_loss``, ``T`` its tokens: non-padding
    positions that predict a label), as Megatron-Core does with a per-token loss; ``loss`` is logged without
    them, and ``moe_aux_loss`` / ``moe_z_loss`` beside it (before their coefficients, per layer, averaged over
    the micro-batches), as on the mca backend (docs/mca-training.md)."""

    _roll_loss: torch.Tensor | None = None
    _roll_loss_from_step = 0
    moe_aux_coeff = 0.0
    """The load-balancing loss coefficient (the standard backend sets it for MoE models)."""
    moe_z_coeff = 0.0
    """The router z-loss coefficient (the standard backend sets it for MoE models)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compute_loss_func = self._token_mean_loss
        self._roll_attention_mask = None
        self._roll_moe_logs: dict[str, list] = {}
        """Logged MoE loss name -> [sum over micro-batches since the last log, micro-batches]."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if (self.moe_aux_coeff or self.moe_z_coeff) and model.training:  # a forward argument: the saved
            inputs = {**inputs, "output_router_logits": True}              # config stays the model's
        self._roll_attention_mask = inputs.get("attention_mask")  # which tokens the MoE losses count
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _token_mean_loss(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        loss_sum, tokens = roll_loss.causal_lm_loss_sum(outputs.logits, labels)
        count = tokens.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        if self.model.training:
            self._roll_loss = (loss_sum / count).detach() + (0 if self._roll_loss is None else self._roll_loss)
            loss_sum = loss_sum + self._moe_loss_sum(outputs, labels.shape)
        return (loss_sum / count).float()

    def _moe_loss_sum(self, outputs, shape: torch.Size) -> torch.Tensor | float:
        """``(aux_coeff * aux + z_coeff * z) * T`` over the positions that predict a label (all but each row's
        last, the positions the mca backend's shifted batch holds), padding excluded; 0 for a dense model."""
        router_logits = getattr(outputs, "router_logits", None)
        if not (self.moe_aux_coeff or self.moe_z_coeff) or not router_logits:
            return 0.0
        rows, length = shape
        mask = self._roll_attention_mask
        valid = (mask if mask is not None else torch.ones(shape, device=outputs.logits.device))[:, :-1]
        valid = valid.reshape(-1).to(torch.float32)
        layers = [logits.reshape(rows, length, -1)[:, :-1].reshape(valid.shape[0], -1) for logits in router_logits]
        top_k = self.model.config.get_text_config().num_experts_per_tok
        total = 0.0
        for name, coeff, loss in (
            ("moe_aux_loss", self.moe_aux_coeff, lambda: roll_loss.load_balancing_loss(layers, top_k, valid)),
            ("moe_z_loss", self.moe_z_coeff, lambda: roll_loss.router_z_loss(layers, valid))):
            if coeff:
                value = loss()
                logged = self._roll_moe_logs.setdefault(name, [0.0, 0])
                logged[0], logged[1] = logged[0] + value.detach() / len(layers), logged[1] + 1
                total = total + coeff * value
        return total * valid.sum()

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        self._roll_loss_from_step = self._globalstep_last_logged  # HF moves it on before it calls log()
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.model.training and self._roll_loss is not None:
            total = self._roll_loss
            if self.args.world_size > 1:
                total = self.accelerator.reduce(total, reduction="sum")
            steps = max(self.state.global_step - self._roll_loss_from_step, 1)
            value = total.item() / steps
            if math.isfinite(value):  # else HF's own (its logging_nan_inf_filter)
                logs["loss"] = value
            self._roll_loss = None
            logs.update(self._moe_logs())
        super().log(logs, start_time)

    def _moe_logs(self) -> dict[str, float]:
        """``moe_aux_loss`` / ``moe_z_loss`` since the last log: the mean over every rank's micro-batches."""
        out = {}
        for name, (total, count) in self._roll_moe_logs.items():
            sums = torch.tensor([float(total), float(count)], dtype=torch.float64, device=self.args.device)
            if self.args.world_size > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            out[name] = (sums[0] / sums[1].clamp(min=1)).item()
        self._roll_moe_logs = {}
        return out


class RollTrainer(SafeCheckpointMixin, SafeStepMixin, TokenMeanLossMixin, TokenMeanEvalMixin, RollTrainerMixin,
                  Trainer):
    """HF Trainer for pt and sft: roll.loss's causal-LM loss over HF's global token count
    (``TokenMeanLossMixin``); eval_loss per token over the eval set (``TokenMeanEvalMixin``)."""


@dataclass
class PreferenceBatch:
    """Turns roll's pairwise batch into the batch TRL's DPO loss reads.

    roll's PairwiseCollator gives ``input_ids/attention_mask/labels`` of shape [2B, L], chosen rows
    before rejected; TRL wants the same rows with ``completion_mask`` instead of labels. A token is
    part of the completion exactly when roll supervises it, so ``completion_mask = labels != -100``.
    Precomputed reference log-probs (``ref_*_logps`` columns) are passed through as tensors.

    Example (``PreferenceBatch(PairwiseCollator(pad_token_id=0))``)::

        [{"chosen_input_ids": [5, 6, 7], "chosen_attention_mask": [1, 1, 1], "chosen_labels": [-100, 6, 7],
          "rejected_input_ids": [5, 8], "rejected_attention_mask": [1, 1], "rejected_labels": [-100, 8],
          "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0}]
        -> {"input_ids": [[5, 6, 7], [5, 8, 0]], "attention_mask": [[1, 1, 1], [1, 1, 0]],
            "completion_mask": [[0, 1, 1], [0, 1, 0]],
            "ref_chosen_logps": [-1.5], "ref_rejected_logps": [-2.0]}
    """

    collator: Callable[[list[dict]], dict]

    def __call__(self, features: list[dict]) -> dict[str, Any]:
        ref = {key: [f[key] for f in features] for key in _REF_KEYS if key in features[0]}
        rows = [{k: v for k, v in f.items() if k not in _REF_KEYS} for f in features]
        batch = dict(self.collator(rows))
        labels = batch.pop("labels")
        batch["completion_mask"] = (labels != IGNORE_INDEX).long()
        for key, values in ref.items():
            batch[key] = torch.tensor(values, dtype=torch.float32)
        return batch


def make_dpo_trainer_class():
    """Build RollDPOTrainer lazily: importing trl costs seconds and pt/sft runs never need it."""
    from trl import DPOTrainer

    class RollDPOTrainer(SafeCheckpointMixin, SafeStepMixin, RollTrainerMixin, DPOTrainer):
        """TRL's DPO loss and metrics on roll's tokenized pairwise rows (TRL does not re-tokenize).

        ``ref_free``: reference log-probs are 0 (TRL has no reference-free switch in 1.16; use its
        own once it has one), which we get by declaring them precomputed (hf_args sets
        ``precompute_ref_log_probs`` for ref_free only) and filling the columns with zeros.

        Policy and reference log-probs are roll.loss's (``dpo_logps``), as on the mca backend. ``pref_ftx``
        adds its SFT term (``roll.loss.chosen_sft_losses``) to TRL's loss: TRL's loss is the micro-batch's mean
        over pairs, so adding the term's mean over the same pairs adds it to every pair's loss.

        pref_loss orpo and simpo (TRL's DPO has neither) take their loss from ``reference_free.py`` instead.
        """

        def __init__(self, *args, pref_ftx: float = 0.0, simpo_gamma: float | None = None, **kwargs) -> None:
            from accelerate.utils import is_peft_model

            from backends.standard.dpo_logps import use_roll_log_probs

            super().__init__(*args, **kwargs)  # TRL patches the model it names here (the base model under PEFT)
            self._roll_pref_ftx, self._roll_policy_calls, self._roll_simpo_gamma = pref_ftx, [], simpo_gamma
            self._roll_reference_free = self.loss_types[0] in REFERENCE_FREE_LOSSES
            use_roll_log_probs(self.model.get_base_model() if is_peft_model(self.model) else self.model,
                               record=self._roll_policy_calls if pref_ftx and not self._roll_reference_free else None)
            if self.ref_model is not None:  # TRL patched the model before DeepSpeed / accelerate wrapped it
                use_roll_log_probs(self.accelerator.unwrap_model(self.ref_model))

        def _compute_loss(self, model, inputs, return_outputs):
            if self._roll_reference_free:
                from backends.standard.reference_free import reference_free_loss

                return reference_free_loss(self, model, inputs, return_outputs, gamma=self._roll_simpo_gamma,
                                           ftx=self._roll_pref_ftx)
            self._roll_policy_calls.clear()
            result = super()._compute_loss(model, inputs, return_outputs)
            if not self._roll_pref_ftx:
                return result
            log_probs, mask = self._roll_policy_calls[0]  # the policy's call: TRL runs it before the reference's
            self._roll_policy_calls.clear()
            chosen_log_probs, chosen_mask = log_probs.chunk(2)[0], mask.chunk(2)[0]  # rows: chosen, then rejected
            sft = roll_loss.chosen_sft_losses(roll_loss.sequence_sums(chosen_log_probs), chosen_mask.sum(-1))
            extra = self._roll_pref_ftx * sft.mean()
            return (result[0] + extra, *result[1:]) if return_outputs else result + extra

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # roll.data tokenized it already; TRL's prompt/chosen/rejected path does not apply

        def _precompute_ref_logps(self, dataset, name, batch_size):
            zeros = [0.0] * len(dataset)
            return dataset.add_column(_REF_KEYS[0], zeros).add_column(_REF_KEYS[1], zeros)

    return RollDPOTrainer
