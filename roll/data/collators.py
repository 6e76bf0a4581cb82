"""Collators shared by both backends: they only pad, stack and shift (masks come from the processors).

The backend's PaddingPolicy decides the padded length (longest in batch or ``max_length``, rounded
up to ``pad_to_multiple_of``), whether labels are shifted for Megatron, and whether rows are packed.
With ``shift_labels`` the padded length is chosen so that the length *after* the shift obeys the
policy (one extra position is padded and then dropped by the shift). When that padding keeps the longest row's
last token in the shifted batch (a multiple of TP or 2 x CP, ``max_length``), its attention-mask bit is 0: it
predicts nothing, and the batch then marks the positions an unshifted batch of the longest row's length does but
its last column, the tokens both backends' MoE losses count (docs/mca-training.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from roll import IGNORE_INDEX
from roll.data.feedback import FeedbackCollator
from roll.data.policy import PAIR_PREFIXES, SEQUENCE_KEYS, PaddingPolicy


def _base_key(key: str) -> str:
    for prefix in PAIR_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def shift_labels(batch: dict[str, Any], keys: tuple[str, ...] = SEQUENCE_KEYS) -> dict[str, Any]:
    """Megatron's label shift, applied once over every declared sequence key and its chosen_/rejected_ forms.

    ``labels <- labels[..., 1:]``; every other sequence key drops its last position, so position t
    is trained to predict token t+1. Works on tensors ``[B, L]`` and on plain 1-D lists.

    Example::

        shift_labels({"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "chosen_attention_mask": [1, 1, 1]})
        -> {"input_ids": [5, 6], "labels": [6, 7], "chosen_attention_mask": [1, 1]}
    """
    out = dict(batch)
    for key, value in batch.items():
        base = _base_key(key)
        if base not in keys:
            continue
        if isinstance(value, torch.Tensor):
            out[key] = value[..., 1:] if base == "labels" else value[..., :-1]
        else:
            out[key] = value[1:] if base == "labels" else value[:-1]
    return out


def target_length(longest: int, policy: PaddingPolicy) -> int:
    """Padded length before the (optional) shift, so that the length after it follows the policy."""
    extra = 1 if policy.shift_labels else 0
    wanted = policy.max_length if policy.pad_to == "max_length" else max(longest - extra, 1)
    if longest - extra > wanted:
        raise ValueError(f"a row has {longest} tokens, longer than the policy's max_length "
                         f"{policy.max_length}; "
                         "the processors truncate to cutoff_len, so max_length must be cutoff_len")
    multiple = policy.pad_to_multiple_of
    return -(-wanted // multiple) * multiple + extra


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries over the flattened ``[B * L]`` token stream: a segment starts where position is 0.

    Each row starts a segment; a padding tail (positions restarting at 0) is a segment of its own.
    """
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0, as_tuple=False).flatten()
    row_starts = torch.arange(0, flat.numel(), position_ids.shape[-1])
    starts = torch.unique(torch.cat([starts, row_starts]))
    return torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)


def pad_segments(feature: dict[str, Any], multiple: int, pad_token_id: int) -> dict[str, list[int]]:
    """Pad every packed sample of a row (found from position_ids) to a multiple of ``multiple`` tokens.

    Example (multiple 2, pad 0)::

        {"input_ids": [5, 6, 7], "labels": [-100, 6, -100], "position_ids": [0, 1, 0]}
        -> {"input_ids": [5, 6, 7, 0], "labels": [-100, 6, -100, -100], "position_ids": [0, 1, 0, 1]}
    """
    ids = [int(t) for t in feature["input_ids"]]
    labels = [int(t) for t in feature["labels"]]
    positions = [int(t) for t in _get(feature, "position_ids", lambda n: list(range(n)))]
    starts = [i for i, p in enumerate(positions) if p == 0 or i == 0] + [len(ids)]
    out: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for begin, end in zip(starts, starts[1:]):
        n = end - begin
        pad = -n % multiple
        out["input_ids"] += ids[begin:end] + [pad_token_id] * pad
        out["labels"] += labels[begin:end] + [IGNORE_INDEX] * pad
        out["position_ids"] += list(range(n + pad))
    return out


@dataclass
class SequenceCollator:
    """Pads pt/sft rows to the policy's length (right padding) and returns torch tensors.

    Example (``pad_token_id=0``, default policy)::

        [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
         {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [-100, 9]}]
        -> {"input_ids": [[5, 6, 7], [8, 9, 0]],
            "attention_mask": [[1, 1, 1], [1, 1, 0]],
            "labels": [[-100, 6, 7], [-100, 9, -100]]}

    With ``policy.packing`` rows carry ``position_ids`` restarting at 0 per packed sample; the
    batch has ``input_ids``, ``labels``, ``position_ids`` (padding tail restarts at 0, so it is its
    own segment) and ``cu_seqlens`` (int32 boundaries over the flattened batch), no attention_mask.
    ``pad_to_multiple_of`` then applies to every packed sample too (context parallelism splits each
    sample of a THD batch into 2 * CP chunks): a sample is padded at its end, positions continuing,
    labels IGNORE_INDEX (causal attention: its real tokens never see that padding)::

        [{"input_ids": [5, 6, 7], "labels": [-100, 6, -100], "position_ids": [0, 1, 0]}]  (policy
        pad_to_multiple_of=2, packing=True)
        -> {"input_ids": [[5, 6, 7, 0]], "labels": [[-100, 6, -100, -100]],
            "position_ids": [[0, 1, 0, 1]], "cu_seqlens": [0, 2, 4]}
    """

    pad_token_id: int
    policy: PaddingPolicy = field(default_factory=PaddingPolicy)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        if self.policy.packing and self.policy.pad_to_multiple_of > 1:
            features = [pad_segments(f, self.policy.pad_to_multiple_of, self.pad_token_id) for f in features]
        longest = max(len(f["input_ids"]) for f in features)
        length = target_length(longest, self.policy)
        batch = {
            "input_ids": _pad([f["input_ids"] for f in features], length, self.pad_token_id),
            "labels": _pad([f["labels"] for f in features], length, IGNORE_INDEX),
        }
        if self.policy.packing:
            positions = [_get(f, "position_ids", lambda n: list(range(n))) for f in features]
            batch["position_ids"] = torch.stack([_positions(p, length) for p in positions])
        else:
            if any(f.get("seq_lens") is not None for f in features):
                raise ValueError("these rows are packed (they carry seq_lens) but the padding policy has "
                                 "packing off: attention would cross samples. Build it with packing=True.")
            batch["attention_mask"] = _pad([_get(f, "attention_mask", lambda n: [1] * n) for f in features],
                                           length, 0)
        if self.policy.shift_labels:
            batch = shift_labels(batch)
            if "attention_mask" in batch and length - 1 > longest - 1:
                # the columns the unshifted batch of the longest row has (the standard backend's), less its last:
                # a real token the policy's extra padding keeps in the shifted batch (the longest row's last)
                # predicts nothing, and the MoE losses must not count it (docs/mca-training.md, which tokens)
                batch["attention_mask"][:, longest - 1:] = 0
        if self.policy.packing:
            batch["cu_seqlens"] = cu_seqlens_from_positions(batch["position_ids"])
        return batch


@dataclass
class PairwiseCollator:
    """Stacks chosen then rejected rows into one padded batch of 2B rows (chosen first).

    Example (``pad_token_id=0``, default policy)::

        [{"chosen_input_ids": [5, 6, 7], "chosen_attention_mask": [1, 1, 1], "chosen_labels": [-100, 6, 7],
          "rejected_input_ids": [5, 8], "rejected_attention_mask": [1, 1], "rejected_labels": [-100, 8]}]
        -> {"input_ids": [[5, 6, 7], [5, 8, 0]],
            "attention_mask": [[1, 1, 1], [1, 1, 0]],
            "labels": [[-100, 6, 7], [-100, 8, -100]]}
    """

    pad_token_id: int
    policy: PaddingPolicy = field(default_factory=PaddingPolicy)

    def __post_init__(self) -> None:
        if self.policy.packing:
            raise ValueError("packing is not supported for pairwise (dpo) batches; set packing: false")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [{key: f[f"{side}_{key}"] for key in ("input_ids", "attention_mask", "labels")}
                for side in ("chosen", "rejected") for f in features]
        return SequenceCollator(self.pad_token_id, self.policy)(rows)


def _get(feature: dict[str, Any], key: str, default: Callable[[int], list[int]]):
    """feature[key], or default(len(input_ids)) when the row has no such key (e.g. unpacked eval rows)."""
    value = feature.get(key)
    return default(len(feature["input_ids"])) if value is None else value


def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def _positions(positions: list[int], length: int) -> torch.Tensor:
    positions = torch.as_tensor(positions, dtype=torch.long)
    tail = torch.arange(length - len(positions))  # padding: its own segment, restarting at 0
    return torch.cat([positions, tail])


COLLATORS = {"SequenceCollator": SequenceCollator, "PairwiseCollator": PairwiseCollator,
             "FeedbackCollator": FeedbackCollator}


def build_collator(name: str, tokenizer, policy: PaddingPolicy, data_args=None, vision=None):
    """The collator class ``name`` (from the router's stage table) for this tokenizer and policy; with ``vision``
    (a VL model) it adds the micro-batch's images (roll.data.vision.VisionCollator)."""
    if name not in COLLATORS:
        raise ValueError(f"unknown collator {name!r}; known: {', '.join(COLLATORS)}")
    if policy.pad_to == "max_length" and data_args is not None and policy.max_length != data_args.cutoff_len:
        raise ValueError(f"policy max_length {policy.max_length} != cutoff_len {data_args.cutoff_len}")
    extra = {}
    if name == "FeedbackCollator" and data_args is not None:
        extra = {"cutoff_len": data_args.cutoff_len, "named_template": data_args.template is not None}
    collator = COLLATORS[name](pad_token_id=tokenizer.pad_token_id, policy=policy, **extra)
    if vision is not None:
        from roll.data.vision import VisionCollator

        return VisionCollator(base=collator, vision=vision)
    return collator
