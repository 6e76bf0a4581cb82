"""Qwen2-VL and Qwen2.5-VL on Megatron: the language model is a Megatron-Core GPTModel with multimodal RoPE, the
vision tower and patch merger are HF's own module (``VISION_TOWERS``: Qwen2.5-VL's
``Qwen2_5_VisionTransformerPretrainedModel``, Qwen2-VL's ``Qwen2VisionTransformerPretrainedModel``) on the first
pipeline stage. The two families differ in that module and their config names only.

Why HF's tower and not a Megatron one: it computes exactly what the HF model computes (the standard backend's
vision features are bit-identical to these), its weights need no mapping beyond their names, and it is small
(0.67B of Qwen2.5-VL-7B's 8.3B; 32 blocks of width 1280), so splitting it over tensor-parallel ranks would save
little memory for a lot of code. Every tensor-parallel rank of the first stage holds it whole and encodes the
micro-batch's images itself; its parameters are tagged ``average_gradients_across_tp_domain`` so that Megatron's
``finalize_model_grads`` keeps the replicas equal (their gradients already are: every TP rank gets the full gradient
of the decoder input).

The batch: ``input_ids`` [b, s] with one ``<|image_pad|>`` token per merged patch of each image, ``pixel_values``
[sum of patches, C * T * P * P] and ``image_grid_thw`` [n_images, 3], both concatenated over the rows in row order
(what HF's image processor returns per image). On the first stage the image features replace the embeddings at the
placeholder positions, in row-major (row, then position) order as HF's ``masked_scatter`` does, before sequence
parallelism scatters the sequence. Every stage needs the 3-D position ids ``[3, b, s]``: given, or computed here
from ``input_ids`` and ``image_grid_thw`` by HF's own ``get_rope_index`` (``roll.mrope``).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.models.gpt import GPTModel

from roll.mrope import mrope_position_ids

VISION_TOWERS = {"qwen2_5_vl": "Qwen2_5_VisionTransformerPretrainedModel",
                 "qwen2_vl": "Qwen2VisionTransformerPretrainedModel", "qwen3_vl": "Qwen3VLVisionModel"}
"""HF model_type -> its vision tower + merger class (in ``transformers.models.<model_type>.modeling_<model_type>``)."""


def vision_config(hf_config: dict):
    """The transformers vision config of a VL model's config.json (a dict), by its ``model_type``."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[hf_config["model_type"]].from_dict(hf_config).vision_config


def build_vision_tower(config) -> torch.nn.Module:
    """HF's vision tower + merger for ``config.hf_config`` (``VISION_TOWERS``; SDPA attention, as the HF reference
    model loads), in the Megatron model's dtype; randomly initialised only when Megatron initialises weights; its
    blocks recompute their activations when the language model's layers do (``recompute_granularity``)."""
    import importlib

    from transformers.initialization import no_init_weights

    family = config.hf_config["model_type"]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    tower_class = getattr(modeling, VISION_TOWERS[family])
    skip_init = no_init_weights() if not config.perform_initialization else contextlib.nullcontext()
    with skip_init:
        tower = tower_class._from_config(vision_config(config.hf_config), attn_implementation="sdpa")
    for param in tower.parameters():
        param.average_gradients_across_tp_domain = True
    if config.recompute_granularity is not None:
        # the language model's layers recompute their activations in the backward (Megatron's recompute): so do
        # the tower's blocks, by HF's own checkpointing (the same values; memory only)
        tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return tower.to(config.params_dtype)


class Qwen2_5_VLModel(GPTModel):
    """GPTModel (``position_embedding_type="mrope"``) whose first pipeline stage also holds ``visual``."""

    def __init__(self, config, *args, **kwargs) -> None:
        # the embedding keeps the whole sequence: image features go in first, then the sequence-parallel scatter
        super().__init__(config, *args, scatter_embedding_sequence_parallel=False, **kwargs)
        self.image_token_id = config.hf_config["image_token_id"]
        if self.pre_process:
            self.visual = build_vision_tower(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_feature_rows: torch.Tensor | None = None, **kwargs):
        if position_ids is None:
            position_ids = mrope_position_ids(input_ids, image_grid_thw, self.config.hf_config)
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"a Qwen-VL model needs 3-D (M-RoPE) position ids [3, batch, seq]; got shape "
                             f"{tuple(position_ids.shape)} (roll.mrope.mrope_position_ids computes them).")
        if self.pre_process and decoder_input is None:
            decoder_input, block_inputs = self.embed(input_ids, pixel_values, image_grid_thw, image_feature_rows)
            if block_inputs:
                kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), **block_inputs}
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                               **kwargs)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, **kwargs):
        """GPTModel's, but for packed rows under context parallelism: Megatron's multimodal rotary embedding cuts
        the whole THD stream into 2 * CP chunks (right for one sequence a row), while THD RoPE wants every token's
        angles and cuts them per packed sample itself (``_apply_rotary_pos_emb_thd``, which maps them by offset
        when they cover the stream): the embedding is taken again uncut."""
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context, packed_seq_params,
                                  **kwargs)
        rope = self.rotary_pos_emb
        if packed_seq_params is None or rope.cp_group is None or rope.cp_group.size() == 1:
            return out
        cp_group, rope.cp_group = rope.cp_group, None  # None: the embedding's forward cuts nothing
        try:
            whole = rope(position_ids, self.mrope_section)
        finally:
            rope.cp_group = cp_group
        return (out[0], whole, *out[2:])

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
              image_feature_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token embeddings ``[s(/tp), b, h]`` with the images' features at their placeholder tokens, and what the
        decoder block gets besides (``block_inputs``: nothing here; Qwen3-VL's deepstack features).
        ``image_feature_rows`` (context parallelism: this rank holds part of the sequence): the rows of the batch's
        image features that go to this rank's placeholders, in their order; None: all of them."""
        from megatron.core import tensor_parallel

        embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], the whole sequence
        placeholders = input_ids == self.image_token_id
        count = int(placeholders.sum())
        block_inputs: dict[str, torch.Tensor] = {}
        if pixel_values is not None and len(pixel_values):
            vision = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
            features = vision.pooler_output
            if image_feature_rows is not None:
                features = features.index_select(0, image_feature_rows)
        elif count:
            raise ValueError(f"the batch has {count} image placeholder tokens but no pixel_values.")
        else:
            features = None
            trained = [p for p in self.visual.parameters() if p.requires_grad]
            if trained and torch.is_grad_enabled():
                # no image in this micro-batch: a trained tower still joins the backward (with zero gradients),
                # or Megatron's overlapped gradient reduction would wait for its buckets forever
                embeddings = embeddings + 0.0 * sum(p.sum() for p in trained)
        if features is not None:
            if features.shape[0] != count:
                raise ValueError(f"the batch's images give {features.shape[0]} feature rows (image_grid_thw "
                                 f"{image_grid_thw.tolist()}) for {count} image placeholder tokens: the collator "
                                 "must keep every image's <|image_pad|> run whole.")
            rows, tokens = placeholders.nonzero(as_tuple=True)  # row-major: the order the images are in
            embeddings = embeddings.index_put((tokens, rows), features.to(embeddings.dtype))
            block_inputs = self.vision_block_inputs(vision, (tokens, rows), embeddings, image_feature_rows)
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings, block_inputs

    def vision_block_inputs(self, vision, positions: tuple[torch.Tensor, torch.Tensor], embeddings: torch.Tensor,
                            feature_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """What the decoder block gets from the tower's output ``vision`` besides the token embeddings: nothing for
        Qwen2-VL and Qwen2.5-VL (``positions``: the image tokens' (token, row) indices; ``embeddings``: ``[s, b, h]``;
        ``feature_rows``: ``embed``'s ``image_feature_rows``, the feature rows these tokens take)."""
        return {}


SAMPLE_GRIDS = ((1, 4, 6), (1, 6, 2))
"""The check batch's two images, in patches (t, h, w): 6 and 3 language-model tokens, h != w (so the three M-RoPE
axes differ), one of them taller than wide."""


def sample_batch(hf_config: dict, seq_len: int = 16, seed: int = 1234) -> dict[str, torch.Tensor]:
    """A fixed multimodal batch for ``roll-convert check``: three rows of ``seq_len`` tokens (at least 16), the
    first with the 6-token image, the second with the 3-token one, the third text only; random text tokens and
    random pixel values (``pixel_values`` [36, C * T * P * P]). Keys: input_ids, pixel_values, image_grid_thw."""
    vision = vision_config(hf_config)
    merge = vision.spatial_merge_size ** 2
    gen = torch.Generator().manual_seed(seed)
    seq_len = max(seq_len, 16)
    text_ids = min(hf_config[f"{name}_token_id"] for name in ("image", "video", "vision_start", "vision_end"))
    input_ids = torch.randint(0, text_ids, (3, seq_len), generator=gen)
    for row, (start, grid) in enumerate(zip((2, 5), SAMPLE_GRIDS)):
        tokens = grid[0] * grid[1] * grid[2] // merge
        input_ids[row, start] = hf_config["vision_start_token_id"]
        input_ids[row, start + 1:start + 1 + tokens] = hf_config["image_token_id"]
        input_ids[row, start + 1 + tokens] = hf_config["vision_end_token_id"]
    patches = sum(t * h * w for t, h, w in SAMPLE_GRIDS)
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {"input_ids": input_ids, "pixel_values": torch.randn(patches, width, generator=gen),
            "image_grid_thw": torch.tensor(SAMPLE_GRIDS)}
