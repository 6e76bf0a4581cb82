"""Sequence packing: tokenized samples -> rows of at most cutoff_len tokens, never splitting a sample.

Bins are filled best-fit decreasing (each sample, longest first, goes into the fullest bin that
still has room), which for chat-length samples reaches > 95% of slots. A packed row holds
``input_ids``, ``labels`` (each sample's first label is already IGNORE_INDEX, so no label crosses a
boundary), ``position_ids`` restarting at 0 per sample, and ``seq_lens`` (sample lengths in order).
The collator turns position_ids into ``cu_seqlens``; HF models read the same boundaries from
position_ids, Megatron's THD format from cu_seqlens.
"""

from __future__ import annotations

import bisect
import hashlib

from roll.errors import DataError


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose sums are <= capacity (bins in creation order).

    Example: ``best_fit_decreasing([3, 5, 2, 4], 7) -> [[1, 2], [3, 0]]``.
    """
    too_long = next((i for i, n in enumerate(lengths) if n > capacity), None)
    if too_long is not None:
        raise DataError(f"sample {too_long} has {lengths[too_long]} tokens, "
                        f"more than the bin size {capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin id), sorted: the first fit found is the best fit
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        pos = bisect.bisect_left(free, (need, -1))
        if pos < len(free):
            room, bin_id = free.pop(pos)
        else:
            room, bin_id = capacity, len(bins)
            bins.append([])
        bins[bin_id].append(index)
        if room - need > 0:
            bisect.insort(free, (room - need, bin_id))
    return bins


def sample_lengths(dataset, column: str = "input_ids") -> list[int]:
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")[column]).to_pylist()


class _Gather:
    """Batched map function: bins of sample indices -> packed rows."""

    def __init__(self, source) -> None:
        self.source = source

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "seq_lens": []}
        flat = [i for bin_ in batch["_bin"] for i in bin_]
        rows = self.source.select_columns(["input_ids", "labels"])[flat]
        cursor = 0
        for bin_ in batch["_bin"]:
            ids, labels, positions, lens = [], [], [], []
            for k in range(cursor, cursor + len(bin_)):
                ids += rows["input_ids"][k]
                labels += rows["labels"][k]
                positions += range(len(rows["input_ids"][k]))
                lens.append(len(rows["input_ids"][k]))
            cursor += len(bin_)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(positions)
            out["seq_lens"].append(lens)
        return out


def pack_dataset(dataset, capacity: int, num_proc: int | None = None):
    """Pack a tokenized pt/sft dataset into rows of <= capacity tokens; returns (packed, efficiency)."""
    import datasets

    lengths = sample_lengths(dataset)
    bins = best_fit_decreasing(lengths, capacity)
    efficiency = sum(lengths) / (len(bins) * capacity) if bins else 0.0
    fingerprint = hashlib.sha256(f"{dataset._fingerprint}-bfd-{capacity}".encode()).hexdigest()[:16]
    packed = datasets.Dataset.from_dict({"_bin": bins}).map(
        _Gather(dataset), batched=True, batch_size=256, remove_columns=["_bin"], num_proc=num_proc,
        new_fingerprint=fingerprint, desc=f"Packing into {capacity}-token rows")
    return packed, efficiency
