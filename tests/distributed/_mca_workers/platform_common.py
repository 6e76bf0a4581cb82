"""Shared bits of the PLATFORM torchrun workers: a tiny GPT built through roll's spec, and result output.

Workers print one ``RESULT {json}`` record per rank that the tests parse (tests.helpers.results); a failed check raises, so
the process exits non-zero with the reason in stderr.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VOCAB, SEQ = 128, 32


def tiny_config(num_layers: int = 2, **overrides):
    """A Qwen2-like TransformerConfig (RMSNorm, SwiGLU, RoPE, qkv bias, GQA 4/2) for the current layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(config, seed: int = 0, vp_stage: int | None = None):
    """GPTModel for this (virtual) pipeline stage with roll's layer spec (local impl on CPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from backends.mca.spec import gpt_layer_spec, resolve_transformer_impl

    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(config, resolve_transformer_impl("auto")),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    position_embedding_type="rope", rotary_base=1000000, share_embeddings_and_output_weights=False,
                    vp_stage=vp_stage)


def build_chunks(config, seed: int = 0) -> list:
    """One GPTModel chunk per virtual pipeline stage (a single chunk without VPP)."""
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is None:
        return [build_gpt(config, seed)]
    return [build_gpt(config, seed + i, vp_stage=i) for i in range(vpp)]


def batch(bs: int = 2, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (bs, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(bs, -1)


def emit(**result) -> None:
    print("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", "0")), **result}), flush=True)
