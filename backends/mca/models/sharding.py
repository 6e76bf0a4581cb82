"""Tensor-parallel split/merge of global Megatron tensors, shared by every family.

Which way a parameter splits follows from its Megatron module: column-parallel linears split
their output dim (0), row-parallel ones their input dim (1), the fused SwiGLU ``linear_fc1``
splits gate and up *separately* (each rank holds [gate_r; up_r]), and norms/routers/gates are
replicated. Expert weights use the expert-TP group (ETP). The vocab dim of embeddings and the
output layer is padded before splitting and unpadded after merging.

Export reads the placement from Megatron's own tags on the live parameter (``param_tp_kind``:
``tensor_model_parallel``, ``partition_dim``); the HF -> Megatron loader, which converts a
global HF tensor before it touches a parameter, uses the canonical-name table (``tp_kind``).
Both raise on a parameter they cannot place instead of treating it as replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from roll.errors import ModelError

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

Kind = Literal["column", "row", "swiglu", "replicated"]
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The tensors whose vocab dim is padded (to a multiple of make_vocab_size_divisible_by x TP)."""
_VOCAB = VOCAB_TENSORS
_COLUMN = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.bias",
           # multi-latent attention (local spec: every projection column-parallel, down-projections gathered)
           ".linear_q_proj.weight", ".linear_q_down_proj.weight", ".linear_q_up_proj.weight",
           ".linear_kv_down_proj.weight", ".linear_kv_up_proj.weight")
_SWIGLU = ".linear_fc1.weight"
_ROW = (".linear_proj.weight", ".linear_fc2.weight")
_REPLICATED = ("layernorm.weight", "layernorm.bias", ".mlp.router.weight", ".mlp.router.expert_bias",
               ".shared_experts.gate_weight", ".linear_proj.bias", ".linear_fc2.bias", "output_layer.score.weight")
"""Parameters Megatron keeps whole on every TP rank (and leaves untagged): norms, router, the
shared-expert gate, the biases of row-parallel linears (added after the reduce), and a reward model's
1-wide score head (``backends.mca.models.reward``)."""
_WHOLE_MODULES = ("visual.",)
"""Modules kept whole on every TP rank, all their parameters untagged: a vision-language model's HF vision tower
(``backends.mca.models.qwen2_5_vl``)."""


_TE_DUPLICATED = (".linear_q_down_proj.weight", ".linear_kv_down_proj.weight")
"""Under Transformer Engine, multi-latent attention's down-projections are duplicated ``TELinear``s: whole on
every TP rank (column-parallel in the local spec)."""


def _duplicated(name: str, config: McaModelConfig) -> bool:
    return config.transformer_impl == "transformer_engine" and name.endswith(_TE_DUPLICATED)


def tp_kind(name: str, config: McaModelConfig) -> Kind:
    """How the canonical Megatron parameter ``name`` is split across (expert-)tensor-parallel ranks."""
    if name.startswith(_WHOLE_MODULES) or _duplicated(name, config):
        return "replicated"
    if name in _VOCAB or name.endswith(_COLUMN):
        return "column"
    if name.endswith(_SWIGLU):
        return "swiglu" if config.gated_linear_unit else "column"
    if name.endswith(_ROW):
        return "row"
    if name.endswith(_REPLICATED):
        return "replicated"
    raise ModelError(f"Megatron parameter {name!r} has no known tensor-parallel placement. Known patterns: "
                     f"column {', '.join(_VOCAB + _COLUMN)}; swiglu *{_SWIGLU}; row *{', *'.join(_ROW)}; "
                     f"replicated *{', *'.join(_REPLICATED)}.")


def param_tp_kind(name: str, param: torch.Tensor, config: McaModelConfig) -> Kind:
    """How the live parameter ``param`` (canonical name ``name``) is split, from Megatron's tags.

    ``tensor_model_parallel`` + ``partition_dim`` 0 / 1 is column / row (the fused SwiGLU fc1,
    tagged column, keeps gate and up apart). An untagged parameter is replicated only if it is one
    Megatron keeps whole (norms, router, ...); anything else, e.g. an adapter weight nobody tagged,
    is an error: gathering it as replicated would silently write one rank's shard. A duplicated ``TELinear``
    (latent attention's down-projections under TE) is whole on every rank whatever TE tagged.
    """
    if _duplicated(name, config):
        return "replicated"
    if getattr(param, "tensor_model_parallel", False):
        dim = getattr(param, "partition_dim", None)
        if dim == 1:
            return "row"
        if dim == 0:
            return "swiglu" if name.endswith(_SWIGLU) and config.gated_linear_unit else "column"
        raise ModelError(f"parameter {name!r} is tagged tensor-parallel with partition_dim {dim!r}; only 0 (column) "
                         "and 1 (row) are supported.")
    if name.endswith(_REPLICATED) or name.startswith(_WHOLE_MODULES):
        return "replicated"
    raise ModelError(f"parameter {name!r} has no tensor-parallel tag (tensor_model_parallel / partition_dim) and is "
                     f"not one Megatron keeps replicated (*{', *'.join(_REPLICATED)}): cannot tell how its "
                     "tensor-parallel shards combine. Tag it with "
                     "megatron.core.tensor_parallel.set_tensor_model_parallel_attributes.")


def tag_tensor_parallel(chunks: list[torch.nn.Module]) -> None:
    """Tag the weights of Megatron's parallel layers the way its weight initialisation does.

    Megatron sets ``tensor_model_parallel``/``partition_dim`` on a weight only while initialising it,
    so chunks built with ``perform_initialization=False`` (the loaders overwrite every weight) lack
    them; this restores exactly those tags, from the module types. Tags already present are kept.
    """
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                dim = 0
            elif isinstance(module, RowParallelLinear):
                dim = 1
            else:
                continue
            weight = getattr(module, "weight", None)
            if weight is not None and not hasattr(weight, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(weight, True, dim, 1)


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
