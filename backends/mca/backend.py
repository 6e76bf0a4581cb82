"""McaBackend: Megatron-Core behind the Backend interface.

What is here today is the model side: the padding policy Megatron needs, distributed and
model-parallel initialisation (``setup_distributed``), loading (HF converted on the fly, or a
Megatron checkpoint at any layout), and export back to HF format. The training loop (Megatron DDP,
distributed optimizer, pipeline schedules, per-token loss) is the next piece of work; until it
lands, ``train`` stops with a clear message (after set-up and loading). ``--dry-run`` works already
and shows exactly what the Megatron collator feeds the model.
"""

from __future__ import annotations

from backends.base import Backend, register_backend
from roll.contract import DistributedInfo, ModelBundle, TrainJob, TrainResult
from roll.data.policy import PaddingPolicy
from roll.errors import RollError

_NO_TRAINER = ("training on the mca backend is not available in this version: the Megatron training loop is "
               "the next milestone. Available now with --use-mca: --print-config, --dry-run, and "
               "HF <-> Megatron conversion with `roll-convert` (hf2mca / mca2hf / check). "
               "Train with the standard backend (drop --use-mca) in the meantime.")


@register_backend("mca")
class McaBackend(Backend):
    supported_stages = frozenset({"pt", "sft", "dpo"})
    # LoRA on Megatron comes with the training loop; refusing it here fails at config time.
    supported_finetuning_types = frozenset({"full"})

    def padding_policy(self, stage: str) -> PaddingPolicy:
        assert self.config.layout is not None, "RunConfig.validate() sets the layout for use_mca"
        return PaddingPolicy.for_megatron(
            self.config.layout, cutoff_len=self.config.data.cutoff_len,
            moe_token_dispatcher=self.config.megatron.moe_token_dispatcher_type, packing=self.config.data.packing)

    def setup_distributed(self) -> DistributedInfo:
        """Torch.distributed + Megatron parallel groups + seeds for the validated layout (idempotent)."""
        from backends.mca.initialize import initialize_megatron

        assert self.config.layout is not None, "RunConfig.validate() sets the layout for use_mca"
        return initialize_megatron(self.config.layout, seed=self.config.training.seed)  # logs the layout

    def load_models(self, stage: str, tokenizer) -> ModelBundle:
        """Policy chunks (and, for dpo, frozen reference chunks) from the configured checkpoints."""
        from backends.mca.models.auto import AutoModel

        model_args, ft, t = self.config.model, self.config.finetuning, self.config.training
        precision = dict(bf16=t.bf16, fp16=t.fp16)
        policy = AutoModel.from_pretrained(model_args.model_name_or_path, self.config.megatron, **precision)
        ref = None
        if stage == "dpo" and not ft.ref_free:
            ref = AutoModel.from_pretrained(ft.ref_model or model_args.model_name_or_path, self.config.megatron,
                                            **precision)
            for chunk in ref:
                chunk.requires_grad_(False).eval()
        return ModelBundle(policy=policy, ref=ref)

    def apply_finetuning(self, models: ModelBundle) -> ModelBundle:
        return models  # full fine-tuning: every parameter of every chunk trains

    def train(self, job: TrainJob, models: ModelBundle) -> TrainResult:
        raise RollError(_NO_TRAINER)

    def evaluate(self, job: TrainJob, models: ModelBundle) -> dict[str, float]:
        raise RollError(_NO_TRAINER)

    def save(self, models: ModelBundle, tokenizer, output_dir: str) -> str:
        """Gather the chunks and write standard HF safetensors + config + tokenizer (collective)."""
        from backends.mca.models.export import save_hf

        save_hf(models.policy, output_dir, tokenizer_dir=self.config.model.tokenizer_name_or_path
                or self.config.model.model_name_or_path)
        return output_dir

    def teardown(self) -> None:
        from backends.mca.initialize import destroy_megatron, is_initialized

        if is_initialized():
            destroy_megatron()
