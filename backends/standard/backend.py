"""StandardBackend: HF Trainer (pt, sft), TRL DPOTrainer (dpo) and RewardTrainer (rm) with optional DeepSpeed ZeRO.

Order of work, and why it matters (research notes W1-W6 live in ``_compat``):
``setup_distributed`` checks the DeepSpeed file, initialises deepspeed.comm (W3) and builds the
HF/TRL arguments object *before* any model is loaded, so ZeRO-3 loads weights partitioned
(``zero.Init``); ``load_models`` then checks the path is a causal LM and loads it (and a frozen
reference for DPO); ``apply_finetuning`` adds LoRA or freezes layers; ``train`` runs the trainer;
``save`` writes the HF-format model; ``teardown`` releases the process group and per-process state.
"""

from __future__ import annotations

import logging
import os
import pickle
from datetime import timedelta

from backends.base import Backend, register_backend
from backends.standard import _compat
from backends.standard.ds_config import DeepSpeedSettings, check_combination, load_deepspeed_config
from backends.standard.hf_args import build_hf_args
from roll import resume_record
from roll.checkpoints import resolve_resume
from roll.contract import DistributedInfo, ModelBundle, TrainJob, TrainResult
from roll.data.policy import PaddingPolicy
from roll.data.vision import is_vl_model
from roll.errors import ModelError, Preempted, TrainingStopped
from roll.launch import local_rank
from roll.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)


@register_backend("standard")
class StandardBackend(Backend):
    supported_stages = frozenset({"pt", "sft", "dpo", "kto", "rm"})
    supported_finetuning_types = frozenset({"full", "lora", "freeze"})

    def __init__(self, config) -> None:
        super().__init__(config)
        self._deepspeed: DeepSpeedSettings | None = None
        self._hf_args = None
        self._trainer = None
        self._trainer_job: TrainJob | None = None
        self._restore_env: dict[str, str | None] = {}
        self._owns_process_group = False
        self._succeeded = False
        self._planned_stop: int | None = None
        """The exit code of a stop all ranks made together (preempted, diverged); None otherwise."""

    # ---- set-up ---------------------------------------------------------------------------------

    def padding_policy(self, stage: str) -> PaddingPolicy:
        """Pad to the longest sample; HF models shift labels inside their loss, so no shift here."""
        return PaddingPolicy(packing=self.config.data.packing)

    def setup_distributed(self) -> DistributedInfo:
        import torch.distributed as dist

        from roll.platform import current_platform

        if self._hf_args is None:  # idempotent: the env and process group are set up once
            training = self.config.training
            # A group that already exists (a notebook's, another test's) is not ours to destroy.
            self._owns_process_group = not (dist.is_available() and dist.is_initialized())
            self._deepspeed = load_deepspeed_config(training.deepspeed)
            if self._deepspeed is not None:
                check_combination(self._deepspeed, training)
                self._restore_env = _compat.single_process_env()  # W5
                _compat.init_deepspeed_comm(training.ddp_timeout)  # W3: before any HF config exists
                _compat.restrict_deepspeed_loads()  # W7
            elif int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
                dist.init_process_group(backend=current_platform().dist_backend,
                                        timeout=timedelta(seconds=training.ddp_timeout))
            self._deepspeed = self._for_resume(self._deepspeed)
            self._hf_args = build_hf_args(self.config, self._deepspeed)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return DistributedInfo(rank=rank, world_size=world, local_rank=local_rank(),
                               dp_rank=rank, dp_size=world)

    def _for_resume(self, deepspeed: DeepSpeedSettings | None) -> DeepSpeedSettings | None:
        """The DeepSpeed settings that load the resumed checkpoint at this run's data-parallel size
        (``backends.standard.elastic``: converted once to DeepSpeed's universal checkpoint when it
        changed)."""
        import torch.distributed as dist

        from backends.standard import elastic

        training = self.config.training
        ckpt = resolve_resume(training.resume_from_checkpoint, training.output_dir)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        writer = rank == 0 or (training.save_on_each_node and local_rank() == 0)
        return elastic.prepare_resume(deepspeed, ckpt, world_size=world, is_writer=writer)

    # ---- models ---------------------------------------------------------------------------------

    def load_models(self, stage: str, tokenizer) -> ModelBundle:
        from transformers import set_seed

        from backends.standard import models as M

        model_args, finetuning, training = self.config.model, self.config.finetuning, self.config.training
        M.check_causal_lm(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
        wants_ref = stage in ("dpo", "kto") and not finetuning.reference_free and (
            finetuning.ref_model or finetuning.finetuning_type != "lora")  # lora: TRL's frozen "ref" adapter
        if wants_ref and finetuning.ref_model:
            M.check_causal_lm(finetuning.ref_model, trust_remote_code=model_args.trust_remote_code,
                              what="ref_model")
        if self._hf_args is None:  # load_models without setup_distributed (in-process use)
            self.setup_distributed()
        dtype = M.resolve_dtype(model_args.dtype, bf16=training.bf16, fp16=training.fp16)
        load = dict(dtype=dtype, trust_remote_code=model_args.trust_remote_code,
                    attn_implementation=model_args.attn_implementation)
        set_seed(training.seed)
        if stage == "rm":  # a ...ForSequenceClassification model (backends/standard/reward.py)
            from backends.standard.reward import load_reward_model

            return ModelBundle(policy=load_reward_model(model_args.model_name_or_path,
                                                        pad_token_id=tokenizer.pad_token_id, **load))
        if is_vl_model(model_args.model_name_or_path):  # sft only (roll.data.vision.check_config)
            from backends.standard.vision import load_vl_model

            return ModelBundle(policy=load_vl_model(model_args.model_name_or_path, **load))
        policy = M.load_causal_lm(model_args.model_name_or_path, **load)
        ref = None
        if wants_ref:
            # A second load, not a deepcopy: under ZeRO-3 the policy's weights are already partitioned.
            ref_path = finetuning.ref_model or model_args.model_name_or_path
            what = "ref_model" if finetuning.ref_model else "model_name_or_path"
            ref = M.freeze_reference(M.load_causal_lm(ref_path, what=what, **load))
        return ModelBundle(policy=policy, ref=ref)

    def apply_finetuning(self, models: ModelBundle) -> ModelBundle:
        from transformers import set_seed

        from backends.standard import models as M
        from backends.standard import reward

        finetuning = self.config.finetuning
        rm = finetuning.stage == "rm"  # its score head trains in full (backends/standard/reward.py)
        vl = is_vl_model(self.config.model.model_name_or_path)  # freeze_vision_tower & co (standard/vision.py)
        if vl and finetuning.finetuning_type == "full":
            from backends.standard.vision import freeze_parts

            models.policy = freeze_parts(models.policy, finetuning)
        if finetuning.finetuning_type == "lora":
            set_seed(self.config.training.seed)  # the same adapter init on every rank
            if rm:
                reward.lora_targets_without_head(finetuning)
            models.policy = M.apply_lora(models.policy, finetuning, head=reward.HEAD_MODULE if rm else None,
                                         vision=vl)
        elif finetuning.finetuning_type == "freeze":
            models.policy = M.apply_freeze(models.policy, finetuning.freeze_trainable_layers)
            if rm:
                models.policy = reward.train_head(models.policy)
        if finetuning.export_merged and finetuning.finetuning_type != "lora":
            warn_once(logger, "export_merged is only used with finetuning_type=lora; ignored.")
        return models

    # ---- training -------------------------------------------------------------------------------

    def _make_trainer(self, job: TrainJob, models: ModelBundle):
        from backends.standard import models as M
        from backends.standard.trainers import PreferenceBatch, RollTrainer, make_dpo_trainer_class
        from roll.data.order import SampleOrder

        common = dict(args=self._hf_args, train_dataset=job.train_dataset, eval_dataset=job.eval_dataset,
                      processing_class=job.tokenizer)
        if job.stage == "kto":
            from backends.standard.kto_trainer import make_kto_trainer_class

            trainer = make_kto_trainer_class()(model=models.policy, ref_model=models.ref, data_collator=job.collator,
                                               **common)
            M.moe_loss_coefficients(models.policy, self.config.megatron, job.stage)  # warns
        elif job.stage == "dpo":
            dpo_trainer = make_dpo_trainer_class()
            trainer = dpo_trainer(model=models.policy, ref_model=models.ref,
                                  pref_ftx=self.config.finetuning.pref_ftx,
                                  simpo_gamma=self.config.finetuning.simpo_gamma,
                                  data_collator=PreferenceBatch(job.collator), **common)
            M.moe_loss_coefficients(models.policy, self.config.megatron, job.stage)  # warns
        elif job.stage == "rm":
            from backends.standard.reward import RewardBatch, make_reward_trainer_class

            trainer = make_reward_trainer_class()(model=models.policy, data_collator=RewardBatch(job.collator), **common)
            M.moe_loss_coefficients(models.policy, self.config.megatron, job.stage)  # warns
        else:
            collator = job.collator
            if self.config.data.packing and is_vl_model(self.config.model.model_name_or_path):
                from backends.standard.vision import PackedVisionBatch
                from roll.hf_config import read_hf_config

                collator = PackedVisionBatch(collator, read_hf_config(self.config.model.model_name_or_path))
            trainer = RollTrainer(model=models.policy, data_collator=collator, **common)
            trainer.moe_aux_coeff, trainer.moe_z_coeff = M.moe_loss_coefficients(
                models.policy, self.config.megatron, job.stage)
        trainer.roll_arguments = self.config.to_dict()  # saved as training_args.json (roll.redact)
        trainer.roll_order = SampleOrder.from_config(self.config)
        trainer.roll_dataset, trainer.roll_dataset_spec = job.train_dataset, self.config.data.dataset
        if self.config.training.save_async:
            from roll.background_save import BackgroundSaves

            trainer.roll_saves = BackgroundSaves()
        return trainer

    def train(self, job: TrainJob, models: ModelBundle) -> TrainResult:
        from backends.standard.reliability import ReliabilityCallback, RunComplete
        from backends.standard.trainers import JsonlLogCallback

        self._succeeded = False
        resume = resolve_resume(self.config.training.resume_from_checkpoint, self._hf_args.output_dir)
        self._trainer, self._trainer_job = self._make_trainer(job, models), job
        log_file = JsonlLogCallback(self._hf_args.output_dir, fresh=resume is None)
        self._trainer.add_callback(log_file)
        training = self.config.training
        guard = ReliabilityCallback(self._trainer, training.max_consecutive_skipped_steps,
                                    training.save_on_preemption)
        self._trainer.add_callback(guard)
        record = resume_record.read(resume) if resume else None
        if record:  # the resumed log continues the count
            guard.skips.total = self._trainer.roll_skipped_total = int(record.get("skipped_steps", 0))
        try:
            try:
                metrics = dict(self._trainer.train(resume_from_checkpoint=resume).metrics)
                self._finish_saves()
            except RunComplete:
                log_rank0(logger, "%s already holds all %d steps: nothing left to train", resume,
                          self._trainer.state.max_steps)
                metrics = {}
            except pickle.UnpicklingError as exc:  # HF's own weights_only loads, past roll.preflight
                raise _refused_by_transformers(resume, exc) from None
            if guard.stopped_at is not None:
                raise Preempted(_preempted_message(guard.stopped_at, self._hf_args.output_dir,
                                                   training.save_on_preemption))
        except TrainingStopped as exc:  # every rank stops at the same step: leave together (teardown)
            self._planned_stop = exc.exit_code
            if not isinstance(exc, Preempted):  # preempted: finished above, after HF's last save
                self._finish_saves()
            raise
        self._succeeded = True
        history = list(self._trainer.state.log_history)
        losses = [entry["loss"] for entry in history if "loss" in entry]
        if losses:
            log_rank0(logger, "training loss: %.4f at the first log -> %.4f at the last (%d steps); "
                      "logs in %s", losses[0], losses[-1], self._trainer.state.global_step, log_file.path)
        return TrainResult(log_history=history, output_dir=self._hf_args.output_dir, metrics=metrics)

    def _finish_saves(self) -> None:
        """Publish the checkpoint still being written (``save_async``) before the export or the exit.
        Collective: every rank gets here at the same step."""
        if self._trainer.roll_saves is not None:
            from roll import reliability

            reliability.set_activity("finishing the checkpoint written in the background")
            self._trainer.roll_saves.wait()

    def evaluate(self, job: TrainJob, models: ModelBundle) -> dict[str, float]:
        if job.eval_dataset is None:
            return {}
        if self._trainer is not None and self._trainer_job is job:
            trainer = self._trainer
        else:
            trainer = self._make_trainer(job, models)
        done = evaluated_at_last_step(trainer.state)
        if done:  # eval_strategy already evaluated the final step: a second pass would log a duplicate record
            return done
        # The trainer's own eval set (job's, prepared at construction), not the dataset again: after
        # training, TRL refuses to prepare one with precomputed reference log-probs (ref_free).
        return trainer.evaluate()

    def save(self, models: ModelBundle, tokenizer, output_dir: str) -> str:
        from backends.standard.export import export_merged, save_final_model

        if self._trainer is None:
            raise RuntimeError("StandardBackend.save() needs train() first: it saves through the trainer")
        self._succeeded = False
        out = save_final_model(self._trainer, tokenizer, output_dir)
        if is_vl_model(self.config.model.model_name_or_path):  # the image processor goes with the model
            from backends.standard.vision import save_image_processor

            save_image_processor(self.config.model.model_name_or_path, out)
        finetuning = self.config.finetuning
        if finetuning.finetuning_type == "lora" and finetuning.export_merged:
            export_merged(self.config.model.model_name_or_path, out, tokenizer,
                          trust_remote_code=self.config.model.trust_remote_code)
        self._succeeded = True
        return out

    def teardown(self) -> None:
        """Release the process group and per-process state (W2, W6); restore the env we set (W5)."""
        together = self._succeeded or self._planned_stop is not None
        if self._owns_process_group:
            _compat.destroy_process_group(barrier=together)
        if self._deepspeed is not None:
            _compat.reset_process_state()
        _compat.restore_env(self._restore_env)
        self._restore_env = {}
        if together:
            from roll.launch import under_roll_launcher

            # roll-train's launcher reads a planned stop's code from the rank's report; by hand it is the
            # exit code
            _compat.install_clean_exit(0 if self._succeeded or under_roll_launcher() else self._planned_stop)


def _refused_by_transformers(resume: str, exc: Exception) -> ModelError:
    reason = (str(exc).split("WeightsUnpickler error:")[-1].strip().splitlines() or [type(exc).__name__])[0]
    return ModelError(f"transformers refused a file of {resume} (rng_state*.pth, optimizer.pt or "
                      "scheduler.pt, which it loads weights_only whatever trust_checkpoint_pickles says): "
                      f"{reason.rstrip('.')}. Resume from a checkpoint with intact files.")


def _preempted_message(step: int, output_dir: str, saved: bool) -> str:
    where = "no checkpoint written (save_on_preemption is false)"
    if saved:
        path = os.path.join(output_dir, f"checkpoint-{step}")
        where = f"checkpoint written to {path}; resume_from_checkpoint: true continues from it"
    from roll import reliability

    return f"stopped by {reliability.STOP.name} after step {step}: {where}."


def evaluated_at_last_step(state) -> dict[str, float]:
    """The eval metrics HF Trainer logged at ``state.global_step`` (its ``eval_strategy``), or {} if none."""
    for entry in reversed(state.log_history):
        if entry.get("step") != state.global_step:
            break
        if "eval_loss" in entry:
            return {key: value for key, value in entry.items() if key.startswith("eval_")}
    return {}
