"""A tiny Qwen2.5-VL built locally from a config (no downloads): the vision-language model of the tests and the
VL demo; and a tiny Qwen3-VL (``make_tiny_qwen3_vl_model``) for the mca backend's Qwen3-VL tests. Their image
processor is transformers' PIL one (``Qwen2VLImageProcessorPil``): no torchvision."""

from __future__ import annotations

import os

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens, added to the tiny BPE tokenizer (the real Qwen2.5 one has them)."""

TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
"""The vision tower, tiny: 2 blocks of width 32 (one windowed, one full attention as in the real model's
pattern), 14-pixel patches merged 2x2 into tokens of the language model's width 64."""

TINY_IMAGE_PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)
"""Images resized to between 4 and 16 language-model tokens (each token 28x28 pixels after the 2x2 merge)."""
QWEN25_IMAGE_PIXELS = dict(min_pixels=3136, max_pixels=12845056)
"""Qwen2.5-VL's own bounds (its preprocessor_config.json): image_max_pixels decides the token count."""


def build_vl_tokenizer():
    """The tiny BPE tokenizer (roll.demo.tiny_model) with Qwen2-VL's vision special tokens added."""
    from roll.demo.tiny_model import build_bpe_tokenizer

    tok = build_bpe_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    return tok


def tiny_vl_config(tok, *, num_layers: int = 2, tie_word_embeddings: bool = True, **overrides):
    """A Qwen2.5-VL config for ``tok``: the tiny Qwen2 language model of roll.demo.tiny_model (hidden 64, 4 heads /
    2 KV groups) with M-RoPE sections 2/3/3 of its 8 rotary frequencies, and ``TINY_VISION``."""
    import transformers as T

    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    ids = {f"{name}_token_id": tok.convert_tokens_to_ids(token) for name, token in
           (("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"), ("image", "<|image_pad|>"),
            ("video", "<|video_pad|>"))}
    config = T.Qwen2_5_VLConfig(text_config=text, vision_config=dict(TINY_VISION),
                                tie_word_embeddings=tie_word_embeddings, **ids)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_image_processor(pixels: dict | None = None):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=TINY_VISION["patch_size"],
                                    merge_size=TINY_VISION["spatial_merge_size"],
                                    temporal_patch_size=TINY_VISION["temporal_patch_size"],
                                    **(pixels or TINY_IMAGE_PIXELS))


def make_tiny_vl_model(out_dir: str, seed: int = 0, tokenizer: str = "bpe", image_pixels: dict | None = None,
                       **config_overrides) -> str:
    """Build a tiny random Qwen2.5-VL, its tokenizer and image processor, saved to ``out_dir``. Returns out_dir.
    ``tokenizer`` "qwen": the real Qwen2.5 tokenizer (it has the vision tokens; LLaMA-Factory's transformers reads it
    as roll's does, unlike the tiny BPE one: docs/llamafactory-parity.md); ``image_pixels``: the processor's
    min_pixels / max_pixels (default TINY_IMAGE_PIXELS)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from roll.demo.tiny_model import load_qwen_tokenizer

    tok = build_vl_tokenizer() if tokenizer == "bpe" else load_qwen_tokenizer()
    return save_tiny_vl(Qwen2_5_VLForConditionalGeneration, tiny_vl_config(tok, **config_overrides), tok, out_dir,
                        seed, image_pixels)


def save_tiny_vl(model_class, config, tok, out_dir: str, seed: int, image_pixels: dict | None = None) -> str:
    """``model_class(config)`` drawn with ``seed``, saved to ``out_dir`` with ``tok`` and the tiny image processor
    (``image_pixels``: its min_pixels / max_pixels, default TINY_IMAGE_PIXELS)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    tiny_image_processor(image_pixels).save_pretrained(out_dir)
    return out_dir


TINY_QWEN2_VL_VISION = dict(depth=2, embed_dim=24, hidden_size=48, mlp_ratio=3, num_heads=2, patch_size=14,
                            spatial_merge_size=2, temporal_patch_size=2)
"""Qwen2-VL's vision tower, tiny and odd: 2 blocks of width 24 (2 heads of 12), MLP ratio 3, merged into tokens of
the language model's width 48."""


def make_tiny_qwen2_vl_model(out_dir: str, seed: int = 0) -> str:
    """A tiny random Qwen2-VL at odd shapes (the second VL family of the mca tests): the language model of
    ``tiny_vl_config`` at hidden 48, 6 heads of 8 over 2 KV groups, M-RoPE sections 1/1/2, a 517-row vocabulary
    (TP2 pads it to 518), untied; ``TINY_QWEN2_VL_VISION``; the same tokenizer and image processor. Returns out_dir."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = build_vl_tokenizer()
    base = tiny_vl_config(tok)
    text = base.text_config.to_dict()
    text.update(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96, vocab_size=517)
    text["rope_parameters"]["mrope_section"] = [1, 1, 2]
    ids = {f"{name}_token_id": getattr(base, f"{name}_token_id") for name in ("image", "video", "vision_start",
                                                                             "vision_end")}
    config = Qwen2VLConfig(text_config=text, vision_config=dict(TINY_QWEN2_VL_VISION), tie_word_embeddings=False,
                           **ids)
    return save_tiny_vl(Qwen2VLForConditionalGeneration, config, tok, out_dir, seed)


TINY_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                         patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                         deepstack_visual_indexes=[0, 1])
"""Qwen3-VL's tower, tiny: 2 blocks of width 32, 16-pixel patches merged 2x2, an 8 x 8 learned position table, and
both blocks feeding deepstack features (through their own mergers) to the first two language-model layers."""


def tiny_qwen3_vl_config(tok, *, num_layers: int = 4, tie_word_embeddings: bool = True, text: dict | None = None,
                         vision: dict | None = None):
    """A Qwen3-VL config for ``tok``: a Qwen3 language model (hidden 64, 4 heads of 16 over 2 KV groups, q/k norms,
    interleaved M-RoPE sections 2/3/3 of its 8 rotary frequencies) and ``TINY_QWEN3_VISION``; ``text`` / ``vision``
    override their keys."""
    import transformers as T

    text_config = {**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                          rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                           "mrope_interleaved": True, "rope_theta": 5e5}), **(text or {})}
    ids = {f"{name}_token_id": tok.convert_tokens_to_ids(token) for name, token in
           (("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"), ("image", "<|image_pad|>"),
            ("video", "<|video_pad|>"))}
    return T.Qwen3VLConfig(text_config=text_config, vision_config={**TINY_QWEN3_VISION, **(vision or {})},
                           tie_word_embeddings=tie_word_embeddings, **ids)


def make_tiny_qwen3_vl_model(out_dir: str, seed: int = 0, **config_args) -> str:
    """Build a tiny random Qwen3-VL (``tiny_qwen3_vl_config(tok, **config_args)``), its tokenizer and image processor
    (32-pixel tokens, 2 to 16 of them an image), saved to ``out_dir``. Returns out_dir."""
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_vl_tokenizer()
    config = tiny_qwen3_vl_config(tok, **config_args)
    save_tiny_vl(Qwen3VLForConditionalGeneration, config, tok, out_dir, seed)
    vision = config.vision_config  # its own image processor in place of the 14-pixel one
    Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                             temporal_patch_size=vision.temporal_patch_size, min_pixels=64 * 64,
                             max_pixels=128 * 128).save_pretrained(out_dir)
    return out_dir
