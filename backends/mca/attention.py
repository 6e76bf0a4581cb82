"""Core attention for the local (non-TE) spec that also handles packed sequences and CP.

Megatron's ``DotProductAttention`` asserts on both: context parallelism ("only supported by
TEDotProductAttention") and packed THD sequences. ``LocalCoreAttention`` runs PyTorch's SDPA: with its
fused causal kernel for roll's plain batches (causal, no mask: right padding cannot reach a real token),
the parent's code for any other plain-batch mask, and with an explicit mask built from *global token
indices* for packed sequences and CP:

- every local token has an index into the full (unsplit) sequence or pack. With CP, rank ``r``
  holds Megatron's load-balanced chunks ``r`` and ``2*cp-1-r`` of each sequence (of the whole
  sequence for [s, b] batches, of every packed sequence for THD);
- K/V are all-gathered over the CP group (backward: all-reduce, keep own slice), so keys carry
  the indices of all ranks' tokens;
- a query may see a key iff both lie in the same packed sequence and key index <= query index
  (block-diagonal causal).

Packed sequences without CP and without an explicit mask (roll's packed batches) take a cheaper form of the same
attention (``PackedWindows``): whole packed sequences are gathered into windows of the longest sequence's length
(at least ``WINDOW_MIN``; first fit), so one batched SDPA call computes ``windows x size^2`` scores instead of the
stream's ``t^2`` (at seq 256, two rows of short samples: a fifth), with a block-diagonal causal mask per window. A
query sees exactly the keys it saw before; only the order of the sums inside the kernel differs (rounding). The
windows are planned once per forward from ``cu_seqlens`` (one host read of them per forward, not per layer) and
shared by every layer.

This checks the data plumbing (CP batch split, PackedSeqParams, CP-aware RoPE) on CPU; it is
O(s^2) memory and not a replacement for TE's ring attention on GPUs.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward sums every rank's grads and keeps our slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce_scatter
        return grad.chunk(dist.get_world_size(ctx.group), dim=0)[dist.get_rank(ctx.group)], None


def cp_token_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global indices of the tokens CP rank ``cp_rank`` holds, in its local order.

    ``cu_seqlens`` are the (padded) boundaries of the full pack, ``[0, s]`` for one sequence.
    Each sequence is cut into ``2*cp_size`` equal chunks; the rank holds chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` (Megatron's load balancing for causal attention).
    Example: cu_seqlens [0, 8], cp 2, rank 0 -> [0, 1, 6, 7]; rank 1 -> [2, 3, 4, 5].
    """
    bounds = cu_seqlens.tolist()
    if cp_size == 1:
        return torch.arange(bounds[0], bounds[-1])
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(f"with context_parallel_size {cp_size} every sequence length must be divisible by "
                             f"2 * cp = {2 * cp_size}; got a sequence of {length} tokens (pad the sequences).")
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts)


WINDOW_MIN = 64
"""Smallest window of ``PackedWindows`` (tokens): below it the per-window overhead outweighs the scores saved."""


@dataclass(frozen=True)
class PackedWindows:
    """A packed stream's sequences gathered into ``count`` windows of ``size`` slots, whole sequences each.

    ``gather`` [count * size]: the stream token in each slot (a padding slot repeats token 0 and attends only to
    itself, so its row is never empty; its output is dropped). ``scatter`` [t]: the slot of each stream token.
    ``allowed`` [count, 1, size, size]: True where a slot may attend to a slot (same sequence, key not after query).
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    allowed: torch.Tensor
    count: int
    size: int

    @staticmethod
    def plan(cu_seqlens: list[int], device: torch.device | str = "cpu") -> Optional["PackedWindows"]:
        """Windows for the sequences bounded by ``cu_seqlens`` (first fit, in stream order); None when they would
        compute as many scores as the whole stream at once (one long sequence, or one window anyway) or do not
        cover it from token 0."""
        lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]) if end > start]
        total = cu_seqlens[-1]  # THD streams start at 0
        size = max([WINDOW_MIN, *lengths])
        windows: list[list[int]] = []  # the start of each sequence, per window
        fill: list[int] = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if end == start:
                continue
            w = next((w for w, used in enumerate(fill) if used + end - start <= size), len(windows))
            if w == len(windows):
                windows.append([])
                fill.append(0)
            windows[w].append(start)
            fill[w] += end - start
        if len(windows) * size * size >= total * total or sum(lengths) != total:
            return None
        gather = torch.zeros(len(windows) * size, dtype=torch.long)
        scatter = torch.empty(total, dtype=torch.long)
        sequence = torch.arange(len(windows) * size).neg_().sub_(1)  # a padding slot: a sequence of its own
        ends = dict(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        for w, starts in enumerate(windows):
            slot = w * size
            for number, start in enumerate(starts):
                length = ends[start] - start
                gather[slot:slot + length] = torch.arange(start, start + length)
                sequence[slot:slot + length] = number
                slot += length
        real = sequence >= 0
        scatter[gather[real]] = torch.nonzero(real).squeeze(1)
        sequence = sequence.view(len(windows), size)
        causal = torch.ones(size, size, dtype=torch.bool).tril_()
        allowed = (sequence[:, :, None] == sequence[:, None, :]) & causal
        return PackedWindows(gather.to(device), scatter.to(device), allowed[:, None].to(device), len(windows), size)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Stream [t, h, d] -> windows [size, count, h, d] (the [s, b, h, d] layout of a plain batch)."""
        return x.index_select(0, self.gather).view(self.count, self.size, *x.shape[1:]).transpose(0, 1)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """Windows [size, count, h, d] -> stream [t, h, d]."""
        return x.transpose(0, 1).reshape(self.count * self.size, *x.shape[2:]).index_select(0, self.scatter)


_planned: tuple[object, Optional[PackedWindows]] | None = None
"""(the ``cu_seqlens`` tensor of the forward being run, its windows): every layer of a forward gets the same
PackedSeqParams, so the plan is made by the first layer and reused by the others."""


def packed_windows(cu_seqlens: torch.Tensor) -> Optional[PackedWindows]:
    """``PackedWindows.plan`` for ``cu_seqlens``, once per tensor (the one host read of it in a forward)."""
    global _planned
    if _planned is None or _planned[0] is not cu_seqlens:
        _planned = (cu_seqlens, PackedWindows.plan(cu_seqlens.tolist(), cu_seqlens.device))
    return _planned[1]


class LocalCoreAttention(DotProductAttention):
    """``DotProductAttention`` plus packed THD sequences and context parallelism (any device)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None, pg_collection=None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        # Multi-latent attention passes its q/k and v head sizes (megatron-core 0.16's DotProductAttention takes
        # neither: Megatron-LM #1589). The matmuls follow the tensors' own head sizes; the parent sizes only its
        # output, heads x kv_channels, which must then be the v head size (the MLA templates set it so).
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"LocalCoreAttention: v_channels ({v_channels}) must equal kv_channels "
                             f"({config.kv_channels}), the width of each head's output.")
        if config.context_parallel_size > 1:
            # The parent asserts CP == 1 and uses nothing else CP-related; CP is handled in forward.
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        else:
            parent_config = config
        super().__init__(parent_config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)
        self.config = config
        self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
        # DotProductAttention divides softmax_scale by the layer number under query-key layer
        # scaling and multiplies it back inside its softmax; SDPA needs the net scale.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)
        self.dropout_p = self.attention_dropout.p

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is None and self.cp_group is None:
            if (attention_mask is None and attention_bias is None and self.softmax_offset is None
                    and mask_type == AttnMaskType.causal):
                # roll's batches (right-padded, causal): SDPA's fused causal kernel instead of the parent's
                # baddbmm + masked softmax + bmm over a materialised [b, h, s, s] score tensor.
                out = self._sdpa(query, key, value, allowed=None)
                return out.reshape(out.shape[0], out.shape[1], -1)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if attention_bias is not None or self.softmax_offset is not None:
            raise ValueError("LocalCoreAttention supports neither attention_bias nor softmax offsets with packed "
                             "sequences or context parallelism.")
        packed = packed_seq_params is not None
        if packed and packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences must use qkv_format 'thd', got {packed_seq_params.qkv_format!r}.")
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"LocalCoreAttention handles causal attention only with packed sequences or context "
                             f"parallelism; got attn_mask_type {mask_type.name}.")
        if packed and self.cp_group is None and attention_mask is None:
            cu = packed_seq_params.cu_seqlens_q_padded
            windows = packed_windows(packed_seq_params.cu_seqlens_q if cu is None else cu)
            if windows is not None and windows.scatter.numel() == query.shape[0]:
                out = self._sdpa(*(windows.split(t) for t in (query, key, value)), windows.allowed)
                return windows.merge(out).flatten(1)  # [t, h * dv]
        if packed:  # [t, h, d] -> [t, 1, h, d]: one code path for both layouts
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        allowed = self._allowed(query.shape[0], packed_seq_params, attention_mask, query.device)
        if self.cp_group is not None:
            key = _AllGatherSeq.apply(key, self.cp_group)
            value = _AllGatherSeq.apply(value, self.cp_group)
        out = self._sdpa(query, key, value, allowed)  # [s, b, h, dv]
        s, b = out.shape[:2]
        return out.reshape(s, -1) if packed else out.reshape(s, b, -1)

    def _allowed(self, local_len: int, packed_seq_params: Optional[PackedSeqParams],
                 attention_mask: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Boolean [.., sq, sk] mask on ``device``, True where a query may attend to a key."""
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        rank = 0 if self.cp_group is None else dist.get_rank(self.cp_group)
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            cu = cu.to("cpu", torch.long)
        else:
            cu = torch.tensor([0, local_len * cp])
        q_index = cp_token_index(cu, cp, rank)
        k_index = torch.cat([cp_token_index(cu, cp, r) for r in range(cp)])
        if q_index.numel() != local_len:
            raise ValueError(f"this rank holds {local_len} tokens but cu_seqlens {cu.tolist()} with cp {cp} give "
                             f"{q_index.numel()}; the packed batch and its cu_seqlens disagree.")
        segment = lambda idx: torch.searchsorted(cu, idx, right=True)  # noqa: E731 - sequence id of a token
        allowed = (segment(q_index)[:, None] == segment(k_index)[None, :]) & (q_index[:, None] >= k_index[None, :])
        allowed = allowed.to(device)
        if attention_mask is not None:
            # Megatron's mask is True = masked; its key axis is in global order, ours in gathered order.
            key_order = k_index.to(attention_mask.device)
            allowed = allowed & ~(attention_mask[..., key_order] if cp > 1 else attention_mask).bool()
        return allowed

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              allowed: Optional[torch.Tensor]) -> torch.Tensor:
        """SDPA over [s, b, h, d] inputs; ``allowed`` None means plain causal attention."""
        rep = query.shape[2] // key.shape[2]
        if rep > 1:  # GQA: [sk, b, ng, d] -> [sk, b, np, d]
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        # The same RNG stream choice as DotProductAttention: the TP-rank-specific tracker unless SP.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if not self.config.sequence_parallel else nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 is_causal=allowed is None, scale=self.sdpa_scale)
        return out.permute(2, 0, 1, 3)  # [sq, b, h, dv]
