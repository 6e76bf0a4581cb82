"""Mixing several datasets (``dataset: a,b``): ``mix_strategy``, ``interleave_probs`` (LLaMA-Factory's keys).

Each comma-separated entry of ``dataset:`` is one dataset (a directory's files are concatenated into its
entry). ``concat`` puts the entries one after the other; ``interleave_under`` and ``interleave_over``
draw one row at a time from an entry: in turn (round robin) without ``interleave_probs``, else the entry
drawn with those probabilities by a generator seeded with ``seed``. ``interleave_under`` stops at the
first draw from an exhausted entry (every row comes at most once, the larger entries are under-sampled);
``interleave_over`` starts an exhausted entry again and stops when every entry has been exhausted at least
once (the smaller entries are over-sampled, rows repeat).

One generator (``interleave``) decides the order for both the in-memory pipeline (indices into the
concatenated tokenized entries) and the streaming one (rows pulled from the entries' streams), so the two
draw the same entries in the same order for a seed, and both backends consume that one order.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator

import numpy as np

from roll.data.loading import resolve_source, split_sources

STRATEGIES = ("concat", "interleave_under", "interleave_over")


def entry_sizes(spec: str, dataset_dir: str | None = None) -> list[int]:
    """How many loaded sources (files) each comma-separated entry of ``spec`` is made of, in order
    (``roll.data.loading.load_sources`` loads them in this order, flattened)."""
    return [len(resolve_source(part, dataset_dir)[0]) for part in split_sources(spec)]


def interleave(sources: list[Callable[[], Iterable]], strategy: str, probs: list[float] | None,
               seed: int) -> Iterator[tuple[int, object]]:
    """(entry index, item) pairs drawn from the iterables ``sources[i]()`` makes (called again to restart an
    exhausted entry under ``interleave_over``).

    Example, round robin over ``[a0, a1]`` and ``[b0, b1, b2]``::

        interleave_under -> (0, a0) (1, b0) (0, a1) (1, b1)   (the next draw finds a exhausted)
        interleave_over  -> (0, a0) (1, b0) (0, a1) (1, b1) (0, a0) (1, b2) (0, a1)
                            (a starts again; the next draw finds b, the last one, exhausted)
    """
    assert strategy in STRATEGIES[1:], strategy
    iterators = [iter(make()) for make in sources]
    exhausted = [False] * len(sources)
    for index in _draws(len(sources), probs, seed):
        try:
            item = next(iterators[index])
        except StopIteration:
            if strategy == "interleave_under":
                return
            exhausted[index] = True
            if all(exhausted):
                return
            iterators[index] = iter(sources[index]())
            try:
                item = next(iterators[index])
            except StopIteration:  # an empty entry never yields: stop rather than draw forever
                return
        yield index, item


def _draws(count: int, probs: list[float] | None, seed: int) -> Iterator[int]:
    """Entry indices without end: round robin, or drawn with ``probs`` (in blocks, for speed)."""
    if probs is None:
        yield from itertools.cycle(range(count))
        return
    rng = np.random.default_rng(seed)
    weights = np.asarray(probs, dtype=np.float64)
    weights = weights / weights.sum()
    while True:
        yield from rng.choice(count, size=1024, p=weights).tolist()


def mixed_indices(lengths: list[int], strategy: str, probs: list[float] | None, seed: int) -> np.ndarray:
    """Row indices into the concatenation of entries of ``lengths`` rows, in mixed order (``interleave``)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    order = interleave([lambda n=n: range(n) for n in lengths], strategy, probs, seed)
    return np.fromiter((offsets[entry] + row for entry, row in order), dtype=np.int64)


def mix_datasets(parts: list, data_args, seed: int, sizes: list[int] | None = None):
    """The tokenized sources of ``dataset:`` (one ``datasets.Dataset`` per loaded file) mixed per entry;
    ``sizes``: how many of ``parts`` each entry is (default ``entry_sizes``: every file of the entry)."""
    import datasets

    concat = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if data_args.mix_strategy == "concat":
        return concat
    lengths, start = [], 0
    for size in sizes if sizes is not None else entry_sizes(data_args.dataset, data_args.dataset_dir):
        lengths.append(sum(len(p) for p in parts[start:start + size]))
        start += size
    return concat.select(mixed_indices(lengths, data_args.mix_strategy, data_args.interleave_probs, seed))
