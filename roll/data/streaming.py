"""Streaming (``streaming: true``): the training rows of a corpus larger than memory, built as they are read.

The same steps as the in-memory pipeline, one row at a time, with memory bounded by ``buffer_size`` rows:
each file of each ``dataset:`` entry is read in ``preprocessing_batch_size``-row batches and tokenized by the
stage processor (errors name the file and row as usual); the entries are mixed (``roll.data.mixing``);
with ``shuffle`` a buffer of ``buffer_size`` rows is filled and each next row is drawn from it at random
(LLaMA-Factory's meaning of the key); skipped rows are dropped (counted and warned about); with
``packing`` the kept samples are packed best-fit decreasing into ``cutoff_len`` rows a block at a time, the
first block of an epoch ``FIRST_PACK_BLOCK`` samples and each next one twice the last, up to ``buffer_size``.
At the end of the corpus the stream starts again (the next epoch, shuffled with ``seed + epoch``), so
``max_steps`` decides the length.

Both backends index their training set (global step k reads rows ``[k*B, (k+1)*B)``, DESIGN.md section
3), so the stream is handed to them as ``StreamedRows``: a dataset of ``max_steps * B`` rows whose row i is
the stream's i-th row, read forward. A resumed run's first request is the row after the checkpoint's
consumed samples, which the stream reaches by replaying (reading and tokenizing, not training) the rows
before it: the same rows in the same order, whichever backend, whatever the layout.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from types import SimpleNamespace
from typing import Callable, Iterator

import numpy as np

from roll.data.fingerprint import settings_digest
from roll.data.loading import Source, resolve_source, split_sources
from roll.data.mixing import interleave
from roll.data.packing import best_fit_decreasing
from roll.data.processors import META_COLUMNS
from roll.data.stats import PreprocessStats
from roll.errors import DataError
from roll.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)

_INT_COLUMNS = ("input_ids", "attention_mask", "labels")
"""Held as int32 arrays while buffered: a python list of ints costs ~9x the memory."""

FIRST_PACK_BLOCK = 512
"""Samples in an epoch's first packing block. Best-fit decreasing needs a whole block before its first row, so
a first block of ``buffer_size`` samples (16384 by default) held step 1 back by as many more rows read and
tokenized after the shuffle buffer filled. On generated sft and pt lengths a 512-sample block packs 98.7-99.1%
full on average, a 16384-sample one 99.6-99.7%."""


def raw_batches(path: str, batch_size: int) -> Iterator[dict[str, list]]:
    """The rows of one source file (or saved dataset) as dict-of-list batches, read lazily in file order."""
    import datasets

    from roll.data.loading import BUILDERS, diagnose

    builder = None
    if os.path.isdir(path):
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"]
        stream = loaded.to_iterable_dataset()
    elif os.path.exists(path):
        builder = BUILDERS[os.path.splitext(path)[1].lower()]
        stream = datasets.load_dataset(builder, data_files=path, split="train", streaming=True)
    else:
        stream = datasets.load_dataset(path, split="train", streaming=True)
    try:
        yield from stream.iter(batch_size=batch_size)
    except Exception as exc:  # an arrow error half-way through a file: find the row (reads the file once)
        found = diagnose(path, builder) if builder else None
        raise DataError(f"cannot read {path} while streaming it: {found or exc}") from exc


def tokenized_rows(path: str, make_processor: Callable[[Source], Callable],
                   batch_size: int, entry=None) -> Iterator[dict]:
    """One file's tokenized rows (meta columns included), batch by batch; ``make_processor(source)`` builds
    the stage processor once the first batch shows the file's columns (``entry``: its registry entry)."""
    fn, start = None, 0
    for batch in raw_batches(path, batch_size):
        if fn is None:
            fn = make_processor(Source(path, SimpleNamespace(column_names=list(batch)), entry=entry))
        count = len(next(iter(batch.values()), []))
        out = fn(batch, list(range(start, start + count)))
        start += count
        columns = list(out)
        for values in zip(*(out[c] for c in columns)):
            yield {c: np.asarray(v, dtype=np.int32) if c in _INT_COLUMNS else v
                   for c, v in zip(columns, values)}
    if start == 0:
        raise DataError(f"{path} has no rows.")


def shuffled(rows: Iterator[dict], buffer_size: int, seed: int) -> Iterator[dict]:
    """Rows in a random order drawn through a buffer of ``buffer_size``: once the buffer is full, each row
    read replaces a randomly chosen one, which is yielded; at the end the rest come out in random order."""
    rng = np.random.default_rng(seed)
    buffer: list[dict] = []
    for row in rows:
        if len(buffer) < buffer_size:
            buffer.append(row)
            continue
        slot = int(rng.integers(buffer_size))
        yield buffer[slot]
        buffer[slot] = row
    for slot in rng.permutation(len(buffer)).tolist():
        yield buffer[slot]


def pack_block_sizes(buffer_size: int) -> Iterator[int]:
    """Samples per packing block, block after block: ``FIRST_PACK_BLOCK``, then twice the last, up to
    ``buffer_size`` (``buffer_size`` throughout when it is the smaller). Doubling keeps each block's wait
    in proportion to the rows trained before it, and the blocks reach full size (full packing) in a few."""
    size = min(FIRST_PACK_BLOCK, buffer_size)
    while True:
        yield size
        size = min(2 * size, buffer_size)


def packed(samples: Iterator[dict], capacity: int, block_sizes: Iterator[int],
           rng: np.random.Generator | None) -> Iterator[dict]:
    """Packed rows (``input_ids``, ``labels``, ``position_ids``, ``seq_lens``, as roll.data.packing makes) of
    each next block of samples (``block_sizes`` long), best-fit decreasing; a block's rows in random order
    with ``rng``."""
    for size in block_sizes:
        block = list(itertools.islice(samples, size))
        if not block:
            return
        bins = best_fit_decreasing([len(s["input_ids"]) for s in block], capacity)
        order = rng.permutation(len(bins)).tolist() if rng is not None else range(len(bins))
        for b in order:
            parts = [block[i] for i in bins[b]]
            lens = [len(p["input_ids"]) for p in parts]
            yield {"input_ids": np.concatenate([p["input_ids"] for p in parts]),
                   "labels": np.concatenate([p["labels"] for p in parts]),
                   "position_ids": np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
                   "seq_lens": lens}


def kept(rows: Iterator[dict], dropped: dict[str, int]) -> Iterator[dict]:
    """Rows without a skip reason, meta columns removed; the skipped ones counted in ``dropped``."""
    for row in rows:
        reason = row.get("_drop", "")
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            warn_once(logger, f"streaming: skipping rows ({reason}; see docs/data.md, 'Skipped rows')")
            continue
        yield {k: v for k, v in row.items() if k not in META_COLUMNS}


class TrainingStream:
    """The training rows of ``data_args`` (streaming), epoch after epoch; iterate to read them."""

    def __init__(self, data_args, make_processor: Callable[[Source], Callable], seed: int) -> None:
        self.data_args, self.make_processor, self.seed = data_args, make_processor, seed
        self.entries = [resolve_source(part, data_args.dataset_dir) for part in split_sources(data_args.dataset)]
        self.dropped: dict[str, int] = {}

    def _entry(self, source: tuple[list[str], object]) -> Iterator[dict]:
        (paths, entry), size = source, self.data_args.preprocessing_batch_size
        return itertools.chain.from_iterable(tokenized_rows(p, self.make_processor, size, entry) for p in paths)

    def epoch(self, epoch: int) -> Iterator[dict]:
        args, seed = self.data_args, self.seed + epoch
        if args.mix_strategy == "concat":
            rows = itertools.chain.from_iterable(self._entry(source) for source in self.entries)
        else:
            makers = [lambda source=source: self._entry(source) for source in self.entries]
            rows = (row for _, row in interleave(makers, args.mix_strategy, args.interleave_probs, seed))
        if args.shuffle:
            rows = shuffled(rows, args.buffer_size, seed)
        rows = kept(rows, self.dropped)
        if args.packing:
            rng = np.random.default_rng(seed) if args.shuffle else None
            rows = packed(rows, args.cutoff_len, pack_block_sizes(args.buffer_size), rng)
        return rows

    def __iter__(self) -> Iterator[dict]:
        for epoch in itertools.count():
            count = 0
            for count, row in enumerate(self.epoch(epoch), start=1):
                yield row
            if count == 0:
                reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items()))
                raise DataError(f"no samples in the stream of {self.data_args.dataset!r}: every row was "
                                f"skipped ({reasons}); fix the rows (docs/data.md, 'Skipped rows').")
            log_rank0(logger, "streaming: epoch %d of the stream ended after %d rows; starting it again",
                      epoch, count)


class StreamedRows:
    """A stream seen as a dataset of ``length`` rows, read forward: row i is the stream's i-th row.

    Rows are read in blocks of ``block_size`` (one global batch, ``set_stream_length``): a process keeps
    the block it reads from and row 0 (the mca backend's filler rows copy its shape); asking for an earlier
    block replays the stream from its start. With a ``spool`` (``share_stream``: several processes on a
    node) only local rank 0 reads the stream; the node's other ranks get its blocks (roll.data.stream_share).
    ``rows_read`` counts the rows this process read from the stream itself.
    """

    streamed = True

    def __init__(self, stream, length: int, fingerprint: str) -> None:
        self.stream, self.length, self.fingerprint = stream, length, fingerprint
        self.block_size, self.spool, self.rows_read = 1, None, 0
        self._iter: Iterator[dict] | None = None
        self._next_block = 0
        self._block: tuple[int, Callable[[int], dict]] | None = None
        self._first: dict | None = None
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(f"row {index} of a {self.length}-row stream")
        if index == 0 and self._first is not None:
            return {k: list(v) if isinstance(v, list) else v for k, v in self._first.items()}
        if self._pid != os.getpid():  # a forked dataloader worker: the parent's open files are not its own
            self.__dict__.update(self.__getstate__(), _pid=os.getpid())
        block = index // self.block_size
        if self._block is None or self._block[0] != block:
            self._block = (block, self._load(block))
            if block == 0:  # kept on every rank alike, so no rank asks for block 0 again
                self._first = self._block[1](0)
        return self._block[1](index - block * self.block_size)

    def _load(self, block: int) -> Callable[[int], dict]:
        """Block ``block``'s rows (a function of the row's place in the block): from local rank 0's spool,
        or read from the stream (and put in the spool for the node's other ranks)."""
        if self.spool is not None and not self.spool.reader:
            return self.spool.receive(block).row
        if self._iter is None or block < self._next_block:
            if self._iter is not None:
                warn_once(logger, f"streaming: block {block} asked for after block {self._next_block - 1}: "
                                  "replaying the stream from its start")
            self._iter, self._next_block = iter(self.stream), 0
        while True:
            rows = list(itertools.islice(self._iter, self.block_size))
            self.rows_read += len(rows)
            self._next_block += 1
            if self._next_block > block:
                break
        if self.spool is not None:
            self.spool.publish(block, rows)
        return lambda i: _as_lists(rows[i])

    @property
    def column_names(self) -> list[str]:
        return list(self[0])

    def stream_fingerprint(self) -> str:
        return self.fingerprint

    def __getstate__(self) -> dict:  # a dataloader worker process reads the stream itself
        return {**self.__dict__, "_iter": None, "_next_block": 0, "_block": None, "_first": None,
                "spool": None}


def _as_lists(row: dict) -> dict:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()}


def fingerprint(data_args, tokenizer, seed: int) -> str:
    """What decides the stream's rows: the data keys, the seed, the tokenizer and each file's size and first
    and last MiB (hashing a whole corpus would read it all; a changed row almost always moves one of them)."""
    speed_only = ("preprocessing_num_workers", "overwrite_cache", "eval_dataset")
    settings = {k: v for k, v in vars(data_args).items() if k not in speed_only}
    tokenizer_parts = [str(getattr(tokenizer, attr, None))
                       for attr in ("name_or_path", "chat_template", "eos_token_id", "pad_token_id")]
    sources = [resolve_source(part, data_args.dataset_dir) for part in split_sources(data_args.dataset)]
    files = [[path, _file_sample(path), repr(entry)] for paths, entry in sources for path in paths]
    return settings_digest([settings, seed], [*tokenizer_parts, len(tokenizer)], files, length=16)


def _file_sample(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(1 << 20)
        handle.seek(max(0, size - (1 << 20)))
        return f"{size}:{hashlib.sha256(head + handle.read()).hexdigest()}"


def build_streaming(data_args, tokenizer, *, stage: str, seed: int, make_processor: Callable[[Source], Callable],
                    build_eval: Callable):
    """The DatasetBundle of a streaming run: ``StreamedRows`` for training (``max_steps`` global batches:
    the length is set by ``set_stream_length``), ``eval_dataset`` read in full by ``build_eval``."""
    from roll.data.pipeline import DatasetBundle

    start = time.perf_counter()
    stream = TrainingStream(data_args, make_processor, seed)
    train = StreamedRows(stream, 0, fingerprint(data_args, tokenizer, seed))
    stats = PreprocessStats(streaming=True)
    eval_ds = None
    if data_args.eval_dataset:
        eval_ds = build_eval()
        stats.num_eval_samples = len(eval_ds)
    stats.preprocess_seconds = round(time.perf_counter() - start, 3)
    log_rank0(logger, "data: streaming %s (stage %s): rows are tokenized%s as they are read, shuffle "
              "buffer %s",
              data_args.dataset, stage, " and packed" if data_args.packing else "",
              data_args.buffer_size if data_args.shuffle else "off (shuffle: false)")
    return DatasetBundle(train=train, eval=eval_ds, stats=stats)


def set_stream_length(dataset, max_steps: int, global_batch_size: int) -> None:
    """A streamed training set is as long as the run reads: ``max_steps`` global batches, read a global
    batch at a time."""
    if getattr(dataset, "streamed", False):
        dataset.length, dataset.block_size = max_steps * global_batch_size, global_batch_size


def share_stream(dataset, output_dir: str) -> None:
    """Several processes on this node (a launched run): only local rank 0 reads a streamed training set; it
    hands the node's other ranks its blocks through a spool in ``output_dir`` (roll.data.stream_share).
    Called on every rank after ``set_stream_length``, before training."""
    from roll.data.stream_share import BlockSpool, local_world_size, node_spool_dir
    from roll.launch import local_rank

    if not getattr(dataset, "streamed", False) or local_world_size() < 2:
        return
    dataset.spool = BlockSpool(node_spool_dir(output_dir), local_rank(), local_world_size())
    if dataset.spool.reader:
        dataset.spool.reset()
