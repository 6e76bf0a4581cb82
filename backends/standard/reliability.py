"""HF Trainer additions for runs that go wrong (the policy itself is ``roll.reliability``).

- ``SafeStepMixin``: a step whose loss (any micro-batch, any rank) or gradient norm is not finite makes
  no update: the gradients are dropped (``set_to_none``), so the optimizer skips every parameter. Under
  DeepSpeed the engine steps inside the last backward; ZeRO stages 1-3 skip a non-finite step
  themselves (fp32 and fp16; HF then logs an inf grad norm), and roll counts it.
- ``SafeCheckpointMixin``: ``checkpoint-N`` is written as ``checkpoint-N.tmp/checkpoint-N`` by HF (and
  DeepSpeed), flushed on every rank and renamed into place by rank 0 (``roll.checkpoints.publishing``);
  with ``save_async`` the weights and optimizer state are written by a thread from a host copy and the
  checkpoint is published after a later step (``roll.background_save``).
- ``ReliabilityCallback``: counts skipped steps (``max_consecutive_skipped_steps`` in a row raise
  ``Diverged``) and, after every step, asks all ranks whether one got SIGTERM / SIGINT; then HF saves
  (``save_on_preemption``) and stops, and the backend raises ``Preempted``. The early warning
  (``slurm_signal``) makes HF save after the step.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import warnings
from collections.abc import Callable

import torch
from transformers import TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from backends.standard.checkpoint_files import save_direct, write_weights
from roll import checkpoints, reliability, resume_record
from roll.background_save import BackgroundSaves, host_copy
from roll.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)


class SafeStepMixin:
    """Skip the update of a step with a non-finite loss or gradient norm (mixed in before HF's Trainer)."""

    _roll_bad_loss = False
    roll_step_skipped = False
    roll_skipped_total = 0
    """Set by ``ReliabilityCallback``; logged as ``skipped_steps`` once non-zero (as the mca backend does)."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.roll_skipped_total:
            logs["skipped_steps"] = self.roll_skipped_total
        super().log(logs, start_time)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # kept as a tensor: a .item() per micro-batch would wait for the GPU each time
        self._roll_bad_loss = self._roll_bad_loss | ~torch.isfinite(loss.detach()).all()
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        bad_loss = bool(self._roll_bad_loss)
        self._roll_bad_loss = False
        value = float(grad_norm) if grad_norm is not None else 0.0
        self.roll_step_skipped = reliability.any_rank(bad_loss or not math.isfinite(value))
        if self.roll_step_skipped:
            model.zero_grad(set_to_none=True)  # the optimizer skips parameters without a gradient
        return grad_norm


class SafeCheckpointMixin:
    """Write ``checkpoint-N`` under a temporary name and publish it once every rank finished; with
    ``roll_saves`` (``save_async``) the weights and optimizer state are written by a thread
    (``roll.background_save``) while training goes on: tensors on an accelerator from a host copy, tensors in
    host memory (a CPU run) as they are, the optimizer's next step waiting until the thread has read them
    (``BackgroundSaves.fence``, a step pre-hook on the torch optimizer)."""

    _roll_staging: str | None = None
    _roll_deferred: list[Callable[[], None]] | None = None
    """While a background save is being prepared: the writes its thread will do."""
    _roll_live = False
    """While a background save is being prepared: its writes may read host tensors as they are (fenced)."""
    _roll_kept = False
    """... and some do: the optimizer's next step must wait for the writer."""
    _roll_fenced = None
    """The torch optimizer whose steps wait for the background writer (its pre-hook is registered once)."""
    roll_saves: BackgroundSaves | None = None
    """Set by the backend when ``save_async`` is on."""
    roll_dataset = None
    roll_dataset_spec: str | None = None
    """The router's training set and the recipe's ``dataset``, recorded in each checkpoint
    (``roll.resume_record``; TRL may have prepared ``train_dataset`` further)."""

    def _get_output_dir(self, trial):
        return self._roll_staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir, step, args = super()._get_output_dir(trial), self.state.global_step, self.args
        reliability.set_activity(f"saving checkpoint-{step}")
        # should_save: global rank 0 (or every node's local 0 with save_on_each_node)
        if not self._roll_saves_in_background():
            with checkpoints.publishing(run_dir, step, is_writer=args.should_save, keep=args.save_total_limit,
                                        nested=True) as staging:
                self._roll_write_checkpoint(model, trial, staging)
            return
        started = time.perf_counter()
        self.roll_saves.wait()  # one host copy at a time
        staging = checkpoints.open_staging(run_dir, step, is_writer=args.should_save)
        self._roll_deferred, self._roll_live, self._roll_kept = [], self._roll_fence_optimizer(), False
        try:
            self._roll_write_checkpoint(model, trial, staging)
            writes, live = self._roll_deferred, self._roll_kept
        finally:
            self._roll_deferred, self._roll_live, self._roll_kept = None, False, False
        self.roll_saves.start(run_dir, step, writes, is_writer=args.should_save, keep=args.save_total_limit,
                              nested=True, started=started, live=live)
        log_rank0(logger, "writing checkpoint-%d in the background (training waited %.1fs)", step,
                  time.perf_counter() - started)

    def _roll_write_checkpoint(self, model, trial, staging: str) -> None:
        step, args = self.state.global_step, self.args
        self._roll_staging = staging
        try:
            super()._save_checkpoint(model, trial)  # writes STAGING/checkpoint-N (HF names it)
        finally:
            self._roll_staging = None
        if args.should_save:
            staged = os.path.join(staging, f"{checkpoints.PREFIX}{step}")
            checkpoints.write_batch_record(staged, per_device=args.per_device_train_batch_size,
                                           grad_accum=args.gradient_accumulation_steps,
                                           world_size=args.world_size)
            if self.roll_dataset is not None:  # a trainer the backend built (not a bare one in a test)
                resume_record.write(staged, self.roll_dataset, dataset_spec=self.roll_dataset_spec,
                                    global_step=step, skipped_steps=self.roll_skipped_total,
                                    global_batch_size=args.per_device_train_batch_size
                                    * args.gradient_accumulation_steps * args.world_size)

    def _roll_fence_optimizer(self) -> bool:
        """Make every step of the torch optimizer first wait for the background writer (once per optimizer);
        False when the optimizer is no ``torch.optim.Optimizer`` (the save then copies every tensor)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds torch's
        if not isinstance(inner, torch.optim.Optimizer):
            return False
        if self._roll_fenced is not inner:
            saves = self.roll_saves
            inner.register_step_pre_hook(lambda *_: saves.fence())
            self._roll_fenced = inner
        return True

    def _roll_keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a background save writes ``tensor`` as it is, not from a host copy: with the fence, any tensor
        in host memory."""
        keep = self._roll_live and tensor.device.type == "cpu"
        self._roll_kept |= keep
        return keep

    def _roll_saves_in_background(self) -> bool:
        if self.roll_saves is None:
            return False
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            warn_once(logger, "save_async: DeepSpeed and FSDP write their own checkpoint files; checkpoints "
                              "are saved synchronously.")
            return False
        return True

    def _save(self, output_dir: str | None = None, state_dict=None):
        """HF's, but while a background save is prepared the model's ``save_pretrained`` only records a
        write of the weights: a host copy of those on an accelerator (frozen ones are not copied: they do not
        change; nor, with the fence, those in host memory)."""
        if self._roll_deferred is None or not self.args.should_save:
            return super()._save(output_dir, state_dict)
        model, deferred = self.model, self._roll_deferred
        save_pretrained = model.save_pretrained
        frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}

        def save_later(save_directory, state_dict=None, **kwargs):
            weights = host_copy(model.state_dict() if state_dict is None else state_dict,
                                keep=lambda tensor: tensor.data_ptr() in frozen or self._roll_keeps(tensor))
            deferred.append(functools.partial(write_weights, save_pretrained, save_directory, weights, kwargs))

        model.save_pretrained = save_later  # on this instance, for this call: HF's _save writes through it
        try:
            return super()._save(output_dir, state_dict)
        finally:
            del model.save_pretrained

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """HF's for plain / DDP training (``optimizer.pt``, ``scheduler.pt`` by the writer), with ``optimizer.pt``
        written past the page cache (``save_direct``); while a background save is prepared, by the background
        thread (from a host copy of what is on an accelerator). DeepSpeed / FSDP write their own files (HF's)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:
            return None
        path = os.path.join(output_dir, OPTIMIZER_NAME)
        if self._roll_deferred is None:
            save_direct(self.optimizer.state_dict(), path)
        else:
            state = host_copy(self.optimizer.state_dict(), keep=self._roll_keeps)
            self._roll_deferred.append(functools.partial(save_direct, state, path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's reminder to save the optimizer too: it is, above
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None


class RunComplete(Exception):
    """Raised before a step past ``max_steps``: HF 5.23 resumed from the final checkpoint trains one more step."""


class ReliabilityCallback(TrainerCallback):
    """Counts skipped steps and turns a stop signal into save-and-stop, on every rank at the same step."""

    def __init__(self, trainer, max_consecutive_skipped: int, save_on_preemption: bool) -> None:
        self.trainer = trainer
        self.skips = reliability.SkipCounter(max_consecutive_skipped)
        self.save_on_preemption = save_on_preemption
        self.stopped_at: int | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if 0 < state.max_steps <= state.global_step:
            # HF checks max_steps only after a step; resumed at the end of a max_steps run (its epoch not
            # finished) it would train one more. The checkpoint is loaded by now: stop before the step.
            raise RunComplete
        reliability.set_activity(f"training step {state.global_step + 1}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.roll_step_skipped:
            per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
            global_batch = per_rank * args.world_size
            samples = self.trainer.roll_sample_order().step_rows(state.global_step - 1, global_batch,
                                                                 len(self.trainer.train_dataset))
            self.skips.record(True, state.global_step, samples)
        else:
            self.skips.record(False, state.global_step)
        self.trainer.roll_skipped_total = self.skips.total
        if self.trainer.roll_saves is not None:
            self.trainer.roll_saves.poll()  # publishes the pending checkpoint once every rank wrote it
        action = reliability.STOP.poll()
        if action is reliability.Action.STOP:
            self.stopped_at = state.global_step
            control.should_training_stop = True
            control.should_save = self.save_on_preemption
        elif action is reliability.Action.SAVE:  # the early warning (slurm_signal): save now, train on
            control.should_save = True
        return control

