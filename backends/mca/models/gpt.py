"""Build the GPTModel chunks of this rank (one per virtual pipeline stage) from an McaModelConfig."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from backends.mca.models.layout import Placement, from_impl_name, placement
from roll.errors import ModelError
from roll.platform import current_platform

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

logger = logging.getLogger(__name__)


def ensure_initialized(config: McaModelConfig, seed: int = 42) -> None:
    """Initialise Megatron for ``config``'s layout if nobody has (idempotent; a mismatch is an error)."""
    from backends.mca.initialize import initialize_megatron
    from roll.config.layout import ParallelLayout

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout(world_size=world, tp=config.tensor_model_parallel_size,
                            pp=config.pipeline_model_parallel_size, vpp=config.virtual_pipeline_model_parallel_size,
                            cp=config.context_parallel_size, ep=config.expert_model_parallel_size,
                            etp=config.expert_tensor_parallel_size)
    initialize_megatron(layout, seed=seed)


def model_device() -> torch.device:
    """Where this rank's chunks live: its accelerator, or the CPU."""
    return current_platform().device(int(os.environ.get("LOCAL_RANK", "0")))


def rank_coordinates() -> dict[str, int]:
    """This rank's place in each Megatron group that decides which weights it holds."""
    from megatron.core import parallel_state as ps

    return {"pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "tp_size": ps.get_tensor_model_parallel_world_size(), "ep_rank": ps.get_expert_model_parallel_rank(),
            "etp_rank": ps.get_expert_tensor_parallel_rank(), "etp_size": ps.get_expert_tensor_parallel_world_size()}


def chunk_placements(config: McaModelConfig) -> list[Placement]:
    coords = rank_coordinates()
    vpp = config.virtual_pipeline_model_parallel_size or 1
    return [placement(config, coords["pp_rank"], stage, coords["ep_rank"]) for stage in range(vpp)]


def canonical_tensors(chunks: list[torch.nn.Module], config: McaModelConfig,
                      placements: list[Placement] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical global name, tensor) for every weight of this rank's chunks, in the naming the
    templates use (local spec, global layer/expert indices). The tensors are the chunks' own
    parameters and buffers, not copies. ``placements`` default to this rank's."""
    placements = placements if placements is not None else chunk_placements(config)
    for chunk, place in zip(chunks, placements, strict=True):
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if not name.endswith("_extra_state"):  # TE's FP8 metadata (None in local modules): no weight
                yield place.to_global(from_impl_name(name, config)), tensor


def build_model_chunks(config: McaModelConfig, seed: int = 42) -> list[torch.nn.Module]:
    """Fresh (randomly initialised) GPTModel chunks of this rank, one per virtual pipeline stage."""
    from megatron.core.models.gpt import GPTModel

    from backends.mca.spec import gpt_layer_spec

    ensure_initialized(config, seed)
    spec = gpt_layer_spec(config, config.transformer_impl)
    chunks: list[torch.nn.Module] = []
    vpp = config.virtual_pipeline_model_parallel_size
    for stage, place in enumerate(chunk_placements(config)):
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=config.padded_vocab_size,
            max_sequence_length=config.max_sequence_length, pre_process=place.pre_process,
            post_process=place.post_process,
            share_embeddings_and_output_weights=config.tie_embeddings_and_output_weights,
            position_embedding_type=config.position_embedding_type, rotary_percent=config.rotary_percent,
            rotary_base=int(config.rotary_base), rope_scaling=config.rope_scaling,
            rope_scaling_factor=config.rope_scaling_factor, vp_stage=stage if vpp else None)
        _check_offset(model, place, stage)
        chunks.append(model.to(model_device()))  # built on the CPU (use_cpu_initialization), then moved
    return chunks


def _check_offset(model: torch.nn.Module, place: Placement, stage: int) -> None:
    """Our global-layer arithmetic (used to find HF weights) must agree with Megatron's own."""
    layers = getattr(model.decoder, "layers", None)
    if layers and layers[0].layer_number - 1 != place.layer_offset:
        raise ModelError(f"virtual stage {stage}: Megatron placed layer {layers[0].layer_number - 1} first, the "
                         f"converter expected {place.layer_offset}. Only uniform pipeline splits are supported.")
