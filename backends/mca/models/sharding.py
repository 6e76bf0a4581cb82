"""Tensor-parallel split/merge of global Megatron tensors, shared by every family.

Which way a parameter splits follows from its Megatron module, i.e. its canonical name:
column-parallel linears split their output dim (0), row-parallel ones their input dim (1), the
fused SwiGLU ``linear_fc1`` splits gate and up *separately* (each rank holds [gate_r; up_r]),
and norms/routers/gates are replicated. Expert weights use the expert-TP group (ETP).
The vocab dim of embeddings and the output layer is padded before splitting and unpadded after merging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

Kind = Literal["column", "row", "swiglu", "replicated"]
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_COLUMN = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.bias")
_ROW = (".linear_proj.weight", ".linear_fc2.weight")


def tp_kind(name: str, config: McaModelConfig) -> Kind:
    """How the canonical Megatron parameter ``name`` is split across (expert-)tensor-parallel ranks."""
    if name in _VOCAB or name.endswith(_COLUMN):
        return "column"
    if name.endswith(".linear_fc1.weight"):
        return "swiglu" if config.gated_linear_unit else "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def is_expert(name: str) -> bool:
    """Routed-expert weights live in the expert groups (EP x ETP); shared experts do not."""
    return ".mlp.experts." in name


def tp_size_rank(name: str, tp: tuple[int, int], etp: tuple[int, int]) -> tuple[int, int]:
    return etp if is_expert(name) else tp


def split(tensor: torch.Tensor, kind: Kind, size: int, rank: int) -> torch.Tensor:
    """This rank's shard of a global tensor."""
    if size == 1 or kind == "replicated":
        return tensor
    if kind == "swiglu":
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    dim = 1 if kind == "row" else 0
    if tensor.shape[dim] % size:
        raise ValueError(f"cannot split dim {dim} of size {tensor.shape[dim]} into {size} tensor-parallel shards")
    return tensor.chunk(size, dim=dim)[rank].contiguous()


def merge(shards: list[torch.Tensor], kind: Kind) -> torch.Tensor:
    """Inverse of ``split`` over all ranks' shards (in rank order)."""
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "swiglu":
        pairs = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=0)
    return torch.cat(shards, dim=1 if kind == "row" else 0)


def pad_vocab(name: str, tensor: torch.Tensor, config: McaModelConfig) -> torch.Tensor:
    """Zero rows up to the padded vocab (for embedding/output only)."""
    extra = config.padded_vocab_size - tensor.shape[0]
    if name not in _VOCAB or extra <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])], dim=0)


def unpad_vocab(name: str, tensor: torch.Tensor, config: McaModelConfig) -> torch.Tensor:
    if name not in _VOCAB:
        return tensor
    return tensor[: config.vocab_size]


def shard_for_rank(name: str, tensor: torch.Tensor, config: McaModelConfig,
                   tp: tuple[int, int], etp: tuple[int, int]) -> torch.Tensor:
    """Global canonical tensor -> what the rank at (tp size, rank) / (etp size, rank) holds."""
    size, rank = tp_size_rank(name, tp, etp)
    return split(pad_vocab(name, tensor, config), tp_kind(name, config), size, rank)
