"""McaBackend: Megatron-Core behind the Backend interface.

``padding_policy`` follows the layout (shifted labels; lengths a multiple of TP under sequence
parallelism, of 2 * CP under context parallelism); ``setup_distributed`` brings up torch.distributed
and the model-parallel groups; ``load_models`` converts an HF checkpoint on the fly (or loads a
Megatron checkpoint at any layout); ``train`` / ``evaluate`` run ``trainer.MegatronTrainer`` (Megatron
DDP, distributed optimizer, pipeline schedules, per-token loss, DPO against a frozen reference or the
reward model's pairwise loss, checkpoints); ``save`` exports the final model in HF format.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from backends.base import Backend, register_backend
from roll import redact
from roll.contract import DistributedInfo, ModelBundle, TrainJob, TrainResult
from roll.data.policy import PaddingPolicy
from roll.errors import ConfigError
from roll.hf_config import has_hf_config, read_hf_config
from roll.logging import is_rank0, warn_once

logger = logging.getLogger(__name__)


@register_backend("mca")
class McaBackend(Backend):
    supported_stages = frozenset({"pt", "sft", "dpo", "kto", "rm"})
    supported_finetuning_types = frozenset({"full", "lora"})

    def __init__(self, config) -> None:
        super().__init__(config)
        self._trainer = None

    @classmethod
    def check_config(cls, config) -> None:
        from backends.mca.trainer.optim import PLAIN_SCHEDULES, check_schedule_name, schedule_for

        name = check_schedule_name(config.training.lr_scheduler_type)  # a fixed list: imports no torch
        if config.training.lr_scheduler_kwargs or name not in PLAIN_SCHEDULES:
            # HF's schedule function with the recipe's kwargs (the run's length is not known yet); the plain
            # schedules take none, so --print-config of most recipes stays free of torch.
            schedule_for(config.training, max(config.training.max_steps, 100))
        strategy = str(getattr(config.training.save_strategy, "value", config.training.save_strategy))
        if strategy not in ("no", "steps", "epoch"):
            raise ConfigError(f"save_strategy {strategy!r} is not available on the mca backend; use steps, epoch or "
                              "no.")
        from backends.mca import vision

        path = config.model.model_name_or_path
        hf_config = read_hf_config(path) if has_hf_config(path) else {}  # a VL model's whole, not its text_config
        model_type = hf_config.get("model_type")
        if model_type is not None:  # a local HF model without a conversion template fails now, not per rank
            from backends.mca.models.template import get_template

            get_template(model_type)
        if vision.is_vision_language(hf_config):
            vision.check_config(config, hf_config)

    def padding_policy(self, stage: str) -> PaddingPolicy:
        assert self.config.layout is not None, "RunConfig.validate() sets the layout for use_mca"
        policy = PaddingPolicy.for_megatron(
            self.config.layout, cutoff_len=self.config.data.cutoff_len,
            moe_token_dispatcher=self.config.megatron.moe_token_dispatcher_type, packing=self.config.data.packing)
        if stage == "rm":  # rm's labels mark the scored token of each row, not next tokens: not shifted
            policy = dataclasses.replace(policy, shift_labels=False)
        return policy

    def setup_distributed(self) -> DistributedInfo:
        """Torch.distributed + Megatron parallel groups + seeds for the validated layout (idempotent)."""
        from backends.mca.initialize import initialize_megatron

        assert self.config.layout is not None, "RunConfig.validate() sets the layout for use_mca"
        training = self.config.training
        return initialize_megatron(self.config.layout, seed=training.seed,  # logs the layout
                                   timeout_seconds=training.ddp_timeout)

    def load_models(self, stage: str, tokenizer) -> ModelBundle:
        """Policy chunks (and, for dpo, frozen reference chunks) from the configured checkpoints."""
        from backends.mca.models.auto import AutoModel

        model_args, ft, t = self.config.model, self.config.finetuning, self.config.training
        precision = dict(bf16=t.bf16, fp16=t.fp16)
        if stage == "rm":  # the score head in place of the LM head (backends/mca/models/reward.py)
            from backends.mca.models.auto import has_mca_config
            from backends.mca.models.loader import hf_weight_map
            from backends.mca.models.reward import check_start
            from roll.reward import HEAD, log_head_start, sequence_classification_class

            path = model_args.model_name_or_path
            check_start(path)
            if self.config.model_hf_config() and not has_mca_config(path):  # an HF directory
                sequence_classification_class(self.config.model_hf_config())  # a family without one fails now
                log_head_start(path, HEAD in hf_weight_map(path))
            precision["reward_head"] = True
        policy = AutoModel.from_pretrained(model_args.model_name_or_path, self.config.megatron, **precision)
        ref = None
        # LoRA without ref_model: the reference is the policy with its adapters disabled (no second model).
        if stage in ("dpo", "kto") and not ft.reference_free and (ft.ref_model or ft.finetuning_type != "lora"):
            ref = AutoModel.from_pretrained(ft.ref_model or model_args.model_name_or_path, self.config.megatron,
                                            **precision)
            for chunk in ref:
                chunk.requires_grad_(False).eval()
        return ModelBundle(policy=policy, ref=ref)

    def apply_finetuning(self, models: ModelBundle) -> ModelBundle:
        """lora: adapters on every chunk before DDP wrapping (PEFT's initial values), the rest frozen;
        full: every parameter of every chunk trains."""
        ft = self.config.finetuning
        if ft.finetuning_type == "lora":
            from backends.mca.lora.apply import apply_lora

            models.policy = apply_lora(models.policy, ft, seed=self.config.training.seed)
            if ft.stage == "rm":  # the reward head trains in full beside the adapters
                from backends.mca.models.reward import train_score_heads

                train_score_heads(models.policy)
        elif ft.export_merged:
            warn_once(logger, "export_merged is only used with finetuning_type=lora; ignored.")
        from backends.mca import vision

        if ft.finetuning_type == "full" and vision.is_vision_language(models.policy[0].config.hf_config):
            vision.freeze_parts(models.policy, ft)  # freeze_vision_tower / _multi_modal_projector / _language_model
        return models

    def train(self, job: TrainJob, models: ModelBundle) -> TrainResult:
        """pt/sft/dpo with Megatron's schedules, DDP and optimizer; checkpoints and logs in output_dir."""
        from backends.mca.trainer.loop import MegatronTrainer
        from roll.checkpoints import resolve_resume
        from roll.data.order import SampleOrder

        training = self.config.training
        resume = resolve_resume(training.resume_from_checkpoint, training.output_dir)  # a wrong path fails first
        self._trainer = MegatronTrainer(models.policy, self.config.training, self.config.megatron, self.config.layout,
                                        pad_token_id=job.tokenizer.pad_token_id,
                                        objective=self._objective(job.stage, models),
                                        order=SampleOrder.from_config(self.config))
        self._trainer.arguments = self.config.to_dict()  # saved as training_args.json (roll.redact)
        return self._trainer.train(job.train_dataset, job.collator, resume_from=resume,
                                   eval_dataset=job.eval_dataset)

    def _objective(self, stage: str, models: ModelBundle):
        """What the loop optimises: the LM loss (pt, sft) or DPO against the frozen reference (None: ref_free)."""
        from backends.mca.trainer.loss import DPOSettings
        from backends.mca.trainer.step import DPOObjective, LanguageModelObjective

        if stage == "rm":
            from backends.mca.trainer.reward import RewardObjective

            return RewardObjective()
        vocab_size = models.policy[0].config.vocab_size
        if stage == "kto":
            return self._kto_objective(vocab_size, models)
        if stage != "dpo":
            return LanguageModelObjective(vocab_size)
        ft = self.config.finetuning
        settings = DPOSettings(beta=ft.pref_beta, loss_type=ft.pref_loss, label_smoothing=ft.pref_label_smoothing,
                               ftx=ft.pref_ftx, simpo_gamma=ft.simpo_gamma)
        if ft.reference_free or models.ref is not None:
            return DPOObjective(vocab_size, settings, models.ref)
        from backends.mca.lora.apply import adapters_disabled  # LoRA: the policy without its adapters

        return DPOObjective(vocab_size, settings, models.policy, ref_mode=lambda: adapters_disabled(models.policy))

    def _kto_objective(self, vocab_size: int, models: ModelBundle):
        """KTO against the frozen reference (LoRA without ref_model: the policy with its adapters disabled)."""
        from backends.mca.trainer.kto import KTOObjective
        from roll.kto import KTOSettings

        ft = self.config.finetuning
        settings = KTOSettings(beta=ft.pref_beta, desirable_weight=ft.kto_desirable_weight,
                               undesirable_weight=ft.kto_undesirable_weight)
        if models.ref is not None:
            return KTOObjective(vocab_size, settings, models.policy, models.ref)
        from backends.mca.lora.apply import adapters_disabled

        return KTOObjective(vocab_size, settings, models.policy, models.policy,
                            ref_mode=lambda: adapters_disabled(models.policy))

    def evaluate(self, job: TrainJob, models: ModelBundle) -> dict[str, float]:
        """``eval_loss`` on job.eval_dataset with the training loss definition (after train; the metrics of
        the last step's eval when ``eval_strategy`` already ran it)."""
        if job.eval_dataset is None:
            return {}
        if self._trainer is None:
            raise RuntimeError("McaBackend.evaluate() needs train() first: it evaluates the trained chunks")
        done = self._trainer.last_eval
        if done is not None and done[0] == self._trainer.state.global_step:
            return dict(done[1])  # eval_strategy evaluated the last step: a second pass would log it twice
        return self._trainer.evaluate(job.eval_dataset, job.collator)

    def save(self, models: ModelBundle, tokenizer, output_dir: str) -> str:
        """The final model in HF format (collective): safetensors + config + tokenizer, or for LoRA a PEFT
        adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and, with export_merged, the
        merged model in ``output_dir/merged``."""
        model_args, ft = self.config.model, self.config.finetuning
        tokenizer_dir = model_args.tokenizer_name_or_path or model_args.model_name_or_path
        if is_rank0():  # as the standard backend: the run's arguments, as JSON, secrets redacted
            os.makedirs(output_dir, exist_ok=True)
            redact.save_arguments(self.config.to_dict(), output_dir)
        if ft.stage == "rm":  # a ...ForSequenceClassification model, or a SEQ_CLS adapter holding the head
            from backends.mca.models import reward

            if ft.finetuning_type == "lora":
                return reward.save_reward_adapter(models.policy, output_dir, model_args.model_name_or_path,
                                                  tokenizer_dir=tokenizer_dir)
            reward.save_reward_hf(models.policy, output_dir, tokenizer_dir=tokenizer_dir,
                                  pad_token_id=tokenizer.pad_token_id)
            return output_dir
        if ft.finetuning_type != "lora":
            from backends.mca.models.export import save_hf

            save_hf(models.policy, output_dir, tokenizer_dir=tokenizer_dir)
            return output_dir
        from backends.mca.lora.export import export_merged, save_hf_adapter

        save_hf_adapter(models.policy, output_dir, model_args.model_name_or_path, tokenizer_dir=tokenizer_dir)
        if ft.export_merged:
            export_merged(output_dir, model_args.model_name_or_path, tokenizer_dir=tokenizer_dir)
        return output_dir

    def teardown(self) -> None:
        from backends.mca.initialize import destroy_megatron, is_initialized

        if is_initialized():
            destroy_megatron()
