"""MegatronTrainer: the training loop (pt, sft, dpo, rm) on Megatron-Core model chunks.

One optimizer step: this rank's micro-batches of the global batch (``data.BatchPlan``) go through
Megatron's schedule (``step.run_schedule``) with the objective's loss function (``step``: language
model or DPO); ``finalize_model_grads`` reduces the gradients and divides them by the global batch's
count (tokens or pairs); the optimizer steps with the learning rate of the schedule. A step whose loss
or gradient norm is not finite is skipped (no update) and counted (``roll.reliability``: too many in a row stop
the run). After every step all ranks agree whether one got SIGTERM / SIGINT; if so they save and stop.
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
from backends.mca.trainer.data import BatchPlan, collate_step, model_inputs, pad_to_length
from backends.mca.trainer.metrics import MetricsWriter, speed_meter
from backends.mca.trainer.optim import (LRSchedule, build_optimizer, clip_and_step, grad_norm_squared,
                                        install_hooks, schedule_for, sync_params, wrap_ddp)
from backends.mca.trainer.param_groups import apply_weight_decay
from backends.mca.trainer.step import REPORT, DPOObjective, LanguageModelObjective, run_schedule
from roll import reliability
from roll.contract import TrainResult
from roll.errors import Preempted
from roll.logging import log_rank0
from roll.perf import SpeedWindow, real_tokens
from roll.train_log import append_record

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One step's numbers, summed over the ranks that own them (see ``_step_numbers``)."""

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
                 objective=None) -> None:
        from megatron.core import parallel_state as ps

        self.training, self.layout, self.pad_token_id = training, layout, pad_token_id
        self.model_config = chunks[0].config
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
        self.plan = BatchPlan(training.per_device_train_batch_size, training.gradient_accumulation_steps,
                              ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
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
        window: list[StepStats] = []
        try:
            for chunk in self.chunks:
                chunk.train()
            if eval_dataset is not None and t.eval_on_start:
                self.evaluate(eval_dataset, collator, writer)
            while self.state.global_step < total:
                reliability.set_activity(f"training step {self.state.global_step + 1}")
                self._speed.begin(self.state.global_step)
                stats = self._train_step(dataset, collator, schedule)
                self._speed.add(stats.real_tokens, self._rows_in_step(self.state.global_step - 1,
                                                                      len(dataset)))
                self.skips.record(stats.skipped, self.state.global_step,
                                  self.plan.step_samples(self.state.global_step - 1, len(dataset)))
                window.append(stats)
                writer.step_done()
                if self._background is not None:
                    self._background.poll()  # publishes the pending checkpoint once every rank wrote it
                step = self.state.global_step
                if step % every(t.logging_steps, total) == 0 or step == total:
                    writer.log(step, self._log_record(window, len(dataset)))
                    window = []
                action = reliability.STOP.poll()
                if action is reliability.Action.STOP:
                    self._stop_on_signal(window, writer, len(dataset))
                if eval_dataset is not None and self._should_evaluate(step, total, len(dataset)):
                    self.evaluate(eval_dataset, collator, writer)
                if action is reliability.Action.SAVE or self._should_save(step, total, len(dataset)):
                    self._save()  # the early warning (slurm_signal) saves now and trains on
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

    def _stop_on_signal(self, window: list[StepStats], writer: MetricsWriter, num_samples: int) -> None:
        """Log the steps since the last log, save (``save_on_preemption``), raise ``Preempted``."""
        step = self.state.global_step
        if window:
            writer.log(step, self._log_record(window, num_samples))
            window.clear()
        where = "no checkpoint written (save_on_preemption is false)"
        if self.training.save_on_preemption:
            where = f"checkpoint written to {self._save()}; resume_from_checkpoint: true continues from it"
        self._finish_saves()
        raise Preempted(f"stopped by {reliability.STOP.name} after step {step}: {where}.")

    def _train_step(self, dataset, collator, schedule: LRSchedule) -> StepStats:
        indices = self.plan.micro_batch_indices(self.state.global_step, len(dataset))
        batches = collate_step(dataset, collator, indices, self.pad_token_id)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = schedule.apply(self.optimizer, self.state.global_step)
        outputs = self._forward_backward(batches, forward_only=False)
        metrics, real, grad_norm = self._step_numbers(outputs, batches)
        loss = metrics.pop("loss")
        moe = moe_losses(self.model_config, len(batches))
        # All-reduced, so every rank decides alike: a non-finite loss or grad norm, or fp16's grad scaler
        # found inf/nan (no norm), skips the update.
        skipped = grad_norm is None or not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not math.isfinite(loss):
            grad_norm = None  # not logged: the loss already says the step is lost
        if not skipped:
            skipped = not clip_and_step(self.optimizer, grad_norm)
        if skipped:
            self.state.skipped_steps += 1
        self.state.consumed_samples += self.plan.samples_in_step(self.state.global_step, len(dataset))
        self.state.global_step += 1
        # Logged as HF Trainer (transformers 5) logs it: the rate this step's update used, read before its
        # scheduler steps (Trainer._inner_training_loop, "get learning rate before update").
        return StepStats(loss, metrics, real, grad_norm, lr, skipped, moe)

    # ---- forward / backward ---------------------------------------------------------------------

    def _forward_backward(self, batches: list[dict], forward_only: bool) -> list[dict]:
        """Run the schedule over ``batches`` (this rank's micro-batches); the loss reports of the last stage."""
        if self.layout.pp > 1:  # the pipeline sends one activation shape per step
            length = max(batch["input_ids"].shape[-1] for batch in batches)
            batches = [pad_to_length(batch, length, self.pad_token_id) for batch in batches]
        moe = bool(self.model_config.num_moe_experts)
        micro = [model_inputs(batch, self.device, self.cp_size, self.cp_rank, moe=moe) for batch in batches]
        seq_length = micro[0]["input_ids"].shape[1] * self.cp_size
        self.objective.prepare(micro, seq_length)
        return run_schedule(self.chunks, micro, self._forward_step, forward_only=forward_only, seq_length=seq_length)

    def _forward_step(self, data_iterator, model):
        micro = next(data_iterator)  # every virtual stage reads the same micro-batch dicts: never mutate them
        output = model(**{key: value for key, value in micro.items() if key not in ("labels", "ref_logps")})
        return output, self.objective.loss_func(micro["labels"], micro)

    def _step_numbers(self, outputs: list[dict], batches: list[dict]) -> tuple[dict[str, float], int,
                                                                                float | None]:
        """(the objective's metrics over the global batch, real tokens, the global grad norm; None when fp16's
        grad scaler found inf/nan): one all-reduce of the reports, and the step's one host read, of the
        reports and the squared norm together (collective)."""
        sums = self._local_sums(outputs, batches)
        dist.all_reduce(sums)
        found_inf = self.optimizer.prepare_grads()  # fp16 only: the grad scaler reads its own inf check
        if not found_inf:
            sums = torch.cat([sums, grad_norm_squared(self.optimizer, self.device).to(sums)])
        values = sums.tolist()
        size = self.objective.report_size
        grad_norm = None if found_inf else values[size + 1] ** 0.5
        return self.objective.metrics(values[:size]), int(values[size]), grad_norm

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

    def _log_record(self, window: list[StepStats], num_samples: int) -> dict[str, float]:
        done = [s for s in window if not s.skipped] or window
        record = {"loss": sum(s.loss for s in done) / len(done)}
        for name in done[-1].metrics:
            record[name] = sum(s.metrics[name] for s in done) / len(done)
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
        per row (the attention term's sequence length); a DPO (or rm) pair is two rows."""
        rows = self.plan.samples_in_step(step, num_samples)
        pairwise = isinstance(self.objective, DPOObjective) or getattr(self.objective, "pairwise", False)
        return rows * 2 if pairwise else rows

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


def moe_losses(config, num_microbatches: int) -> dict[str, float]:
    """The MoE losses of the last step as Megatron tracks them (before their coefficients), each averaged over
    MoE layers, micro-batches and ranks: ``moe_aux_loss`` (load balancing, reduced by Megatron's own rule)
    and ``moe_z_loss`` (router z-loss, which Megatron tracks per rank: summed here over every rank, then
    divided by the ranks that hold the same layers); {} for dense models and losses that are off.
    Collective."""
    if not config.num_moe_experts:
        return {}
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker, reduce_aux_losses_tracker_across_ranks)

    tracker = get_moe_layer_wise_logging_tracker()
    freq = config.moe_layer_freq
    moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, config.num_layers, freq))
    out = {}
    if "load_balancing_loss" in tracker:  # moe_aux_loss_coeff 0: nothing computed
        reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
        values = tracker["load_balancing_loss"]["values"]
        out["moe_aux_loss"] = values.sum().item() / (moe_layers * num_microbatches)
    if "z_loss" in tracker:
        values = tracker["z_loss"]["values"]
        dist.all_reduce(values)
        ranks_per_layer = dist.get_world_size() // config.pipeline_model_parallel_size
        out["moe_z_loss"] = values.sum().item() / (moe_layers * num_microbatches * ranks_per_layer)
    clear_aux_losses_tracker()
    return out
