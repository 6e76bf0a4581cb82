"""The padding policy: declared by a backend, obeyed by the shared collators."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # roll.data does not import roll.config at run time (it pulls in transformers)
    from roll.config.layout import ParallelLayout

SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
"""Per-token keys of a sample; pairwise rows carry them with the PAIR_PREFIXES."""

PAIR_PREFIXES = ("chosen_", "rejected_")
"""Key prefixes of the two sides of a preference pair (dpo rows)."""


@dataclass(frozen=True)
class PaddingPolicy:
    """How the shared collators must shape a batch for one backend.

    The standard backend uses the defaults (pad to the longest sample, HF shifts labels inside the
    model). The Megatron backend derives the rest from its layout: ``max_length`` under expert
    parallelism with the allgather dispatcher, a multiple of TP with sequence parallelism, a
    multiple of 2 * CP with context parallelism, and ``shift_labels`` because Megatron's GPT
    model does not shift.
    """

    pad_to: Literal["longest", "max_length"] = "longest"
    max_length: int | None = None
    """Target length for pad_to='max_length' (the recipe's cutoff_len)."""
    pad_to_multiple_of: int = 1
    shift_labels: bool = False
    """Shift once in the collator: labels <- labels[1:], other sequence keys drop their last position."""
    packing: bool = False
    """Rows are packed: emit position_ids restarting per sample and segment boundaries, no attention_mask."""

    def __post_init__(self) -> None:
        if self.pad_to == "max_length" and not self.max_length:
            raise ValueError("PaddingPolicy(pad_to='max_length') needs max_length")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")

    @classmethod
    def for_megatron(cls, layout: ParallelLayout, *, cutoff_len: int, moe_token_dispatcher: str = "alltoall",
                     packing: bool = False) -> "PaddingPolicy":
        """The Megatron backend's policy for ``layout`` (DESIGN.md section 4).

        - labels are shifted in the collator (Megatron's GPT model does not shift);
        - sequence parallelism (``layout.sequence_parallel``, already resolved by the layout's rule)
          splits the sequence over TP ranks: length a multiple of TP;
        - context parallelism splits it into 2 * CP chunks (load balancing): a multiple of 2 * CP;
        - expert parallelism with the allgather dispatcher needs equal token counts on every rank of
          the EP group: pad to cutoff_len (alltoall does not). The default dispatcher is the recipe
          default (``MegatronArguments.moe_token_dispatcher_type``; a unit test keeps them equal).
        """
        multiple = math.lcm(layout.tp if layout.sequence_parallel else 1, 2 * layout.cp if layout.cp > 1 else 1)
        equal_lengths = layout.ep > 1 and moe_token_dispatcher == "allgather"
        return cls(pad_to="max_length" if equal_lengths else "longest", max_length=cutoff_len,
                   pad_to_multiple_of=multiple, shift_labels=True, packing=packing)
