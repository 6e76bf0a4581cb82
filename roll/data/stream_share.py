"""One reader per node for a streamed training set (``streaming: true`` on several processes of a node).

A stream's row i is only known once every row before it was read and tokenized (skipped rows, the shuffle
buffer and packing move rows), so the processes of a node cannot split the reading by row. Instead each
node's local rank 0 reads the stream, in blocks of one global batch (step k's rows ``[k*B, (k+1)*B)``,
DESIGN.md section 3, which every rank reads from), and hands each block to the node's other ranks through
a spool directory under ``output_dir``: a block file, one hard link per other local rank, which that rank
memory-maps (reading only its own rows) and unlinks. The rows are the ones the reader would have read
itself, so the order and an exact resume do not change; the other ranks read and tokenize nothing.

Every rank reads every block of every step (both backends give each data-parallel rank micro-batches of
each step), in the same order, so a block a rank waits for is one local rank 0 reads at the same point of
the same code. Local rank 0 reads a whole block at its first row: a rank whose micro-batch comes later in
the step never waits for local rank 0's next micro-batch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time

import numpy as np

logger = logging.getLogger(__name__)

_HEADER = 8
"""Bytes of the header length at the start of a block file (then the JSON header, then int32 arrays)."""

WAIT_WARNING_SECONDS = 120.0


def local_world_size() -> int:
    """Processes on this node as the launcher says (torchrun: ``LOCAL_WORLD_SIZE``, deepspeed:
    ``LOCAL_SIZE``); 1 when neither is set (then every process reads the stream itself)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def node_spool_dir(output_dir: str) -> str:
    """This node's spool: under ``output_dir`` (roll writes nowhere else), one folder per node."""
    node = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or "0"
    return os.path.join(output_dir, ".roll-stream", f"node{node}-{socket.gethostname()}")


def write_block(path: str, rows: list[dict]) -> None:
    """``rows`` into one file: integer arrays as int32 after a JSON header that places them; other values
    (``seq_lens``, strings) in the header."""
    arrays, header, offset = [], [], 0
    for row in rows:
        entry = {}
        for key, value in row.items():
            if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
                arrays.append(value.astype(np.int32, copy=False))
                entry[key] = ["array", offset, len(value)]
                offset += len(value)
            else:
                entry[key] = ["value", value.tolist() if isinstance(value, np.ndarray) else value]
        header.append(entry)
    text = json.dumps(header, default=int).encode()
    text += b" " * (-(len(text) + _HEADER) % 4)  # the arrays start 4-byte aligned
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(_HEADER, "little"))
        handle.write(text)
        for array in arrays:
            handle.write(array.tobytes())


class BlockFile:
    """A block written by ``write_block``, memory-mapped: ``row(i)`` reads only row i's arrays."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(_HEADER), "little")
            self.header = json.loads(handle.read(size))
        start = _HEADER + size
        total = os.path.getsize(path) - start
        self.payload = (np.memmap(path, dtype=np.int32, mode="r", offset=start) if total
                        else np.zeros(0, dtype=np.int32))

    def __len__(self) -> int:
        return len(self.header)

    def row(self, index: int) -> dict:
        out = {}
        for key, (kind, *where) in self.header[index].items():
            out[key] = self.payload[where[0]:where[0] + where[1]].tolist() if kind == "array" else where[0]
        return out


class BlockSpool:
    """A node's spool: local rank 0 ``publish``es each block it read, the other local ranks ``receive`` it."""

    def __init__(self, directory: str, local_rank: int, local_world: int) -> None:
        self.directory, self.local_rank, self.local_world = directory, local_rank, local_world

    @property
    def reader(self) -> bool:
        return self.local_rank == 0

    def reset(self) -> None:
        """Local rank 0, before training: blocks left by an earlier run of this output_dir go."""
        shutil.rmtree(self.directory, ignore_errors=True)
        os.makedirs(self.directory, exist_ok=True)

    def _name(self, block: int, rank: int) -> str:
        return os.path.join(self.directory, f"block-{block}.rank{rank}")

    def publish(self, block: int, rows: list[dict]) -> None:
        """Write ``rows`` once and link the file for each other local rank (a link appears whole)."""
        os.makedirs(self.directory, exist_ok=True)
        written = os.path.join(self.directory, f"block-{block}.writing")
        write_block(written, rows)
        for rank in range(1, self.local_world):
            staged = self._name(block, rank) + ".staged"
            try:
                os.link(written, staged)
            except OSError:  # a file system without hard links
                shutil.copyfile(written, staged)
            os.replace(staged, self._name(block, rank))
        os.unlink(written)

    def receive(self, block: int) -> BlockFile:
        """Block ``block`` as local rank 0 wrote it, once it has (waiting as long as that takes: reading
        up to a resumed run's position can take long); the link is gone once mapped."""
        path, waited, pause = self._name(block, self.local_rank), time.monotonic(), 0.005
        warned = waited
        while not os.path.exists(path):
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
            if time.monotonic() - warned > WAIT_WARNING_SECONDS:
                warned = time.monotonic()
                logger.warning("streaming: local rank %d has waited %.0f s for local rank 0 to read the "
                               "rows of global step %d", self.local_rank, warned - waited, block + 1)
        rows = BlockFile(path)
        os.unlink(path)  # the mapping keeps the data readable; the disk space goes with it
        return rows
