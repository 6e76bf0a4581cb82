"""Typed HF <-> Megatron weight mapping kinds, on *global* (unsharded, unpadded) tensors.

A mapping names HF and Megatron parameters with ``{layer}`` / ``{expert}`` placeholders (and ``{block}``, a block of
a vision tower, which is no decoder layer: it lives whole on the first pipeline stage). Each kind
is a pair of exact inverses (``to_mca``/``to_hf``), so a template built from them round-trips
bit-for-bit. TP/PP/EP placement is not here: it lives in ``sharding.py``, shared by all families.
Megatron names are in the canonical *local-spec* layout; ``layout.py`` renames to TE's fused names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

_PLACEHOLDER = re.compile(r"\{(layer|expert|block)\}")


def compile_pattern(pattern: str) -> re.Pattern:
    """``model.layers.{layer}.x`` -> a regex with named groups for the placeholders."""
    parts, pos = [], 0
    for m in _PLACEHOLDER.finditer(pattern):
        parts.append(re.escape(pattern[pos:m.start()]))
        parts.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts) + r"\Z")


@dataclass(frozen=True)
class Mapping:
    """Base kind: ``hf`` names (one or more) <-> one Megatron name."""

    hf: tuple[str, ...]
    mca: str

    def to_mca(self, tensors: list[torch.Tensor], config: McaModelConfig) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement to_mca")

    def to_hf(self, tensor: torch.Tensor, config: McaModelConfig) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement to_hf")

    def slots(self, out: torch.Tensor, config: McaModelConfig) -> list[list[torch.Tensor]] | None:
        """Where each HF tensor's elements go inside ``out`` (the whole Megatron tensor): for each HF input,
        in ``hf`` order, contiguous views of ``out`` that its elements fill in their own order, so a loader
        can read the file's bytes straight into the parameter (what ``to_mca`` would have put there, without
        its copy). None: only through ``to_mca``."""
        return None


class Rename(Mapping):
    """1:1, same tensor (embeddings, norms, o_proj, down_proj, router)."""

    def __init__(self, hf: str, mca: str) -> None:
        super().__init__((hf,), mca)

    def to_mca(self, tensors, config):
        return tensors[0]

    def to_hf(self, tensor, config):
        return [tensor]

    def slots(self, out, config):
        return [[out]]


class QKV(Mapping):
    """q, k, v -> Megatron's fused ``linear_qkv``, interleaved per query group.

    Megatron stores ``[g0: q(nh/ng heads), k, v | g1: ...]`` so that a dim-0 TP split hands each
    rank whole KV groups. Works for weights ``[out, hidden]`` and biases ``[out]`` alike.
    """

    def __init__(self, q: str, k: str, v: str, mca: str) -> None:
        super().__init__((q, k, v), mca)

    @staticmethod
    def _dims(config) -> tuple[int, int, int]:
        groups = config.num_query_groups or config.num_attention_heads
        return groups, config.num_attention_heads // groups, config.kv_channels

    def to_mca(self, tensors, config):
        q, k, v = tensors
        groups, q_per_group, head_dim = self._dims(config)
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(groups, q_per_group * head_dim, *rest),
                           k.reshape(groups, head_dim, *rest),
                           v.reshape(groups, head_dim, *rest)], dim=1)  # [ng, (nh/ng + 2) * d, ...]
        return fused.reshape(-1, *rest)

    def slots(self, out, config):
        groups, q_per_group, head_dim = self._dims(config)
        fused = out.view(groups, (q_per_group + 2) * head_dim, *out.shape[1:])  # [ng, (nh/ng + 2) * d, ...]
        bounds = (0, q_per_group * head_dim, (q_per_group + 1) * head_dim, (q_per_group + 2) * head_dim)
        return [[fused[g, begin:end] for g in range(groups)] for begin, end in zip(bounds, bounds[1:])]

    def to_hf(self, tensor, config):
        groups, q_per_group, head_dim = self._dims(config)
        rest = tensor.shape[1:]
        fused = tensor.reshape(groups, (q_per_group + 2) * head_dim, *rest)
        q, k, v = fused.split([q_per_group * head_dim, head_dim, head_dim], dim=1)
        return [q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()]


class GateUp(Mapping):
    """gate_proj, up_proj -> ``linear_fc1`` = [gate; up] (TP later splits gate and up separately)."""

    def __init__(self, gate: str, up: str, mca: str) -> None:
        super().__init__((gate, up), mca)

    def to_mca(self, tensors, config):
        return torch.cat(tensors, dim=0)

    def slots(self, out, config):
        return [[half] for half in out.chunk(2, dim=0)]

    def to_hf(self, tensor, config):
        gate, up = tensor.chunk(2, dim=0)
        return [gate.contiguous(), up.contiguous()]


@dataclass(frozen=True)
class Match:
    """A concrete name resolved against a mapping: the mapping plus its placeholder values."""

    mapping: Mapping
    index: dict

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name.format(**self.index) for name in self.mapping.hf)

    @property
    def mca_name(self) -> str:
        return self.mapping.mca.format(**self.index)
