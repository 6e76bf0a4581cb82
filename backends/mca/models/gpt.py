"""Build the GPTModel chunks of this rank (one per virtual pipeline stage) from an McaModelConfig."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Iterator

import torch

from backends.mca.models.layout import Placement, from_impl_name, placement
from backends.mca.models.sharding import tag_tensor_parallel
from backends.mca.models.unwrap import unwrap_model
from roll.errors import ModelError
from roll.launch import local_rank
from roll.platform import current_platform

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig
    from roll.config.layout import ParallelLayout

logger = logging.getLogger(__name__)


def ensure_initialized(config: McaModelConfig) -> ParallelLayout:
    """The ParallelLayout Megatron was initialised with; ``config``'s parallel sizes must match it.

    The layout is built once per run (``MegatronArguments.build_layout``) and brought up with
    ``initialize_megatron`` by ``McaBackend.setup_distributed`` or ``roll-convert``; a model is
    never built for a layout of its own.
    """
    from backends.mca.initialize import current_layout

    layout = current_layout()
    if layout is None:
        raise ModelError("Megatron is not initialised: call backends.mca.initialize.initialize_megatron(layout) "
                         "before building a model (McaBackend.setup_distributed and roll-convert do).")
    model = {"tp": config.tensor_model_parallel_size, "pp": config.pipeline_model_parallel_size,
             "vpp": config.virtual_pipeline_model_parallel_size or 1, "cp": config.context_parallel_size,
             "ep": config.expert_model_parallel_size,
             "etp": config.expert_tensor_parallel_size or config.tensor_model_parallel_size}
    initialised = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp_size, "cp": layout.cp, "ep": layout.ep,
                   "etp": layout.expert_tp}
    if model != initialised:
        raise ModelError(f"the model config's parallel sizes {model} differ from the layout Megatron was initialised "
                         f"with ({layout.describe()}): build the model from the run's MegatronArguments.")
    return layout


def model_device() -> torch.device:
    """Where this rank's chunks live: its accelerator, or the CPU."""
    return current_platform().device(local_rank())


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
    parameters and buffers (with Megatron's tensor-parallel tags), not copies; wrapped chunks
    (DDP, Float16Module, PEFT) give the same names. ``placements`` default to this rank's."""
    placements = placements if placements is not None else chunk_placements(config)
    for chunk, place in zip(chunks, placements, strict=True):
        for name, tensor in unwrap_model(chunk).state_dict(keep_vars=True).items():
            if not name.endswith("_extra_state"):  # TE's FP8 metadata (None in local modules): no weight
                yield place.to_global(from_impl_name(name, config)), tensor


def build_model_chunks(config: McaModelConfig) -> list[torch.nn.Module]:
    """Fresh (randomly initialised) GPTModel chunks of this rank, one per virtual pipeline stage.

    Megatron must be initialised for a layout that matches ``config`` (see ``ensure_initialized``).
    """
    from backends.mca.models.template import template_for
    from backends.mca.spec import decoder_spec

    ensure_initialized(config)
    module, _, name = template_for(config).model_class.rpartition(".")
    model_class = getattr(importlib.import_module(module), name)  # GPTModel, or a family's subclass
    chunks: list[torch.nn.Module] = []
    vpp = config.virtual_pipeline_model_parallel_size
    pp_rank = rank_coordinates()["pp_rank"]
    for stage, place in enumerate(chunk_placements(config)):
        spec = decoder_spec(config, config.transformer_impl, stage if vpp else None, pp_rank)
        model = model_class(
            config=config, transformer_layer_spec=spec, vocab_size=config.padded_vocab_size,
            max_sequence_length=config.max_sequence_length, pre_process=place.pre_process,
            post_process=place.post_process,
            share_embeddings_and_output_weights=config.tie_embeddings_and_output_weights and not config.reward_head,
            position_embedding_type=config.position_embedding_type, rotary_percent=config.rotary_percent,
            rotary_base=int(config.rotary_base), rope_scaling=config.rope_scaling,
            rope_scaling_factor=config.rope_scaling_factor, vp_stage=stage if vpp else None)
        _check_offset(model, place, stage)
        if config.reward_head:
            from backends.mca.models.reward import attach_score_head

            attach_score_head(model)
        else:
            batch_major_logits(model)
        chunks.append(model.to(model_device()))  # built on the CPU (use_cpu_initialization), then moved
    tag_tensor_parallel(chunks)  # export reads them; without weight init Megatron leaves them unset
    return chunks


def batch_major_logits(model: torch.nn.Module) -> None:
    """Have the output layer write its logits batch-major, so that GPTModel's ``[s, b, V] -> [b, s, V]``
    ``transpose(0, 1).contiguous()`` is a no-op instead of a copy of the largest activation (and another
    of its gradient in the backward: 2 x 311 MB a step for 512 tokens of a 152k vocabulary in fp32).

    The layer is position-wise: fed the ``[b, s, h]`` view of the hidden states (a copy of 1/300th of the
    logits' size inside its matmul), it returns ``[b, s, V/tp]`` memory, handed back as the ``[s, b, V/tp]``
    view GPTModel expects. Left as built where the layout matters to the layer: sequence parallelism
    (it gathers along s), deferred embedding wgrad (it keeps the layer's inputs), multi-token prediction
    (it reads the logits in ``[s, b]`` order). A forward given ``labels`` (Megatron's own loss, which views
    the logits as ``[s * b, V]``) gets them copied to ``[s, b]`` memory first, as before.
    """
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    config = model.config
    if layer is None or config.sequence_parallel or config.defer_embedding_wgrad_compute or \
            config.mtp_num_layers:
        return
    forward = layer.forward

    def forward_batch_major(input_, weight=None, runtime_gather_output=None):
        logits, bias = forward(input_.transpose(0, 1), weight=weight,
                               runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1), bias  # [s, b, V/tp], a view of [b, s, V/tp]

    layer.forward = forward_batch_major
    loss = model.compute_language_model_loss

    def loss_of_contiguous_logits(labels, logits):
        # Megatron's own loss (a forward given labels) views the logits as [s * b, V/tp]: give it [s, b] memory
        return loss(labels, logits.contiguous())

    model.compute_language_model_loss = loss_of_contiguous_logits


def _check_offset(model: torch.nn.Module, place: Placement, stage: int) -> None:
    """Our global-layer arithmetic (used to find HF weights) must agree with Megatron's own."""
    layers = getattr(model.decoder, "layers", None)
    if layers and layers[0].layer_number - 1 != place.layer_offset:
        raise ModelError(f"virtual stage {stage}: Megatron placed layer {layers[0].layer_number - 1} first, the "
                         f"converter expected {place.layer_offset}. Only uniform pipeline splits are supported.")
