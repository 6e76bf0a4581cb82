"""StandardBackend: HF Trainer (pt, sft) and TRL DPOTrainer (dpo) with optional DeepSpeed ZeRO."""

from __future__ import annotations

from backends.base import Backend, register_backend


@register_backend("standard")
class StandardBackend(Backend):
    supported_stages = frozenset({"pt", "sft", "dpo"})
    supported_finetuning_types = frozenset({"full", "lora", "freeze"})
