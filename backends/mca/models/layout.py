"""Canonical (local-spec, global-index) Megatron names <-> the names a built model chunk uses.

Two independent renamings live here so templates stay layout-free:
- *implementation*: Transformer Engine fuses the pre-attention/pre-MLP norms into the following
  linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``; under multi-latent attention the
  q/kv latent norms into ``linear_q_up_proj`` / ``linear_kv_up_proj``) and its grouped-GEMM
  experts are ``experts.linear_fc1.weight{e}``; the local spec keeps separate norms and
  ``experts.local_experts.{e}.linear_fc1.weight``.
- *placement*: a chunk numbers its layers and experts locally; PP/VPP and EP offsets make them global.

A reward model's (``reward_head``) output layer holds the 1-wide score head as ``output_layer.weight``, where
Megatron expects it; its canonical name is ``output_layer.score.weight``, so that no rule of the vocabulary
projection (padding, column split, tying) applies to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_SEQ = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_EXPERT_TE = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_TE_RENAMES = ((".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
               (".input_layernorm.bias", ".self_attention.linear_qkv.layer_norm_bias"))
_TE_MLA_RENAMES = ((".self_attention.q_layernorm.weight", ".self_attention.linear_q_up_proj.layer_norm_weight"),
                   (".self_attention.kv_layernorm.weight", ".self_attention.linear_kv_up_proj.layer_norm_weight"))
"""Multi-latent attention under TE (megatron-core 0.16.1's TE spec with ``multi_latent_attention``): the q and kv
latent norms are fused into the up-projections (TELayerNormColumnParallelLinear, ``q_layernorm`` /
``kv_layernorm`` Identity), while the input norm stays a separate module (there is no ``linear_qkv``)."""
_TE_DENSE_RENAMES = ((".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
                     (".pre_mlp_layernorm.bias", ".mlp.linear_fc1.layer_norm_bias"))


def _te_renames(config: McaModelConfig, name: str | None = None) -> tuple[tuple[str, str], ...]:
    """The TE renames of canonical ``name`` (global layer index); None: those of any layer, which is safe
    from TE names back (a TE name is unambiguous). MoE layers keep a separate pre-MLP norm under TE (there
    is no single fc1 to fuse it into); dense layers, also those of an MoE model, fuse it."""
    attention = _TE_MLA_RENAMES if getattr(config, "multi_latent_attention", False) else _TE_RENAMES
    layer = _LAYER.match(name) if name is not None else None
    if layer is not None and config.is_moe_layer(int(layer.group(1))):
        return attention
    if name is not None and layer is None:
        return attention
    return attention + _TE_DENSE_RENAMES


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer index of the Megatron decoder-layer name ``name``."""
    match = _LAYER.match(name)
    assert match is not None, name
    return int(match.group(1))


def hf_layer_index(name: str) -> int | None:
    """The layer index of an HF ``model.layers.{i}.*`` name; None for anything else."""
    match = _HF_LAYER.match(name)
    return int(match.group(1)) if match else None


def grouped_experts(config: McaModelConfig) -> bool:
    return bool(config.num_moe_experts) and config.moe_grouped_gemm


_SCORE_IMPL, _SCORE = "output_layer.weight", "output_layer.score.weight"


def to_impl_name(name: str, config: McaModelConfig) -> str:
    """Canonical local-spec name (global layer index) -> the name under ``config.transformer_impl`` (and
    grouped GEMM)."""
    if name == _SCORE and getattr(config, "reward_head", False):
        return _SCORE_IMPL
    if config.transformer_impl == "transformer_engine":
        for local, te in _te_renames(config, name):
            if name.endswith(local):
                name = name[: -len(local)] + te
    if grouped_experts(config):
        name = _EXPERT_SEQ.sub(lambda m: f".mlp.experts.{m.group(2)}.{m.group(3)}{m.group(1)}", name)
    return name


def from_impl_name(name: str, config: McaModelConfig) -> str:
    """Inverse of ``to_impl_name``."""
    if name == _SCORE_IMPL and getattr(config, "reward_head", False):
        return _SCORE
    if config.transformer_impl == "transformer_engine":
        for local, te in _te_renames(config):
            if name.endswith(te):
                name = name[: -len(te)] + local
    if grouped_experts(config):
        name = _EXPERT_TE.sub(lambda m: f".mlp.experts.local_experts.{m.group(3)}.{m.group(1)}.{m.group(2)}", name)
    return name


@dataclass(frozen=True)
class Placement:
    """Where one model chunk sits: its first global layer and its first global expert."""

    layer_offset: int
    expert_offset: int
    pre_process: bool
    post_process: bool

    def to_global(self, name: str) -> str:
        name = _shift(_LAYER, name, self.layer_offset, "decoder.layers.{}.")
        return _shift_expert(name, self.expert_offset)


def placement(config: McaModelConfig, pp_rank: int, vpp_stage: int, ep_rank: int) -> Placement:
    """Uniform split: chunk (vpp_stage, pp_rank) holds layers [(v * pp + p) * n, ... + n)."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    per_chunk = config.num_layers_per_chunk
    experts_per_rank = (config.num_moe_experts or 0) // config.expert_model_parallel_size
    return Placement(layer_offset=(vpp_stage * pp + pp_rank) * per_chunk,
                     expert_offset=ep_rank * experts_per_rank,
                     pre_process=pp_rank == 0 and vpp_stage == 0,
                     post_process=pp_rank == pp - 1 and vpp_stage == vpp - 1)


def _shift(regex: re.Pattern, name: str, offset: int, fmt: str) -> str:
    m = regex.match(name)
    if not m or not offset:
        return name
    return fmt.format(int(m.group(1)) + offset) + name[m.end():]


def _shift_expert(name: str, offset: int) -> str:
    if not offset:
        return name
    name = _EXPERT_SEQ.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + offset}.{m.group(2)}.{m.group(3)}",
                           name)
    return _EXPERT_TE.sub(lambda m: f".mlp.experts.{m.group(1)}.{m.group(2)}{int(m.group(3)) + offset}", name)
