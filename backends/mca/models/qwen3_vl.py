"""Qwen3-VL on Megatron: Qwen2.5-VL's model (``backends.mca.models.qwen2_5_vl``: HF's vision tower on the first
pipeline stage, image features at the placeholder tokens, 3-D positions from HF's ``get_rope_index``) with the two
things Qwen3-VL does differently, each as transformers 5.23's ``modeling_qwen3_vl`` does it:

- **Interleaved M-RoPE.** Frequency ``i`` of a head's ``head_dim / 2`` rotates by the height position when
  ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, by the width position when ``i % 3 == 2`` and
  ``i < 3 * mrope_section[2]``, else by the temporal one (``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``);
  Megatron's ``MultimodalRotaryEmbedding`` gives each axis a contiguous chunk (Qwen2.5-VL's layout).
- **Deepstack.** The tower also returns, for each of its ``deepstack_visual_indexes`` blocks, that block's features
  through its own merger; the ``j``-th is added to the hidden states at the image tokens *after* decoder layer ``j``
  (``Qwen3VLTextModel.forward``). Here the features are scattered into a dense ``[s, b, n, h]`` tensor (zeros at
  text tokens: adding 0.0 leaves a hidden state bit-identical), split along the sequence like the embeddings under
  sequence parallelism, and handed to the decoder block as its ``context``: the one per-micro-batch tensor Megatron
  passes to every layer and saves for a full-recompute backward (a GPT layer's cross-attention, which would read it,
  is an identity). Layers ``0 .. n-1`` add their slice to their output. They must all sit in the first pipeline
  stage's first virtual chunk, with the tower (``deepstack_layout_error``; checked at config time).

Under context parallelism (and packed) the features take the rows of the main image features (``image_feature_rows``:
those of the placeholders this rank holds), so the dense tensor is this rank's part of the sequence.

Memory: the dense features cost ``n * s * b * h / (tp with SP) / cp`` activations per micro-batch (3 x 4096 x 4096
bf16 values, 96 MiB, for Qwen3-VL-8B at 4096 tokens); autograd saves none of it (the scatter and the additions keep
no operand), a full recompute saves it with each micro-batch's checkpointed layers until their backward.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    get_pos_emb_on_this_cp_rank,
)

from backends.mca.models.qwen2_5_vl import Qwen2_5_VLModel
from backends.mca.vision import deepstack_layers, deepstack_layout_error
from roll.errors import ModelError


def interleaved_axes(half_dim: int, section: list[int]) -> torch.Tensor:
    """The position axis (0 temporal, 1 height, 2 width) each of a head's ``half_dim`` frequencies rotates by."""
    axes = torch.zeros(half_dim, dtype=torch.long)
    for axis in (1, 2):  # HF's slice(axis, 3 * section[axis], 3)
        axes[axis:3 * section[axis]:3] = axis
    return axes


class InterleavedMultimodalRotaryEmbedding(torch.nn.Module):
    """Megatron's M-RoPE module ``rope`` (its frequencies, interpolation and context-parallel group) with Qwen3-VL's
    interleaved frequency layout (the module docstring) in place of its contiguous chunks."""

    def __init__(self, rope: MultimodalRotaryEmbedding) -> None:
        super().__init__()
        if rope.rotary_interleaved:
            raise ModelError("qwen3_vl: rotary_interleaved (Megatron's pairwise rotation) is not Qwen3-VL's RoPE.")
        self.rope = rope

    @property
    def cp_group(self) -> torch.distributed.ProcessGroup | None:
        """The wrapped module's context-parallel group (Qwen2_5_VLModel._preprocess sets it aside for packed rows)."""
        return self.rope.cp_group

    @cp_group.setter
    def cp_group(self, group: torch.distributed.ProcessGroup | None) -> None:
        self.rope.cp_group = group

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int],
                cp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
        rope = self.rope
        positions = position_ids.to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)  # [3, b, s]
        if rope.seq_len_interpolation_factor is not None:
            positions = positions / rope.seq_len_interpolation_factor
        freqs = positions[..., None] * rope.inv_freq  # [3, b, s, d/2], HF's product
        axes = interleaved_axes(freqs.shape[-1], mrope_section).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(1, *freqs.shape[1:])).squeeze(0)  # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, d]
        cp_group = cp_group if cp_group is not None else rope.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


class Qwen3VLModel(Qwen2_5_VLModel):
    """Qwen2_5_VLModel with interleaved M-RoPE and deepstack (the module docstring)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(self.rotary_pos_emb)
        self.deepstack_layers = deepstack_layers(config.hf_config)
        if self.pre_process:
            error = deepstack_layout_error(self.deepstack_layers, config.num_layers,
                                           config.pipeline_model_parallel_size,
                                           config.virtual_pipeline_model_parallel_size)
            if error:
                raise ModelError(error)
            for layer in self.decoder.layers:
                if layer.layer_number - 1 < self.deepstack_layers:
                    add_deepstack_after(layer, layer.layer_number - 1)

    def vision_block_inputs(self, vision, positions, embeddings, feature_rows=None):
        """The deepstack features in a dense ``[s(/tp), b, n, h]`` tensor, the decoder block's ``context``: the rows
        ``feature_rows`` of them (context parallelism: those of this rank's placeholders, as the main features)."""
        from megatron.core import tensor_parallel

        if not vision.deepstack_features:
            return {}
        features = torch.stack(vision.deepstack_features, dim=1).to(embeddings.dtype)  # [n_image_tokens, n, h]
        if feature_rows is not None:
            features = features.index_select(0, feature_rows)
        seq, batch, hidden = embeddings.shape
        dense = embeddings.new_zeros(seq, batch, len(vision.deepstack_features), hidden)
        dense = dense.index_put(positions, features)
        if self.config.sequence_parallel:
            dense = tensor_parallel.scatter_to_sequence_parallel_region(dense)
        return {"context": dense}


def add_deepstack_after(layer: torch.nn.Module, index: int) -> None:
    """Have decoder layer ``layer`` add deepstack feature ``index`` (the block's ``context[:, :, index]``) to its
    output; a micro-batch without images has no context and gets nothing added, as in HF."""
    forward = layer.forward

    def forward_with_deepstack(*args, **kwargs):
        hidden_states, context = forward(*args, **kwargs)
        if context is not None:
            hidden_states = hidden_states + context[:, :, index]
        return hidden_states, context

    layer.forward = forward_with_deepstack
