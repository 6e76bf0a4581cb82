"""The shape of a decoder-only transformer, read from its Hugging Face config without loading any weights.

One reader for everything that needs the shape: ``--plan`` (memory), ``roll.perf`` (FLOPs per token, for
mfu) and roll-bench. ``shape_from_hf_config`` reads a config.json dict (or an HF config object) under the
names each family gives its fields (the ``_NAMES`` table); ``ModelShape.forward_flops`` counts the matmuls.
Never ``AutoConfig`` (which may reach the network): a config.json is read as JSON; a small built-in table
covers the Hub ids the shipped recipes name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roll.errors import ModelError
from roll.hf_config import EXPERT_COUNT_KEYS, has_hf_config, hf_config_path, read_hf_config
from roll.plan.vision import VisionShape, vision_shape

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# Each field the shape reads, and the config names families give it: the first one set wins. A family that
# uses a standard name under another one (GPT-2's n_embd) maps it in its config class's attribute_map,
# which shape_from_hf_config applies first.
_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "d_model", "n_embd", "dim"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "num_decoder_layers"),
    "num_heads": ("num_attention_heads", "n_head", "decoder_attention_heads", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "head_dim": ("head_dim", "kv_channels", "attention_head_dim"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "decoder_ffn_dim"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    # MoE: routed experts, how many a token uses, their width (Mixtral, OLMoE, PhiMoE, gpt-oss size them
    # with intermediate_size, which is the fallback), shared experts and which layers have experts
    "num_experts": EXPERT_COUNT_KEYS,
    "experts_per_token": ("num_experts_per_tok", "moe_k", "moe_topk", "experts_per_token", "top_k"),
    "moe_intermediate_size": ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size"),
    "shared_experts": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "first_dense_layers": ("first_k_dense_replace", "moe_layer_start_index"),
    "moe_step": ("decoder_sparse_step", "moe_layer_freq", "moe_layer_interval"),
    # multi-head latent attention (DeepSeek-V2/V3 and their relatives)
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    # linear-attention layers of hybrid models (Qwen3-Next's gated DeltaNet)
    "linear_key_heads": ("linear_num_key_heads",),
    "linear_value_heads": ("linear_num_value_heads",),
    "linear_key_head_dim": ("linear_key_head_dim",),
    "linear_value_head_dim": ("linear_value_head_dim",),
    "linear_conv_kernel": ("linear_conv_kernel_dim",),
    "sliding_window": ("sliding_window",),
}
# Families whose MLP is two matrices (up, down) instead of a gated three (gate, up, down).
_PLAIN_MLP = frozenset({
    "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gptj", "codegen", "opt", "bloom",
    "falcon", "phi", "starcoder2", "mpt", "persimmon", "biogpt", "xglm", "openai-gpt", "ctrl", "bert",
    "bert-generation", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "camembert",
    "electra", "ernie", "rembert", "roc_bert", "roformer", "data2vec-text", "xmod", "big_bird",
    "megatron-bert", "bart", "mbart", "marian", "pegasus", "plbart", "blenderbot", "blenderbot-small",
    "bigbird_pegasus", "mvp", "trocr", "prophetnet", "nemotron", "git", "jais2", "modernbert-decoder",
    "apertus", "arcee", "nanochat",
})
# Families whose q_proj is twice as wide: half of it gates the attention output (sigmoid).
_GATED_ATTENTION = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                              "qwen4_exp", "qwen4_exp_text"})
_LAYER_KINDS = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
                "chunked_attention": "sliding", "linear_attention": "linear"}
_UNTIED_BY_DEFAULT = {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "mixtral"}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory and FLOPs (HF config names in
    comments; ``_NAMES`` lists every family's names)."""

    hidden_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads; 0: an attention-free model (Mamba, RWKV)
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 family: biases on q/k/v
    qk_norm: bool = False  # Qwen3 family: RMSNorm on q and k
    num_experts: int = 0  # routed experts; 0: dense
    experts_per_token: int = 0  # num_experts_per_tok
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # all shared experts together (DeepSeek: n_shared * width)
    moe_layers: int = 0  # layers with experts (first_k_dense_replace, decoder_sparse_step, mlp_only_layers)
    shared_expert_gate: bool = False  # Qwen2-MoE / Qwen3-Next: a 1-wide sigmoid gate on the shared expert
    gated_mlp: bool = True  # gate, up, down (SwiGLU / GeGLU); False: up, down (GPT-2 style)
    # multi-head latent attention (0: standard attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_output_gate: bool = False  # q_proj twice as wide: half gates the output (Qwen3-Next)
    layer_kinds: tuple[str, ...] = ()  # per layer: full, sliding, linear or other; () = all full attention
    sliding_window: int = 0
    # gated-DeltaNet linear attention (Qwen3-Next) layers
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    vision: VisionShape | None = None  # a Qwen-VL model's vision tower and merger (roll.plan.vision)

    def kinds(self) -> tuple[str, ...]:
        return self.layer_kinds or ("full",) * self.num_layers

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each attention/MLP linear of a dense layer (the names LoRA targets use)."""
        h, q, kv, ffn = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}

    # ---- parameters (for --plan) ----------------------------------------------------------------

    def _mla_dims(self) -> tuple[int, int, int, int, int]:
        return (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim + self.qk_rope_head_dim,
                self.qk_rope_head_dim, self.v_head_dim)

    def _full_attention_params(self) -> int:
        h, n = self.hidden_size, self.num_heads
        if self.kv_lora_rank:  # MLA: q (through a rank-q_lora bottleneck), the shared latent kv, o
            q_rank, kv_rank, qk, rope, v = self._mla_dims()
            q = (h * q_rank + q_rank + q_rank * n * qk) if q_rank else h * n * qk
            return q + h * (kv_rank + rope) + kv_rank + kv_rank * n * (qk - rope + v) + n * v * h
        proj = self.projections()
        weights = sum(i * o for name, (i, o) in proj.items() if name in ATTENTION)
        gate = h * n * self.head_dim if self.attention_output_gate else 0
        bias = self.num_heads * self.head_dim + 2 * self.num_kv_heads * self.head_dim if self.qkv_bias else 0
        return weights + gate + bias + (2 * self.head_dim if self.qk_norm else 0)

    def _linear_attention_dims(self) -> tuple[int, int, int]:
        """(key width, value width, conv channels) of a gated-DeltaNet layer."""
        keys = self.linear_key_heads * self.linear_key_head_dim
        values = self.linear_value_heads * self.linear_value_head_dim
        return keys, values, 2 * keys + values

    def _linear_attention_params(self) -> int:
        h, (keys, values, conv) = self.hidden_size, self._linear_attention_dims()
        return h * (2 * keys + 2 * values + 2 * self.linear_value_heads) + values * h \
            + conv * self.linear_conv_kernel

    def attention_params(self) -> int:
        """The token mixer of one layer, averaged over the layers (hybrids mix attention kinds)."""
        per_kind = {"full": self._full_attention_params(), "sliding": self._full_attention_params(),
                    "linear": self._linear_attention_params(), "other": self._full_attention_params()}
        return round(sum(per_kind[k] for k in self.kinds()) / max(self.num_layers, 1))

    def _matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def dense_mlp_params(self) -> int:
        return self._matrices() * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """All routed experts of one MoE layer (what expert parallelism divides)."""
        return self.num_experts * self._matrices() * self.hidden_size * self.moe_intermediate_size

    def moe_dense_params(self) -> int:
        """Router, plus the shared experts and their gate when there are some (replicated like attention)."""
        h, shared = self.hidden_size, self.shared_expert_intermediate_size
        return h * self.num_experts + self._matrices() * h * shared + (h if self.shared_expert_gate else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        dense_layers = self.num_layers - self.moe_layers
        moe = self.expert_params() + self.moe_dense_params()
        layers = self.num_layers * 2 * self.hidden_size + sum(
            self._full_attention_params() if kind != "linear" else self._linear_attention_params()
            for kind in self.kinds()) + dense_layers * self.dense_mlp_params() + self.moe_layers * moe
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        vision = self.vision.total_params() if self.vision else 0
        return layers + self.embedding_params() + head + self.hidden_size + vision

    # ---- FLOPs (for mfu) ------------------------------------------------------------------------

    def _full_attention_flops(self, s: float) -> float:
        """Projections and the score / value products over ``s`` positions, per token."""
        h, n = self.hidden_size, self.num_heads
        if self.kv_lora_rank:
            q_rank, kv_rank, qk, rope, v = self._mla_dims()
            q = 2 * (h * q_rank + q_rank * n * qk) if q_rank else 2 * h * n * qk
            kv = 2 * h * (kv_rank + rope) + 2 * kv_rank * n * (qk - rope + v)
            return q + kv + 2 * n * v * h + 2 * n * (qk + v) * s
        d, kv_heads, q_width = self.head_dim, self.num_kv_heads, 2 if self.attention_output_gate else 1
        return 2 * h * d * ((q_width + 1) * n + 2 * kv_heads) + 4 * n * d * s

    def _linear_attention_flops(self) -> float:
        """Gated DeltaNet: projections, the causal depthwise convolution, and the recurrent state
        (per value head a d_k x d_v matrix: decay, read k.S, rank-1 update, read q.S: 3 products)."""
        state = 3 * 2 * self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return 2 * self._linear_attention_params() + state  # a weight (or conv tap) is one multiply-add

    def _moe_mlp_flops(self) -> float:
        h, m = self.hidden_size, self._matrices()
        experts = self.experts_per_token * 2 * m * h * self.moe_intermediate_size
        shared = 2 * m * h * self.shared_expert_intermediate_size + (2 * h if self.shared_expert_gate else 0)
        return 2 * h * self.num_experts + experts + shared

    def forward_flops(self, seq_length: float) -> float:
        """Forward matmul FLOPs of one token attending over ``seq_length`` positions (roll.perf's
        flops_per_token documents the formula)."""
        window = min(seq_length, self.sliding_window) if self.sliding_window else seq_length
        mixer = {"full": self._full_attention_flops(seq_length),
                 "sliding": self._full_attention_flops(window),
                 "linear": self._linear_attention_flops(), "other": 0.0}
        dense_layers = self.num_layers - self.moe_layers
        layers = sum(mixer[kind] for kind in self.kinds()) + self.moe_layers * self._moe_mlp_flops() \
            + dense_layers * 2 * self.dense_mlp_params()
        return float(layers + 2 * self.hidden_size * self.vocab_size)  # + the output head (tied or not)


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
    "qwen2.5-vl-7b": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, False, qkv_bias=True,
                                vision=VisionShape(32, 1280, 3420, 3584, 3 * 2 * 14 * 14)),
}
_ALIASES = {"llama-3.1-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b", "meta-llama-3.1-8b": "llama-3-8b"}


def _attribute_map(model_type: str | None) -> dict[str, str]:
    """The standard-name aliases of a family's config class (GPT-2: hidden_size -> n_embd); {} if unknown."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {})
    except (ImportError, KeyError):  # a remote-code family: its own names only
        return {}


def config_fields(config: Any) -> dict:
    """An HF config object or config.json dict as one flat dict of its text model's fields, with the
    standard names of the family's attribute_map added."""
    if isinstance(config, dict):
        fields = dict(config.get("text_config") or config)
        aliases = _attribute_map(fields.get("model_type"))
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        fields, aliases = text.to_dict(), dict(getattr(text, "attribute_map", {}) or {})
    for standard, own in aliases.items():
        if fields.get(standard) is None and fields.get(own) is not None:
            fields[standard] = fields[own]
    return fields


def _read(fields: dict, key: str, default: Any = 0) -> Any:
    for name in _NAMES[key]:
        value = fields.get(name)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            return round(sum(value) / len(value))  # a per-layer list (Gemma-3n's MLP widths): their mean
        if value is not None:
            return value
    if key == "num_layers" and isinstance(fields.get("layers_block_type"), (list, tuple)):
        return len(fields["layers_block_type"])  # Nemotron-H: one entry per layer, no count
    return default


def _layer_kinds(fields: dict, num_layers: int) -> tuple[str, ...]:
    types = fields.get("layer_types")
    if isinstance(types, (list, tuple)) and len(types) == num_layers:
        return tuple(_LAYER_KINDS.get(str(t), "other") for t in types)
    if _read(fields, "sliding_window") and fields.get("use_sliding_window") is not False:
        return ("sliding",) * num_layers  # Mistral, Phi-3: one window for every layer
    return ()


def _moe_layer_count(fields: dict, num_layers: int) -> int:
    """Layers with experts: from the first_k_dense_replace-th on, every decoder_sparse_step-th (Qwen's
    rule), minus mlp_only_layers; a list of per-layer MLP kinds wins when the config has one."""
    kinds = fields.get("mlp_layer_types")
    if isinstance(kinds, (list, tuple)) and len(kinds) == num_layers:
        return sum(1 for kind in kinds if "dense" not in str(kind))
    first, step = int(_read(fields, "first_dense_layers")), int(_read(fields, "moe_step", 1)) or 1
    dense_only = set(fields.get("mlp_only_layers") or [])
    return sum(1 for i in range(first, num_layers) if (i + 1) % step == 0 and i not in dense_only)


def shape_from_hf_config(config: Any) -> ModelShape:
    """A ModelShape from an HF config object or the dict of a config.json (text_config of a multimodal
    one). ModelError naming the field when a size every model has (hidden size, layers, vocab) is missing."""
    fields = config_fields(config)
    model_type = str(fields.get("model_type", ""))
    for key in ("hidden_size", "num_layers", "vocab_size"):
        if not _read(fields, key):
            raise ModelError(f"the model config (model_type {model_type!r}) lacks {' / '.join(_NAMES[key])}.")
    h, layers, heads = int(_read(fields, "hidden_size")), int(_read(fields, "num_layers")), \
        int(_read(fields, "num_heads"))
    experts = int(_read(fields, "num_experts"))
    moe_width = int(_read(fields, "moe_intermediate_size"))
    shared = int(_read(fields, "shared_expert_intermediate_size")) or \
        int(_read(fields, "shared_experts")) * moe_width
    return ModelShape(
        hidden_size=h, num_layers=layers, num_heads=heads,
        num_kv_heads=1 if fields.get("multi_query") else int(_read(fields, "num_kv_heads", heads) or heads),
        head_dim=int(_read(fields, "head_dim") or (h // heads if heads else 0)),
        intermediate_size=int(_read(fields, "intermediate_size") or 4 * h),
        vocab_size=int(_read(fields, "vocab_size")),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", model_type not in _UNTIED_BY_DEFAULT)),
        qkv_bias=bool(fields.get("attention_bias", model_type.startswith("qwen2"))),
        qk_norm=model_type.startswith("qwen3"),
        num_experts=experts, experts_per_token=int(_read(fields, "experts_per_token")) if experts else 0,
        moe_intermediate_size=moe_width if experts else 0,
        shared_expert_intermediate_size=shared if experts else 0,
        moe_layers=_moe_layer_count(fields, layers) if experts else 0,
        shared_expert_gate=bool(experts and fields.get("shared_expert_intermediate_size")),
        gated_mlp=model_type not in _PLAIN_MLP,
        q_lora_rank=int(_read(fields, "q_lora_rank")), kv_lora_rank=int(_read(fields, "kv_lora_rank")),
        qk_nope_head_dim=int(_read(fields, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_read(fields, "qk_rope_head_dim")), v_head_dim=int(_read(fields, "v_head_dim")),
        attention_output_gate=model_type in _GATED_ATTENTION, layer_kinds=_layer_kinds(fields, layers),
        sliding_window=int(_read(fields, "sliding_window")),
        linear_key_heads=int(_read(fields, "linear_key_heads")),
        linear_value_heads=int(_read(fields, "linear_value_heads")),
        linear_key_head_dim=int(_read(fields, "linear_key_head_dim")),
        linear_value_head_dim=int(_read(fields, "linear_value_head_dim")),
        linear_conv_kernel=int(_read(fields, "linear_conv_kernel")),
        vision=vision_shape(config if isinstance(config, dict) else config.to_dict()))


def resolve_shape(model_name_or_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where it came from): the local config.json, else the built-in table; ModelError if neither."""
    if not model_name_or_path:
        raise ModelError("--plan needs model_name_or_path (a local model directory or one of the built-in "
                         f"shapes: {', '.join(KNOWN_SHAPES)}).")
    config_file = hf_config_path(model_name_or_path)
    if has_hf_config(model_name_or_path):
        cfg = read_hf_config(model_name_or_path, f"{config_file} (model_name_or_path)")
        try:
            return shape_from_hf_config(cfg), f"{config_file}"
        except ModelError as exc:
            raise ModelError(f"{config_file}: {exc} --plan needs it for the model shape.") from None
    base = model_name_or_path.rstrip("/").split("/")[-1].lower()
    for suffix in ("-instruct", "-chat", "-base"):
        base = base.removesuffix(suffix)
    key = _ALIASES.get(base, base)
    if key not in KNOWN_SHAPES:
        raise ModelError(f"model_name_or_path={model_name_or_path!r} is not a local directory with a "
                         f"config.json and not a built-in shape ({', '.join(KNOWN_SHAPES)}); point it at the "
                         "model directory.")
    return KNOWN_SHAPES[key], f"roll's built-in table ({key}, from its public config.json; no local dir)"
