"""Sequence packing: tokenized samples -> rows of at most cutoff_len tokens, never splitting a sample.

Bins are filled best-fit decreasing (each sample, longest first, goes into the fullest bin that
still has room), which for chat-length samples reaches > 95% of slots. A packed row holds
``input_ids``, ``labels`` (each sample's first label is already IGNORE_INDEX, so no label crosses a
boundary), ``position_ids`` restarting at 0 per sample, and ``seq_lens`` (sample lengths in order); a vision-language model's
rows also ``images``, their samples' image paths concatenated in the packed order (roll.data.vision).
The collator turns position_ids into ``cu_seqlens``; HF models read the same boundaries from
position_ids, Megatron's THD format from cu_seqlens.

The packed rows are written once to an Arrow file in the datasets cache (``HF_DATASETS_CACHE/roll-packed``),
named by a fingerprint of the tokenized dataset, the bin size and this module's code, and memory-mapped: a
second start, and every other rank of the node (which waits for local rank 0, ``local_rank0_first``),
loads the file instead of packing again, and no rank holds the packed rows in its own memory.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import os
import sys
import uuid

import numpy as np

from roll.data.fingerprint import code_digest, settings_digest
from roll.errors import DataError

logger = logging.getLogger(__name__)

ALGORITHM = "bfd"
"""Name of the bin-filling rule, part of the cache key."""

PT_LLAMAFACTORY_PACKING = ("packing_algorithm: llamafactory: LLaMA-Factory's pt packing concatenates the texts of "
                           "each tokenization batch and cuts them into cutoff_len rows, which is roll's stage pt with "
                           "packing: false; set packing: false (or packing_algorithm: best_fit).")
"""Why stage pt refuses LLaMA-Factory's packing (at config time and in the data pipeline)."""

TOKENS_PER_WRITE = 1 << 22
"""Tokens gathered per Arrow record batch while writing packed rows: bounds the memory the writing takes."""


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose sums are <= capacity (bins in creation order).

    Example: ``best_fit_decreasing([3, 5, 2, 4], 7) -> [[1, 2], [3, 0]]``.
    """
    members, bin_sizes = pack_bins(np.asarray(lengths, dtype=np.int64), capacity)
    bounds = np.cumsum(bin_sizes)
    return [part.tolist() for part in np.split(members, bounds[:-1])] if len(bin_sizes) else []


def llamafactory_bins(lengths, capacity: int) -> list[list[int]]:
    """LLaMA-Factory 0.9.5's greedy packing of one tokenization batch (its ``greedy_knapsack``): bins in creation
    order, each filled largest-first with the longest remaining sample that still fits; among samples of one
    length the last one in the batch goes first (LLaMA-Factory pops the length's index list).

    Example: ``llamafactory_bins([3, 5, 2, 4, 2], 7) -> [[1, 4], [3, 0], [2]]``.
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise DataError(f"sample {too_long[0]} has {lengths[too_long[0]]} tokens, more than the bin size {capacity}")
    by_length: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        by_length.setdefault(length, []).append(index)
    left = sorted(lengths)
    bins = []
    while left:
        room, members = capacity, []
        while (fits := bisect.bisect_right(left, room)) > 0:
            length = left.pop(fits - 1)
            members.append(by_length[length].pop())
            room -= length
        bins.append(members)
    return bins


def llamafactory_batches(count: int, batch_size: int, workers: int | None) -> list[tuple[int, int]]:
    """(start, end) of the tokenization batches LLaMA-Factory packs one by one: ``datasets.map`` splits the rows
    into ``workers`` contiguous shards (at most one per row) and each shard into batches of ``batch_size``."""
    shards = max(1, min(workers or 1, count))
    per_shard, extra = divmod(count, shards)
    spans = []
    for shard in range(shards):
        start = shard * per_shard + min(shard, extra)
        end = start + per_shard + (1 if shard < extra else 0)
        spans += [(first, min(first + batch_size, end)) for first in range(start, end, batch_size)]
    return spans


def pack_llamafactory(lengths: np.ndarray, capacity: int, batch_size: int,
                      workers: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``llamafactory_bins`` per tokenization batch (``llamafactory_batches``), in the layout of ``pack_bins``."""
    members, bin_sizes = [], []
    for start, end in llamafactory_batches(len(lengths), batch_size, workers):
        for members_of_bin in llamafactory_bins(lengths[start:end].tolist(), capacity):
            members += [start + i for i in members_of_bin]
            bin_sizes.append(len(members_of_bin))
    return np.asarray(members, dtype=np.int64), np.asarray(bin_sizes, dtype=np.int64)


def pack_bins(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing on an int array: (sample indices grouped by bin, in bin creation order and each bin
    in filling order; number of samples per bin).

    Samples are taken longest first (ties: lower index first); each goes into the bin with the least room
    that still fits it (ties: the older bin), else opens a bin. The open bins are kept per room value (a
    heap of bin ids each, plus the sorted list of room values in use, at most ``capacity`` long), so the
    state is one int per open bin and nothing per sample but its bin id in an array.
    """
    too_long = np.flatnonzero(lengths > capacity)
    if too_long.size:
        first = int(too_long[0])
        raise DataError(f"sample {first} has {int(lengths[first])} tokens, more than the bin size {capacity}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    bin_of = np.empty(len(lengths), dtype=np.int64)
    rooms: list[int] = []  # room values that some open bin has, sorted
    by_room: dict[int, list[int]] = {}  # room -> heap of bin ids with that room
    opened = 0
    for position, need in _enumerate_ints(lengths[order]):
        at = bisect.bisect_left(rooms, need)
        if at < len(rooms):
            room = rooms[at]
            heap = by_room[room]
            bin_id = heapq.heappop(heap)
            if not heap:
                del rooms[at], by_room[room]
        else:
            room, bin_id = capacity, opened
            opened += 1
        bin_of[position] = bin_id
        left = room - need
        if left > 0:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            heapq.heappush(by_room[left], bin_id)
    grouped = np.argsort(bin_of, kind="stable")  # by bin, each bin in filling order
    return order[grouped], np.bincount(bin_of, minlength=opened)


def _enumerate_ints(values: np.ndarray, block: int = 1 << 16):
    """enumerate() over an int array as Python ints, converted a block at a time (not one list of all)."""
    for start in range(0, len(values), block):
        yield from enumerate(values[start:start + block].tolist(), start)


def sample_lengths(dataset, column: str = "input_ids") -> np.ndarray:
    """Row lengths of a list column, in the dataset's row order, read from the list offsets of its (memory-
    mapped) table and reordered by its indices mapping: the values are never copied into memory."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.data.column(column)).to_numpy().astype(np.int64)
    indices = dataset._indices
    return lengths if indices is None else lengths[indices.column(0).to_numpy()]


def pack_dataset(dataset, capacity: int, *, use_cache: bool = True, llamafactory: tuple[int, int | None] | None = None):
    """Pack a tokenized pt/sft dataset into rows of <= capacity tokens; returns (packed, efficiency).

    ``llamafactory``: (preprocessing_batch_size, preprocessing_num_workers) to pack as LLaMA-Factory does
    (``pack_llamafactory``); None: best-fit decreasing over all rows. The packed dataset is memory-mapped from its
    cache file, written here unless a run before wrote it (``use_cache=False``: write it again).
    """
    import datasets

    name = f"{packed_fingerprint(dataset, capacity, llamafactory)}.arrow"
    path = os.path.join(datasets.config.HF_DATASETS_CACHE, "roll-packed", name)
    if not (use_cache and os.path.isfile(path)):
        _write_packed(dataset, capacity, path, llamafactory)
    else:
        logger.info("packing: reusing %s", path)
    packed = datasets.Dataset.from_file(path)
    return packed, efficiency(packed, capacity)


def packed_fingerprint(dataset, capacity: int, llamafactory: tuple[int, int | None] | None = None) -> str:
    """Cache key: the tokenized dataset (datasets' own fingerprint of it, in its row order), the bin size, the
    bin rule (with LLaMA-Factory's its batches) and this module's code (a changed packing never reuses an old
    file)."""
    this_module = sys.modules[__name__]
    rule = ALGORITHM if llamafactory is None else f"llamafactory:{llamafactory[0]}:{llamafactory[1]}"
    return settings_digest(dataset._fingerprint, str(capacity), rule, code_digest(this_module))


def efficiency(packed, capacity: int) -> float:
    """Real tokens / (rows * capacity), read from the packed rows' lengths."""
    if len(packed) == 0:
        return 0.0
    return float(sample_lengths(packed).sum()) / (len(packed) * capacity)


def packed_features(images: bool = False):
    """The packed rows' schema (the one ``datasets.map`` inferred when packing went through it), with ``images``
    for a vision-language model's rows."""
    import datasets

    features = {"input_ids": datasets.List(datasets.Value("int32")),
                "labels": datasets.List(datasets.Value("int64")),
                "position_ids": datasets.List(datasets.Value("int64")),
                "seq_lens": datasets.List(datasets.Value("int64"))}
    if images:
        features["images"] = datasets.List(datasets.Value("string"))
    return datasets.Features(features)


def _write_packed(dataset, capacity: int, path: str, llamafactory: tuple[int, int | None] | None = None) -> None:
    """Bins -> Arrow file at ``path`` (written under a temporary name and renamed: a reader never sees half a
    file, and two nodes writing one shared cache both leave a whole one)."""
    from datasets.arrow_writer import ArrowWriter

    lengths = sample_lengths(dataset)
    members, bin_sizes = (pack_bins(lengths, capacity) if llamafactory is None
                          else pack_llamafactory(lengths, capacity, *llamafactory))
    images = "images" in dataset.column_names
    source = dataset.select_columns(["input_ids", "labels", *(["images"] if images else [])]).with_format("arrow")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    bin_ends = np.cumsum(bin_sizes)
    bins_per_write = max(1, TOKENS_PER_WRITE // capacity)
    try:
        with ArrowWriter(features=packed_features(images), path=partial) as writer:
            for first in range(0, len(bin_sizes), bins_per_write):
                last = min(first + bins_per_write, len(bin_sizes))
                start = int(bin_ends[first - 1]) if first else 0
                chunk = members[start:int(bin_ends[last - 1])]
                rows = source[chunk.tolist()]
                writer.write_table(_packed_rows(rows, lengths[chunk], bin_sizes[first:last]))
            writer.finalize()
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _packed_rows(rows, sample_lens: np.ndarray, bin_sizes: np.ndarray):
    """Arrow table of packed rows from ``rows`` (the samples, grouped by bin in order) without a Python loop:
    each column's values are concatenated and cut at the bins' token offsets (``images``: at their image counts)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bin_tokens = np.add.reduceat(sample_lens, np.r_[0, np.cumsum(bin_sizes)[:-1]]) if len(bin_sizes) else []
    token_offsets = pa.array(np.r_[0, np.cumsum(bin_tokens)].astype(np.int32))
    sample_offsets = pa.array(np.r_[0, np.cumsum(bin_sizes)].astype(np.int32))
    starts = np.r_[0, np.cumsum(sample_lens)[:-1]]
    positions = np.arange(int(sample_lens.sum()), dtype=np.int64) - np.repeat(starts, sample_lens)

    def values(column: str, dtype):
        return rows.column(column).combine_chunks().flatten().cast(dtype)

    columns = {
        "input_ids": pa.ListArray.from_arrays(token_offsets, values("input_ids", pa.int32())),
        "labels": pa.ListArray.from_arrays(token_offsets, values("labels", pa.int64())),
        "position_ids": pa.ListArray.from_arrays(token_offsets, pa.array(positions)),
        "seq_lens": pa.ListArray.from_arrays(sample_offsets, pa.array(sample_lens.astype(np.int64))),
    }
    if "images" in rows.column_names:
        images = rows.column("images").combine_chunks()
        counts = pc.list_value_length(images).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        bin_images = np.add.reduceat(counts, np.r_[0, np.cumsum(bin_sizes)[:-1]]) if len(bin_sizes) else []
        image_offsets = pa.array(np.r_[0, np.cumsum(bin_images)].astype(np.int32))
        columns["images"] = pa.ListArray.from_arrays(image_offsets, images.flatten().cast(pa.string()))
    return pa.table(columns)
