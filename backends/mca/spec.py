"""Which Megatron layer implementation to build: Transformer Engine on a GPU, the local spec otherwise.

The local spec swaps Megatron's ``DotProductAttention`` for ``LocalCoreAttention``, which also
handles packed (THD) sequences and context parallelism, so those paths run (and are tested) on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from roll.errors import ConfigError
from roll.platform import current_platform

if TYPE_CHECKING:
    from megatron.core.transformer import ModuleSpec, TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

logger = logging.getLogger(__name__)

TransformerImpl = Literal["local", "transformer_engine"]
_CHOICES = ("auto", "local", "transformer_engine")


@lru_cache(maxsize=1)
def transformer_engine_usable() -> bool:
    """TE needs a CUDA device and a working ``transformer_engine.pytorch`` (the PyPI meta package
    alone imports but raises; a build without cuDNN raises too), so try the real import."""
    if current_platform().device_type != "cuda" or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # any import failure means "not usable", and says why once
        logger.warning("transformer_engine is installed but cannot be imported (%s); using the local spec.", err)
        return False
    return True


def resolve_transformer_impl(requested: str) -> TransformerImpl:
    """``auto`` -> TE when usable, else local; an explicit choice is honoured or rejected clearly."""
    if requested not in _CHOICES:
        raise ConfigError(f"transformer_impl must be one of {', '.join(_CHOICES)}; got {requested!r}.")
    if requested == "local":
        return "local"
    if transformer_engine_usable():
        return "transformer_engine"
    if requested == "transformer_engine":
        raise ConfigError(
            f"transformer_impl: transformer_engine needs Transformer Engine importable on a CUDA GPU "
            f"(this process runs on {current_platform().device_type}). Set transformer_impl: auto or local.")
    return "local"


def gpt_layer_spec(config: "TransformerConfig", transformer_impl: str) -> "ModuleSpec":
    """The GPT decoder-layer spec for ``config`` (dense or MoE, qk-norm, MLA, grouped GEMM).

    ``transformer_impl`` is a resolved choice ('local' or 'transformer_engine'); pass the result of
    ``resolve_transformer_impl``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    common = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        qk_l2_norm=getattr(config, "qk_l2_norm", False),
    )
    if transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(**common)
    if transformer_impl != "local":
        raise ConfigError(f"transformer_impl must be 'local' or 'transformer_engine' here; got {transformer_impl!r}.")
    _check_local_supported(config)
    spec = get_gpt_layer_local_spec(normalization=config.normalization, **common)
    from backends.mca.attention import LocalCoreAttention

    spec.submodules.self_attention.submodules.core_attention = LocalCoreAttention
    return spec


def decoder_spec(config: "TransformerConfig", transformer_impl: str, vp_stage: int | None,
                 pp_rank: int) -> "ModuleSpec | TransformerBlockSubmodules":
    """What ``GPTModel`` builds its decoder from: one layer spec when every layer is alike, else (dense layers
    among MoE ones, ``moe_layer_freq`` other than 1) the block spec of this pipeline stage's layers, each with
    the same attention as ``gpt_layer_spec``. A single layer spec would make every layer an MoE layer:
    Megatron's ``TransformerBlock`` repeats it and reads ``moe_layer_freq`` only through the block spec."""
    if not config.num_moe_experts or config.moe_layer_freq == 1:
        return gpt_layer_spec(config, transformer_impl)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if transformer_impl == "local":
        _check_local_supported(config)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=transformer_impl == "transformer_engine",
                                       normalization=config.normalization,
                                       qk_l2_norm=getattr(config, "qk_l2_norm", False), vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    if transformer_impl == "local":
        from backends.mca.attention import LocalCoreAttention

        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = LocalCoreAttention
    return block


def _check_local_supported(config: "TransformerConfig") -> None:
    """Reject, before building, what the local spec cannot do (instead of an assert deep inside)."""
    if config.num_moe_experts and config.moe_grouped_gemm and importlib.util.find_spec("grouped_gemm") is None:
        raise ConfigError(
            "moe_grouped_gemm needs Transformer Engine on a GPU (or the grouped_gemm package); with the local "
            "layer implementation set moe_grouped_gemm: false (experts then run one after another).")
    if config.fp8:
        raise ConfigError("fp8 needs transformer_impl: transformer_engine on a GPU.")
