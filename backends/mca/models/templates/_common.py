"""Building blocks the family templates share: the Llama-style key table and weight rows.

Families differ in a handful of rows (qkv bias, qk-norm, MoE blocks); keeping the common rows here
keeps each family file a short, readable declaration of just what makes it different.
"""

from __future__ import annotations

from typing import Any

from backends.mca.models.fused_experts import fused_expert_rows
from backends.mca.models.mapping import QKV, GateUp, Mapping, Rename
from backends.mca.models.template import ConfigKey
from roll.errors import ModelError

CONFIG_KEYS = [
    ConfigKey("hidden_size", "hidden_size"),
    ConfigKey("intermediate_size", "ffn_hidden_size"),
    ConfigKey("num_hidden_layers", "num_layers"),
    ConfigKey("num_attention_heads", "num_attention_heads"),
    ConfigKey("num_key_value_heads", "num_query_groups"),
    ConfigKey("head_dim", "kv_channels"),
    ConfigKey("rms_norm_eps", "layernorm_epsilon"),
    ConfigKey("vocab_size", "vocab_size"),
    ConfigKey("max_position_embeddings", "max_sequence_length"),
    ConfigKey("rope_parameters.rope_theta", "rotary_base"),
    ConfigKey("rope_theta", "rotary_base"),  # transformers < 5 keeps it top-level
    ConfigKey("tie_word_embeddings", "tie_embeddings_and_output_weights"),
    ConfigKey("attention_dropout", "attention_dropout"),
    ConfigKey("hidden_act", "activation"),
]

MOE_CONFIG_KEYS = [
    ConfigKey("num_experts", "num_moe_experts"),
    ConfigKey("num_local_experts", "num_moe_experts"),  # transformers >= 5 spelling for qwen3_moe
    ConfigKey("num_experts_per_tok", "moe_router_topk"),
    ConfigKey("moe_intermediate_size", "moe_ffn_hidden_size"),
    ConfigKey("router_aux_loss_coef", "moe_aux_loss_coeff"),
    # HF renormalises the top-k probabilities when norm_topk_prob; Megatron's default (softmax over the
    # top-k logits) is the same thing, and pre-softmax (softmax over all, then top-k) is the un-normalised one.
    ConfigKey("norm_topk_prob", "moe_router_pre_softmax", to_mca=lambda v: not v, to_hf=lambda v: not v),
]

CONSTANTS: dict[str, Any] = dict(
    normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
    hidden_dropout=0.0, position_embedding_type="rope", bias_activation_fusion=False, masked_softmax_fusion=False,
    persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
)

MOE_CONSTANTS: dict[str, Any] = dict(
    moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall", moe_layer_freq=1,
)

L, M = "model.layers.{layer}.", "decoder.layers.{layer}."


def model_rows(lm: str = "model.") -> list[Mapping]:
    """Embedding, final norm and head; ``lm`` is the language model's HF prefix (Qwen3-VL's
    ``model.language_model.``)."""
    return [Rename(lm + "embed_tokens.weight", "embedding.word_embeddings.weight"),
            Rename(lm + "norm.weight", "decoder.final_layernorm.weight"),
            Rename("lm_head.weight", "output_layer.weight")]


def attention_rows(qkv_bias: bool = False, qk_norm: bool = False, layer: str = L) -> list[Mapping]:
    """A decoder layer's attention and its two norms; ``layer`` is the HF layer prefix."""
    a = layer + "self_attn."
    rows: list[Mapping] = [
        Rename(layer + "input_layernorm.weight", M + "input_layernorm.weight"),
        QKV(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", M + "self_attention.linear_qkv.weight"),
        Rename(a + "o_proj.weight", M + "self_attention.linear_proj.weight"),
        Rename(layer + "post_attention_layernorm.weight", M + "pre_mlp_layernorm.weight"),
    ]
    if qkv_bias:
        rows.append(QKV(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias", M + "self_attention.linear_qkv.bias"))
    if qk_norm:
        rows += [Rename(a + "q_norm.weight", M + "self_attention.q_layernorm.weight"),
                 Rename(a + "k_norm.weight", M + "self_attention.k_layernorm.weight")]
    return rows


def mlp_rows(hf: str = L + "mlp.", mca: str = M + "mlp.") -> list[Mapping]:
    """A SwiGLU MLP: gate/up fused into linear_fc1, down_proj -> linear_fc2."""
    return [GateUp(hf + "gate_proj.weight", hf + "up_proj.weight", mca + "linear_fc1.weight"),
            Rename(hf + "down_proj.weight", mca + "linear_fc2.weight")]


def moe_rows() -> list[Mapping]:
    """Router + routed experts (canonical = SequentialMLP naming, ``{expert}`` is the global index)."""
    return [Rename(L + "mlp.gate.weight", M + "mlp.router.weight"),
            *mlp_rows(L + "mlp.experts.{expert}.", M + "mlp.experts.local_experts.{expert}.")]


FUSED_EXPERTS = fused_expert_rows(L + "mlp.experts.", L + "mlp.experts.{expert}.")
"""The routed experts of ``moe_rows()`` as transformers 5 stores them fused (``save_original_format=False``)."""


def check_dense_moe_layers(hf: dict, out: dict) -> None:
    """Megatron's MoE layer frequency here is 'every layer'; refuse HF configs that interleave dense MLPs."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ModelError(f"{hf.get('model_type')}: decoder_sparse_step={step}, mlp_only_layers={dense} "
                         "(dense layers between MoE layers) is not supported by the Megatron conversion yet.")


def rope_config(hf: dict) -> tuple[dict, str]:
    """The RoPE parameters and their ``rope_type`` ('default' when none), in any transformers spelling
    (``rope_parameters`` from 5.x; ``rope_scaling`` with ``rope_type`` or the older ``type`` before)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


def default_rope_only(hf: dict, out: dict) -> None:
    """Families whose HF implementation we map only with plain RoPE."""
    _, kind = rope_config(hf)
    if kind != "default":
        raise ModelError(f"{hf.get('model_type')}: rope_type {kind!r} is not supported by the Megatron conversion; "
                         "only default RoPE is (Llama-3 scaling: model_type llama).")
    fill_head_dim(hf, out)


def fill_head_dim(hf: dict, out: dict) -> None:
    if out.get("kv_channels") is None:
        out["kv_channels"] = hf["hidden_size"] // hf["num_attention_heads"]


def partial_rotary_factor(hf: dict, default: float) -> float:
    """The fraction of each head RoPE rotates: top level in hub configs, inside ``rope_parameters`` in
    transformers 5 saves; ``default`` is the config class's own (transformers does not write it). Where a
    config.json has both, transformers builds the model with ``rope_parameters``' value: so does this."""
    rope, _ = rope_config(hf)
    value = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return float(default if value is None else value)


def sigmoid_router(hf: dict, out: dict) -> None:
    """DeepSeek-V3-style routing (sigmoid scores, correction bias, group-limited top-k) in Megatron's terms,
    refusing what Megatron's router computes differently: it always renormalises the chosen scores (when
    top-k > 1, and never when top-k is 1) and picks groups by the sum of their top ``topk / topk_group``
    scores, where HF always sums the top 2."""
    model_type, topk = hf.get("model_type"), hf["num_experts_per_tok"]
    if not hf.get("norm_topk_prob", True) or topk < 2:
        raise ModelError(f"{model_type}: norm_topk_prob={hf.get('norm_topk_prob')} with num_experts_per_tok={topk} "
                         "is not supported by the Megatron conversion: Megatron's sigmoid router divides the "
                         "chosen scores by their sum exactly when num_experts_per_tok > 1 (HF: when "
                         "norm_topk_prob). Use norm_topk_prob: true and num_experts_per_tok >= 2.")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1:
        if topk != 2 * group_topk:
            raise ModelError(f"{model_type}: n_group={groups} with topk_group={group_topk} and num_experts_per_tok="
                             f"{topk} is not supported by the Megatron conversion: HF ranks groups by their top 2 "
                             f"scores, Megatron by their top num_experts_per_tok / topk_group ({topk // group_topk}"
                             "). Set n_group: 1 (no group limit) or num_experts_per_tok = 2 x topk_group.")
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    shared = hf.get("n_shared_experts") or 0
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared * hf["moe_intermediate_size"]


def dense_first_layers(hf: dict, out: dict) -> None:
    """``first_k_dense_replace`` dense layers, then MoE layers: Megatron's per-layer ``moe_layer_freq`` list."""
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    if dense:
        out["moe_layer_freq"] = [0] * min(dense, layers) + [1] * max(layers - dense, 0)
