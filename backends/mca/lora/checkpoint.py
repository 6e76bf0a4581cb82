"""Adapter-only checkpoints in Megatron's distributed format (resumable at another TP/PP layout).

The sharded state dict of a LoRA chunk is the model's own (``GPTModel.sharded_state_dict``), in
which every LoRA layer places its adapters (``LoraParallelLinear.sharded_state_dict``: the split
weight TP-sharded, the other replicated); here it is filtered to the adapter entries, so a LoRA
checkpoint holds only ``...lora_A.<proj>`` / ``...lora_B.<proj>`` tensors (a few MB), and, for a reward model
(stage rm), its score head ``output_layer.weight``, which trains in full beside them.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from backends.mca.lora.apply import is_lora_param
from backends.mca.models.unwrap import unwrap_model
from roll.errors import ModelError


def adapter_sharded_state_dict(model_chunks: Sequence[nn.Module]) -> dict:
    """``backends.mca.checkpoint.sharded_model_state_dict`` restricted to the adapter tensors."""
    from backends.mca.checkpoint import sharded_model_state_dict

    full = sharded_model_state_dict(model_chunks)
    head = {"output_layer.weight"} if getattr(unwrap_model(model_chunks[0]).config, "reward_head", False) else set()
    return {key: {name: t for name, t in sd.items() if is_lora_param("." + name) or name in head}
            for key, sd in full.items()}


def save_adapter_checkpoint(model_chunks: Sequence[nn.Module], ckpt_dir: str) -> None:
    """Write only the adapters to ``ckpt_dir`` (collective)."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(adapter_sharded_state_dict(model_chunks), ckpt_dir)


def load_adapter_checkpoint(model_chunks: Sequence[nn.Module], ckpt_dir: str) -> None:
    """Load adapters saved by ``save_adapter_checkpoint`` (any layout) into LoRA chunks (collective)."""
    from backends.mca.checkpoint import load_sharded

    sharded = adapter_sharded_state_dict(model_chunks)
    state, _ = load_sharded(sharded, ckpt_dir, "LoRA adapters")
    for key, chunk in zip(sharded, model_chunks):
        result = unwrap_model(chunk).load_state_dict(state[key], strict=False)
        if result.unexpected_keys or any(is_lora_param("." + k) for k in result.missing_keys):
            raise ModelError(f"adapter checkpoint {ckpt_dir} does not fit chunk {key}: unexpected "
                             f"{result.unexpected_keys[:5]}, missing adapters "
                             f"{[k for k in result.missing_keys if is_lora_param('.' + k)][:5]}.")
