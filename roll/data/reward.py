"""Stage rm's rows: the dpo pairs, with ``labels`` marking the one token each side is scored at.

A reward model reads its scalar at one position of each sequence. roll's rule is transformers' rule for
``...ForSequenceClassification`` models, so that an exported reward model scores a text exactly as it was
trained: **the rightmost token whose id is not the tokenizer's pad id** (``GenericForSequenceClassification``
pools at ``argmax(arange(L) * (input_ids != pad_token_id))``; position 0 when every token is a pad). It is
found here, once, at tokenization, and marked in ``labels`` (the token's id there, IGNORE_INDEX everywhere
else), so both backends read the same position: the standard backend's HF model pools by this rule itself
(right padding), the mca backend sums its per-position scores under the mark (``labels`` go through the
collator's padding, pipeline padding and the context-parallel split like any sequence key; the mca backend
does not shift them for this stage).

The pad == eos trap: a tokenizer without a pad token gets its eos as pad (``roll.data.tokenizer``); when the
chat template ends every answer with that eos (Llama-3's ``<|eot_id|>``), the scored token is the one before
it, on both backends and in transformers alike (a warning says so once). A pad token of its own
(``tokenizer_name_or_path``) scores the eos itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from roll import IGNORE_INDEX
from roll.data.processors import PairwiseProcessor
from roll.logging import warn_once

logger = logging.getLogger(__name__)


def scored_position(input_ids: list[int], pad_token_id: int | None) -> int:
    """Index of the token a ``...ForSequenceClassification`` model reads its score at (see the module docstring).

    Example (pad 0)::

        scored_position([5, 6, 7], 0) -> 2;  scored_position([5, 6, 0, 0], 0) -> 1;  scored_position([0, 0], 0) -> 0
    """
    if pad_token_id is None:  # transformers: the last position
        return len(input_ids) - 1
    for index in range(len(input_ids) - 1, -1, -1):
        if input_ids[index] != pad_token_id:
            return index
    return 0


def score_labels(input_ids: list[int], pad_token_id: int | None) -> list[int]:
    """IGNORE_INDEX everywhere but the scored position, which holds its token id.

    Example (pad 0)::

        score_labels([5, 6, 7], 0) -> [-100, -100, 7]
    """
    labels = [IGNORE_INDEX] * len(input_ids)
    if input_ids:
        position = scored_position(input_ids, pad_token_id)
        labels[position] = input_ids[position]
    return labels


@dataclass
class RewardProcessor(PairwiseProcessor):
    """Preference rows -> ``chosen_*`` / ``rejected_*`` as for dpo (same prompt, truncation and skips), with
    ``labels`` marking the scored token of each side (``score_labels``)."""

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out = super().__call__(batch, indices)
        pad = self.tokenizer.pad_token_id
        for side in ("chosen", "rejected"):
            rows = out[f"{side}_input_ids"]
            out[f"{side}_labels"] = [score_labels(ids, pad) for ids in rows]
            if pad is not None and any(ids and ids[-1] == pad for ids in rows):
                token = self.tokenizer.convert_ids_to_tokens(pad)
                warn_once(logger, f"stage rm: answers end in the tokenizer's pad token {token!r} (id {pad}, "
                                  "its eos when it has no pad token of its own): each side is scored at the last "
                                  "token before it, as transformers' ...ForSequenceClassification scores it. To "
                                  "score the end token itself, use a tokenizer with a pad token of its own "
                                  "(tokenizer_name_or_path).")
        return out
