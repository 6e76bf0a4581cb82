"""The memory-relevant shape of a decoder-only transformer, read without loading anything (for ``--plan``).

From ``config.json`` read as JSON (never ``AutoConfig``, which may reach the network), or from a small
built-in table of the models the shipped recipes name, for Hub ids that are not a local directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from roll.config.training import read_json_object
from roll.errors import ModelError


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory (HF config.json names in comments)."""

    hidden_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 family: biases on q/k/v
    qk_norm: bool = False  # Qwen3 family: RMSNorm on q and k
    num_experts: int = 0  # num_experts / num_local_experts; 0: dense
    experts_per_token: int = 0  # num_experts_per_tok
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0  # how many of num_layers have experts (decoder_sparse_step, mlp_only_layers)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each attention/MLP linear of a dense layer (the names LoRA targets use)."""
        h, q, kv, ffn = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}

    def attention_params(self) -> int:
        proj = self.projections()
        weights = sum(i * o for name, (i, o) in proj.items() if name in ATTENTION)
        bias = self.num_heads * self.head_dim + 2 * self.num_kv_heads * self.head_dim if self.qkv_bias else 0
        return weights + bias + (2 * self.head_dim if self.qk_norm else 0)

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """All routed experts of one MoE layer (what expert parallelism divides)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def moe_dense_params(self) -> int:
        """Router, plus the shared expert and its gate when there is one (replicated like attention)."""
        shared = self.shared_expert_intermediate_size
        h = self.hidden_size
        return h * self.num_experts + (3 * h * shared + h if shared else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        dense_layers = self.num_layers - self.moe_layers
        moe = self.expert_params() + self.moe_dense_params()
        layers = self.num_layers * (self.attention_params() + 2 * self.hidden_size) \
            + dense_layers * self.dense_mlp_params() + self.moe_layers * moe
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return layers + self.embedding_params() + head + self.hidden_size


# Shapes of the models the shipped recipes name, copied from each model's public config.json on the
# Hugging Face Hub (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim or
# hidden/heads, intermediate_size, vocab_size, tie_word_embeddings; MoE: num_experts, num_experts_per_tok,
# moe_intermediate_size). Used only when model_name_or_path is not a local directory.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 64, 4864, 151936, True, qkv_bias=True),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 128, 8960, 151936, True, qkv_bias=True),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, False, qkv_bias=True),
    "qwen3-30b-a3b": ModelShape(2048, 48, 32, 4, 128, 6144, 151936, False, qk_norm=True, num_experts=128,
                                experts_per_token=8, moe_intermediate_size=768, moe_layers=48),
    "llama-3-8b": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False),  # Llama-3.1-8B has the same shape
}
_ALIASES = {"llama-3.1-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b", "meta-llama-3.1-8b": "llama-3-8b"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_UNTIED_BY_DEFAULT = {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "mixtral"}


def shape_from_hf_config(cfg: dict) -> ModelShape:
    """A ModelShape from the dict of an HF config.json (text_config of a multimodal one)."""
    cfg = cfg.get("text_config") or cfg
    model_type = cfg.get("model_type", "")
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step, dense_only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if (i + 1) % step == 0 and i not in dense_only]
    moe_layers = len(sparse) if experts else 0
    return ModelShape(
        hidden_size=h, num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or h // heads, intermediate_size=cfg.get("intermediate_size") or 4 * h,
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=cfg.get("tie_word_embeddings", model_type not in _UNTIED_BY_DEFAULT),
        qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
        qk_norm=model_type.startswith("qwen3"),
        num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0,
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        moe_layers=moe_layers)


def resolve_shape(model_name_or_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where it came from): the local config.json, else the built-in table; ModelError if neither."""
    if not model_name_or_path:
        raise ModelError("--plan needs model_name_or_path (a local model directory or one of the built-in "
                         f"shapes: {', '.join(KNOWN_SHAPES)}).")
    config_file = os.path.join(model_name_or_path, "config.json")
    if os.path.isfile(config_file):
        cfg = read_json_object(config_file, f"{config_file} (model_name_or_path)", ModelError)
        try:
            return shape_from_hf_config(cfg), f"{config_file}"
        except KeyError as exc:
            raise ModelError(f"{config_file} lacks {exc}, which --plan needs for the model shape.") from None
    base = model_name_or_path.rstrip("/").split("/")[-1].lower()
    for suffix in ("-instruct", "-chat", "-base"):
        base = base.removesuffix(suffix)
    key = _ALIASES.get(base, base)
    if key not in KNOWN_SHAPES:
        raise ModelError(f"model_name_or_path={model_name_or_path!r} is not a local directory with a "
                         f"config.json and not a built-in shape ({', '.join(KNOWN_SHAPES)}); point it at the "
                         "model directory.")
    return KNOWN_SHAPES[key], f"roll's built-in table ({key}, from its public config.json; no local dir)"
