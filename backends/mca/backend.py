"""McaBackend: Megatron-Core training behind the Backend interface."""

from __future__ import annotations

from backends.base import Backend, register_backend


@register_backend("mca")
class McaBackend(Backend):
    supported_stages = frozenset({"pt", "sft", "dpo"})
    supported_finetuning_types = frozenset({"full", "lora"})
