"""Every causal-LM family of the installed transformers, built tiny from its config class (no hub access).

``causal_lm_families()`` enumerates ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; ``SKIPPED`` says why a family is
left out (the family smoke matrix lists them); ``tiny_config(family, ...)`` gives a config of hidden 32,
2 layers, 4 heads / 2 KV groups, 4 experts (top-2) for MoE families, with the caller's vocabulary and special
token ids: the ``TINY`` sizes under every name a family may use, plus the few ``OVERRIDES`` a family
needs to build or to stay tiny. Used by tests/unit/test_family_matrix.py and tests/unit/test_perf.py.
"""

from __future__ import annotations

import inspect
from typing import Any

TINY: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
    # MoE, under each family's names
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1,
    # multi-head latent attention
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    # linear-attention layers of hybrids
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    # encoder-decoder families' decoder, and embeddings sized apart from hidden_size
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=2,
    encoder_attention_heads=4, encoder_ffn_dim=64, embedding_size=32, input_embedding_size=32,
    output_embedding_size=32,
)

_MLA = dict(num_key_value_heads=4)  # latent attention expands k/v to every query head
_HYBRID = dict(layer_types=["linear_attention", "full_attention"])  # one layer of each kind
OVERRIDES: dict[str, dict[str, Any]] = {
    **{family: _MLA for family in ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                                   "dots3_note_text", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash",
                                   "minicpm3", "youtu")},
    **{family: _HYBRID for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text")},
    "codegen": dict(rotary_dim=4), "gptj": dict(rotary_dim=4),  # default 64 > head_dim 8
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16),
    "gemma4_text": dict(hidden_size_per_layer_input=8),
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1),
    "zamba": dict(layer_types=["linear_attention", "hybrid"], tie_word_embeddings=False),  # its tie keys break
    "zamba2": dict(layer_types=["mamba", "hybrid"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "zaya": dict(num_experts_per_tok=1),
}

SKIPPED: dict[str, str] = {
    # multimodal wrappers: a vision or audio tower of its own size comes with them
    **{family: "multimodal (a vision/audio tower); its text model is tested as its own family" for family in (
        "dots3_note", "emu3", "fuyu", "gemma3", "gemma4", "gemma4_unified", "git", "got_ocr2", "llama4",
        "mllama", "moss_transcribe_diarize", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen4_exp")},
    **{family: "a draft model for speculative decoding (built from its main model's text_config)"
       for family in ("gemma4_assistant", "gemma4_unified_assistant")},
    "gemma3n": "needs the timm package (its vision tower), not a roll dependency",
    "blt": "byte-latent model: its hash n-gram embeddings hold ~5 billion parameters at any hidden size",
    "musicgen": "audio model: codebook token streams, not a text LM",
    "musicgen_melody": "audio model: codebook token streams, not a text LM",
    "reformer": "axial position embeddings fix the sequence length (their product) and need is_decoder",
    **{family: "transformers 5.23: its config class's defaults build no model" for family in (
        "cohere_compass_text", "dbrx", "lfm2_moe", "qwen4_exp_text")},
    "xmod": "needs a language adapter chosen before each forward (set_default_language)",
}


def causal_lm_families() -> list[str]:
    """Every model_type transformers maps to a causal LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(family: str, vocab_size: int, **ids: int | None):
    """A tiny config of ``family``: every ``TINY`` size its config class takes (by its own name or its
    attribute_map alias), the family's ``OVERRIDES``, ``vocab_size`` and the special token ids ``ids``
    (pad_token_id, bos_token_id, eos_token_id: inside the vocabulary, or a family's default may not be)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    accepted = inspect.signature(cls.__init__).parameters
    aliases = getattr(cls, "attribute_map", {}) or {}
    kwargs: dict[str, Any] = {}
    for key, value in {**TINY, **OVERRIDES.get(family, {}), "vocab_size": vocab_size, **ids}.items():
        name = key if key in accepted else aliases.get(key)
        if name in accepted:
            kwargs[name] = value
    return cls(**kwargs)
