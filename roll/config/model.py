"""Which model and tokenizer to start from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roll.errors import ConfigError


@dataclass
class ModelArguments:
    model_name_or_path: str | None = None
    """Local directory of a Hugging Face causal LM (config.json + safetensors). roll never downloads: a Hub id
    (Qwen/Qwen2.5-7B) is refused with the command that fetches it on a machine with network."""

    tokenizer_name_or_path: str | None = None
    """Tokenizer directory; defaults to model_name_or_path."""

    trust_remote_code: bool = False
    """Allow executing model/tokenizer code shipped with the checkpoint. Off unless you trust the source."""

    trust_checkpoint_pickles: bool = False
    """Load pickle-based checkpoint and model files (DeepSpeed *.pt, Megatron .metadata / common.pt /
    .distcp bytes, HF *.pth) even when they name Python objects beyond tensors and roll's allow-list:
    unpickling such a file can run any code. Off unless you made the files or trust their source
    (docs/reliability.md, "What roll trusts")."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the standard backend loads the weights in. 'auto' loads float32 (fp32 master weights; bf16/fp16
    autocast the compute); bfloat16/float16 load 16-bit weights (half the memory, no fp32 copy). The mca backend
    refuses bfloat16/float16: its weights follow bf16/fp16, with fp32 copies in the optimizer."""

    attn_implementation: str | None = None
    """HF attention kernel for the standard backend ('eager', 'sdpa', 'flash_attention_2'); default: HF's choice."""

    cache_dir: str | None = None
    """Hugging Face cache directory handed to the tokenizer loader (roll loads local directories only)."""

    def __post_init__(self) -> None:
        if self.model_name_or_path is not None and not str(self.model_name_or_path).strip():
            raise ConfigError("model_name_or_path is empty: set it to a model directory.")
