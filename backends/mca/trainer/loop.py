"""MegatronTrainer: the training loop (pt, sft, dpo, rm) on Megatron-Core model chunks.

One optimizer step: this rank's micro-batches of the global batch (``data.BatchPlan``) go through
Megatron's schedule (``step.run_schedule``) with the objective's loss function (``step``: language
model or DPO); ``finalize_model_grads`` reduces the gradients and divides them by the global batch's
count (tokens or pairs); the optimizer steps with the learning rate of the schedule. A step whose loss
or gradient norm is not finite is skipped (no update) and counted (``roll.reliability``: too many in a row stop
the run). A step's numbers stay on the device (``update.PendingStep``) until the loop logs, saves or stops:
then all pending steps are read at once (``_settle``), so with torch's fused Adam the steps between two logs
never wait for the device. After every step all ranks agree whether one got SIGTERM / SIGINT; if so they save
and stop.
With an eval set, ``eval_strategy`` / ``eval_steps`` / ``eval_delay`` / ``eval_on_start`` evaluate when HF
Trainer would (after the step's log, before its save), each record in train_log.jsonl at the same step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backends.mca.models.gpt import model_device
from backends.mca.trainer import checkpointing
from backends.mca.trainer.data import LOSS_INPUTS, BatchPlan, collate_step, model_inputs, pad_to_length
from roll.data.order import SampleOrder
from backends.mca.trainer.metrics import MetricsWriter, speed_meter
from backends.mca.trainer.optim import LRSchedule, build_optimizer, install_hooks, schedule_for, sync_params, wrap_ddp
from backends.mca.trainer.param_groups import apply_weight_decay
from backends.mca.trainer.step import REPORT, DPOObjective, LanguageModelObjective, run_schedule
from backends.mca.trainer.update import (SCALER_SKIPPED, SKIPPED, PendingStep, clip_and_step,
                                         clip_and_step_on_device, grad_norm_squared, moe_losses, read_pending,
                                         skips_on_device)
from backends.mca.vision import is_vision_language
from roll import reliability
from roll.contract import TrainResult
from roll.errors import Preempted
from roll.logging import log_rank0
from roll.perf import SpeedWindow, real_tokens
from roll.train_log import append_record

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One step's numbers on the host, summed over the ranks that own them (``_settle``)."""

    loss: float
    metrics: dict[str, float]
    """The objective's other metrics (DPO rewards, log-probs)."""
    real_tokens: int
    grad_norm: float | None
    learning_rate: float
    skipped: bool
    moe_losses: dict[str, float]
    """``moe_aux_loss`` / ``moe_z_loss`` of a MoE model (``moe_losses``), when computed."""


class MegatronTrainer:
    """Trains this rank's model chunks on the shared dataset with the recipe's HF keys.

    ``training`` is roll's TrainingArguments (batch sizes, optimizer, schedule, logging, saving);
    ``megatron_args`` the Megatron group (DDP / distributed optimizer settings); ``layout`` the
    validated ParallelLayout.
    """

    def __init__(self, chunks: list[torch.nn.Module], training, megatron_args, layout, pad_token_id: int,
                 objective=None, order: SampleOrder | None = None) -> None:
        from megatron.core import parallel_state as ps

        self.training, self.layout, self.pad_token_id = training, layout, pad_token_id
        self.model_config = chunks[0].config
        if self.model_config.num_moe_experts:  # Megatron's MoE loss tracker is process-wide and sized by the first
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            get_moe_layer_wise_logging_tracker().clear()  # model's layers: a later run of another depth (the
            # parity sweep trains many in one process) indexed past its end
        self.objective = objective or LanguageModelObjective(self.model_config.vocab_size)
        for model in (chunks, getattr(self.objective, "ref_chunks", None) or []):
            if len(model) > 1:
                # The interleaved schedule posts a forward and a backward transfer to the same peer in
                # one call (PP2 is a ring). Batched, both match in posting order and swap when their
                # shapes agree; unbatched, Megatron sends each direction on its own group (as
                # Megatron-LM's overlap_p2p_comm default does).
                model[0].config.batch_p2p_comm = False
        self.chunks = wrap_ddp(chunks, megatron_args, fp16=training.fp16, bf16=training.bf16)
        self.optimizer = build_optimizer(self.chunks, training, megatron_args)
        install_hooks(self.chunks, self.optimizer, megatron_args)
        if order is None:  # the recipe's data keys unknown here: HF's sampler with data_seed, else seed
            order = SampleOrder(training.data_seed if training.data_seed is not None else training.seed)
        self.plan = BatchPlan(training.per_device_train_batch_size, training.gradient_accumulation_steps,
                              ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), order=order)
        self.device = model_device()
        self.cp_size, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        # Ranks whose numbers enter the logged sums: the last pipeline stage, one TP rank (TP ranks
        # hold the same loss); real tokens are counted before the CP split, so on CP rank 0 only.
        self._owns_loss = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
        self._owns_tokens = self._owns_loss and self.cp_rank == 0
        self.skips = reliability.SkipCounter(training.max_consecutive_skipped_steps)
        self._train_dataset = None
        self.last_eval: tuple[int, dict[str, float]] | None = None
        """(step, metrics) of the latest evaluation."""
        self.state = checkpointing.TrainerState(global_batch_size=self.plan.global_batch_size,
                                                layout=self._layout_dict(),
                                                distributed_optimizer=megatron_args.use_distributed_optimizer,
                                                lora=getattr(chunks[0], "lora_spec", None) is not None)
        self._background = checkpointing.AsyncSaves() if training.save_async else None
        """``save_async``: the pending checkpoint write, polled after every step."""
        self._pending: list[PendingStep] = []
        """Steps whose numbers are still on the device (``_settle`` reads them)."""
        self._window: list[StepStats] = []
        """The steps since the last training record, on the host."""

    # ---- the loop -------------------------------------------------------------------------------

    def train(self, dataset, collator, resume_from: str | None = None, eval_dataset=None) -> TrainResult:
        """Train to the run's last step; with ``eval_dataset``, evaluate at the recipe's eval steps."""
        t = self.training
        self._train_dataset = dataset
        total = self.plan.total_steps(t.max_steps, t.num_train_epochs, len(dataset))
        schedule = schedule_for(t, total)
        if resume_from:
            self.state = checkpointing.load(resume_from, self.chunks, self.optimizer, self.state)
            apply_weight_decay(self.optimizer, t.weight_decay)  # the recipe's, not the checkpoint's groups
        log_rank0(logger, "training %d steps of %d samples (micro-batch %d x grad-accum %d x dp %d), %d samples in "
                  "the dataset", total, self.plan.global_batch_size, self.plan.micro_batch_size,
                  self.plan.grad_accum, self.plan.dp_size, len(dataset))
        writer = MetricsWriter(t.output_dir, total, initial_step=self.state.global_step, fresh=resume_from is None,
                               report_to=t.report_to)
        self._speed = SpeedWindow(speed_meter(self.model_config, t, self.device, dist.get_world_size()))
        try:
            for chunk in self.chunks:
                chunk.train()
            if eval_dataset is not None and t.eval_on_start:
                self.evaluate(eval_dataset, collator, writer)
            while self.state.global_step < total:
                reliability.set_activity(f"training step {self.state.global_step + 1}")
                self._speed.begin(self.state.global_step)
                self._pending.append(self._train_step(dataset, collator, schedule))
                writer.step_done()
                if self._background is not None:
                    self._background.poll()  # publishes the pending checkpoint once every rank wrote it
                step = self.state.global_step
                if step % every(t.logging_steps, total) == 0 or step == total:
                    self._settle()
                    writer.log(step, self._log_record(len(dataset)))
                action = reliability.STOP.poll()
                if action is reliability.Action.STOP:
                    self._stop_on_signal(writer, len(dataset))
                if eval_dataset is not None and self._should_evaluate(step, total, len(dataset)):
                    self.evaluate(eval_dataset, collator, writer)
                if action is reliability.Action.SAVE or self._should_save(step, total, len(dataset)):
                    self._save()  # the early warning (slurm_signal) saves now and trains on
            self._settle()  # nothing left: the last step logs
            self._finish_saves()
        finally:
            writer.close()
        sync_params(self.chunks)  # the final eval and the HF export read the last update's weights
        losses = [entry["loss"] for entry in writer.history if "loss" in entry]
        if losses:
            log_rank0(logger, "training loss: %.4f at the first log -> %.4f at the last (%d steps); logs in %s",
                      losses[0], losses[-1], self.state.global_step, writer.path)
        return TrainResult(log_history=writer.history, output_dir=t.output_dir,
                           metrics={"skipped_steps": self.state.skipped_steps})

    def _save(self) -> str:
        self._settle()  # the checkpoint keeps the skipped-step count
        reliability.set_activity(f"saving checkpoint-{self.state.global_step}")
        sync_params(self.chunks)
        return checkpointing.save(self.training.output_dir, self.chunks, self.optimizer, self.state,
                                  self.model_config, keep=self.training.save_total_limit,
                                  arguments=getattr(self, "arguments", None), dataset=self._train_dataset,
                                  background=self._background)

    def _finish_saves(self) -> None:
        """Publish the checkpoint still being written (``save_async``): at the end of training, before the
        export, and before a preempted run exits. Collective."""
        if self._background is not None:
            reliability.set_activity("finishing the checkpoint written in the background")
            self._background.wait()

    def _stop_on_signal(self, writer: MetricsWriter, num_samples: int) -> None:
        """Log the steps since the last log, save (``save_on_preemption``), raise ``Preempted``."""
        step = self.state.global_step
        self._settle()
        if self._window:
            writer.log(step, self._log_record(num_samples))
        where = "no checkpoint written (save_on_preemption is false)"
        if self.training.save_on_preemption:
            where = f"checkpoint written to {self._save()}; resume_from_checkpoint: true continues from it"
        self._finish_saves()
        raise Preempted(f"stopped by {reliability.STOP.name} after step {step}: {where}.")

    def _train_step(self, dataset, collator, schedule: LRSchedule) -> PendingStep:
        indices = self.plan.micro_batch_indices(self.state.global_step, len(dataset))
        batches = collate_step(dataset, collator, indices, self.pad_token_id)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = schedule.apply(self.optimizer, self.state.global_step)
        outputs = self._forward_backward(batches, forward_only=False)
        if self._background is not None:
            self._background.fence()  # a checkpoint's writer may still read the weights the update changes
        numbers = self._update(self._local_sums(outputs, batches))
        moe = moe_losses(self.model_config, len(batches))
        self.state.consumed_samples += self.plan.samples_in_step(self.state.global_step, len(dataset))
        self.state.global_step += 1
        # Logged as HF Trainer (transformers 5) logs it: the rate this step's update used, read before its
        # scheduler steps (Trainer._inner_training_loop, "get learning rate before update").
        return PendingStep(self.state.global_step, lr, numbers, moe)

    def _update(self, sums: torch.Tensor) -> torch.Tensor:
        """All-reduce this rank's report sums (collective), then clip and update unless the loss sum or the grad
        norm is not finite (all-reduced, so every rank decides alike), or fp16's grad scaler found inf/nan;
        ``PendingStep.numbers``."""
        dist.all_reduce(sums)
        if self.optimizer.prepare_grads():  # fp16 only: the grad scaler reads its own inf check
            return torch.cat([sums, sums.new_tensor([math.nan, SCALER_SKIPPED])])
        square = grad_norm_squared(self.optimizer, self.device).to(sums)
        if skips_on_device(self.optimizer):
            skipped = clip_and_step_on_device(self.optimizer, sums[0], square)
            return torch.cat([sums, square, skipped.reshape(1).to(sums)])
        loss_sum, norm_square = torch.cat([sums[:1], square]).tolist()  # the step's host read
        stepped = (math.isfinite(loss_sum) and math.isfinite(norm_square)
                   and clip_and_step(self.optimizer, norm_square ** 0.5))
        return torch.cat([sums, square, sums.new_tensor([0.0 if stepped else SKIPPED])])

    def _settle(self) -> None:
        """Read the pending steps' numbers (one host read, no collective) into ``_window``: the speed window's
        tokens, the skipped-step count, ``max_consecutive_skipped_steps`` (``Diverged`` names the step that
        reached it; the steps run since then made no checkpoint and no record)."""
        pending, self._pending = self._pending, []
        num_samples, size = len(self._train_dataset), self.objective.report_size
        for entry, (values, moe) in zip(pending, read_pending(pending)):
            metrics = self.objective.metrics(values[:size])
            loss, skipped, square = metrics.pop("loss"), values[size + 2], values[size + 1]
            # Not logged: fp16's scaler computed none; a non-finite loss already says the step is lost.
            grad_norm = None if skipped == SCALER_SKIPPED or not math.isfinite(loss) else square ** 0.5
            if skipped:
                self.state.skipped_steps += 1
            real = int(values[size])
            self._speed.add(real, self._rows_in_step(entry.step - 1, num_samples))
            self.skips.record(bool(skipped), entry.step, self.plan.step_rows(entry.step - 1, num_samples))
            self._window.append(StepStats(loss, metrics, real, grad_norm, entry.learning_rate, bool(skipped), moe))

    # ---- forward / backward ---------------------------------------------------------------------

    def _forward_backward(self, batches: list[dict], forward_only: bool) -> list[dict]:
        """Run the schedule over ``batches`` (this rank's micro-batches); the loss reports of the last stage."""
        if self.layout.pp > 1:  # the pipeline sends one activation shape per step
            length = max(batch["input_ids"].shape[-1] for batch in batches)
            batches = [pad_to_length(batch, length, self.pad_token_id) for batch in batches]
        moe = bool(self.model_config.num_moe_experts)
        vision = self.model_config.hf_config if is_vision_language(self.model_config.hf_config) else None
        micro = [model_inputs(batch, self.device, self.cp_size, self.cp_rank, moe=moe, vision=vision)
                 for batch in batches]
        seq_length = micro[0]["input_ids"].shape[1] * self.cp_size
        self.objective.prepare(micro, seq_length)
        return run_schedule(self.chunks, micro, self._forward_step, forward_only=forward_only, seq_length=seq_length)

    def _forward_step(self, data_iterator, model):
        micro = next(data_iterator)  # every virtual stage reads the same micro-batch dicts: never mutate them
        output = model(**{key: value for key, value in micro.items() if key not in LOSS_INPUTS})
        return output, self.objective.loss_func(micro["labels"], micro)

    def _local_sums(self, outputs: list[dict], batches: list[dict]) -> torch.Tensor:
        """This rank's share of the loss reports (summed over micro-batches) and of the real tokens."""
        size = self.objective.report_size
        sums = torch.zeros(size + 1, dtype=torch.float64, device=self.device)
        if self._owns_loss:
            for out in outputs:
                sums[:size] += out[REPORT].to(sums)
        if self._owns_tokens:
            sums[size] = sum(real_tokens(batch, self.pad_token_id) for batch in batches)
        return sums

    def _metrics(self, sums: torch.Tensor) -> tuple[dict[str, float], int]:
        """All-reduce ``_local_sums`` (collective) into (the objective's metrics, real tokens)."""
        dist.all_reduce(sums)
        values = sums.tolist()
        size = self.objective.report_size
        return self.objective.metrics(values[:size]), int(values[size])

    # ---- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, dataset, collator, writer: MetricsWriter | None = None) -> dict[str, float]:
        """``eval_loss`` (the training loss definition over the whole eval set: the per-token mean for pt
        and sft, the mean over pairs for dpo, with dpo's eval rewards and log-probs), logged at the current
        step: through ``writer`` during training (history, TensorBoard), else appended to train_log.jsonl."""
        reliability.set_activity(f"evaluating at step {self.state.global_step}")
        plan = self._eval_plan(len(dataset))
        sync_params(self.chunks)
        sums = None
        for chunk in self.chunks:
            chunk.eval()
        for call in range(math.ceil(len(dataset) / plan.global_batch_size)):
            batches = collate_step(dataset, collator, plan.micro_batch_indices(call, len(dataset)), self.pad_token_id)
            part = self._local_sums(self._forward_backward(batches, forward_only=True), batches)
            sums = part if sums is None else sums + part
        for chunk in self.chunks:
            chunk.train()
        metrics = {f"eval_{name}": value for name, value in self._metrics(sums)[0].items()}
        log_rank0(logger, "eval_loss %.4f over %d samples at step %d", metrics["eval_loss"], len(dataset),
                  self.state.global_step)
        if writer is not None:
            writer.log(self.state.global_step, metrics)
        else:
            append_record(self.training.output_dir, self.state.global_step, metrics)
        self.last_eval = (self.state.global_step, metrics)
        return metrics

    def _eval_plan(self, num_samples: int) -> BatchPlan:
        """One pass over the eval set in schedule calls of at most ``max(gradient_accumulation_steps, 8)``
        micro-batches of ``per_device_eval_batch_size`` rows (the inputs on the device stay bounded), a count
        the interleaved schedule accepts (``micro_batches_at_least``); slots past the end are fillers that
        count nothing."""
        mbs = self.training.per_device_eval_batch_size
        rounds = math.ceil(num_samples / (mbs * self.plan.dp_size))
        per_call = self.layout.micro_batches_at_least(min(rounds, max(self.plan.grad_accum, 8)))
        return BatchPlan(mbs, per_call, self.plan.dp_size, self.plan.dp_rank)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _log_record(self, num_samples: int) -> dict[str, float]:
        """The training record of ``_window`` (settled), which starts anew."""
        window, self._window = self._window, []
        done = [s for s in window if not s.skipped] or window
        record = {"loss": sum(s.loss for s in done) / len(done)}
        for name in dict.fromkeys(name for s in done for name in s.metrics):  # kto: a class a step lacks
            values = [s.metrics[name] for s in done if name in s.metrics]
            record[name] = sum(values) / len(values)
        if window[-1].grad_norm is not None:
            record["grad_norm"] = window[-1].grad_norm
        record["learning_rate"] = window[-1].learning_rate
        record.update(self._speed.close(self.state.global_step))
        record["epoch"] = round(self.state.global_step / self.plan.steps_per_epoch(num_samples), 4)
        for name in ("moe_aux_loss", "moe_z_loss"):
            values = [s.moe_losses[name] for s in window if name in s.moe_losses]
            if values:
                record[name] = sum(values) / len(values)
        if self.state.skipped_steps:
            record["skipped_steps"] = self.state.skipped_steps
        return record

    def _rows_in_step(self, step: int, num_samples: int) -> int:
        """Rows of global step ``step`` (0-based) over all ranks, for the speed window's mean real tokens
        per row (the attention term's sequence length); a DPO or rm pair is two rows, a KTO row two (its
        mismatched row)."""
        rows = self.plan.samples_in_step(step, num_samples)
        per_sample = 2 if isinstance(self.objective, DPOObjective) else getattr(self.objective, "rows_per_sample", 1)
        return rows * per_sample

    def _should_save(self, step: int, total: int, num_samples: int) -> bool:
        t = self.training
        return self._interval_due(t.save_strategy, t.save_steps, step, total, num_samples)

    def _should_evaluate(self, step: int, total: int, num_samples: int) -> bool:
        """HF Trainer's rule (DefaultFlowCallback): every ``eval_steps`` (HF's default: ``logging_steps``)
        or epoch, and at the last step, once ``eval_delay`` (steps, or epochs with ``epoch``) has passed."""
        t = self.training
        steps = t.eval_steps or t.logging_steps
        if not self._interval_due(t.eval_strategy, steps, step, total, num_samples):
            return False
        epochs = _strategy(t.eval_strategy) == "epoch"
        return (t.eval_delay or 0) <= (step / self.plan.steps_per_epoch(num_samples) if epochs else step)

    def _interval_due(self, strategy, steps: float, step: int, total: int, num_samples: int) -> bool:
        """Whether a ``*_strategy`` of ``steps`` / ``epoch`` is due after ``step`` (always at the last)."""
        if _strategy(strategy) == "steps":
            return step % every(steps, total) == 0 or step == total
        if _strategy(strategy) == "epoch":
            return step % self.plan.steps_per_epoch(num_samples) == 0 or step == total
        return False

    def _layout_dict(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp_size, "cp": lay.cp, "ep": lay.ep, "etp": lay.expert_tp,
                "dp": lay.dp}


def _strategy(value) -> str:
    """An HF ``IntervalStrategy`` / ``SaveStrategy`` (or its string) as its name: "no", "steps", "epoch"."""
    return str(getattr(value, "value", value))


def every(steps: float, total: int) -> int:
    """An HF ``*_steps`` interval: a step count, or below 1 a ratio of the run (at least 1 step)."""
    return max(1, int(steps) if steps >= 1 else math.ceil(total * steps))
