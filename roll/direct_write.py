"""Checkpoint bytes written past the page cache (``O_DIRECT``), for writers that must not stall training.

Why: on a VM's ext4 a buffered write costs the kernel about a CPU second per GB (page-cache copy, then
writeback), measured with ``dd`` on the 2-core dev machine: 1 GiB buffered + fsync 1.3-3.5 s wall of which
1.07-3.05 s kernel CPU, the same with ``oflag=direct`` 0.86-0.91 s wall and 0.19-0.25 s kernel CPU. A
background checkpoint writer's CPU is taken from training; with ``O_DIRECT`` the device reads the bytes from
user memory instead (DMA), and only the copy into an aligned buffer is left.

The API is one stream (``DirectFile``, a write-only binary file object: ``write``, ``tell``, ``flush``,
``fileno``, ``close``) and one helper (``write_bytes``). Bytes go through a page-aligned buffer of
``CHUNK`` bytes kept per thread and reused (no allocation per file); each full buffer is one aligned
``pwrite``. The unaligned tail is written padded to the block size, then the file is cut to its length
(``ftruncate``). ``flush`` makes everything written so far reach the file (so that ``os.fsync(fileno())``
after it covers every byte, as it does for a buffered file); ``close(fsync=True)`` fsyncs. Where
``O_DIRECT`` is refused (tmpfs, some network file systems: ``EINVAL`` at open or at the first write; other
OSes have no ``O_DIRECT``) the same stream writes buffered, with the same bytes: ``direct`` says which.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

import numpy as np

CHUNK = 16 << 20
"""Bytes per aligned write (and the per-thread buffer's size)."""
_ALIGN = 4096
"""At least the logical block size of any disk we know (512 or 4096); the file system's ``st_blksize`` when
larger. O_DIRECT needs the buffer's address, each write's offset and its length aligned to it."""

_GIL_FREE_COPY = 1 << 16
"""Bytes from which a write's copy into the buffer is numpy's, which releases the GIL (a memoryview slice
assignment holds it for the whole copy: a training thread beside a background writer then waits)."""

_local = threading.local()
_lock = threading.Lock()
stats = {"direct_files": 0, "buffered_files": 0, "in_place_bytes": 0}
"""How many files ``DirectFile`` wrote each way in this process, and how many bytes went to the device from the
caller's memory, uncopied (tests check the direct paths were taken)."""
IN_PLACE_FROM = 1 << 20
"""Bytes from which a write whose memory agrees with its file offset is written from that memory (the writers that
place tensors for it, in roll and both backends, place those of at least this size)."""


def _buffer() -> tuple[mmap.mmap, bool]:
    """This thread's aligned buffer (an anonymous mapping: page-aligned), made once and reused, and whether it is
    the shared one; a second file open at once in the same thread gets a buffer of its own."""
    if getattr(_local, "busy", False):
        return mmap.mmap(-1, CHUNK), False
    buf = getattr(_local, "buffer", None)
    if buf is None or len(buf) != CHUNK:
        buf = _local.buffer = mmap.mmap(-1, CHUNK)
    _local.busy = True
    return buf, True


class DirectFile:
    """A new file at ``path`` (truncated if it exists), written with ``O_DIRECT`` when the file system takes it.

    Use as ``with DirectFile(path) as out: out.write(...)``; ``fsync=True`` fsyncs it on close."""

    def __init__(self, path: str | os.PathLike, fsync: bool = False) -> None:
        self.path, self._fsync = os.fspath(path), fsync
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self.direct = bool(direct)
        try:
            self._fd = os.open(self.path, flags | direct, 0o666)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._fd, self.direct = os.open(self.path, flags, 0o666), False
        blksize = os.fstat(self._fd).st_blksize
        self._align = blksize if blksize > _ALIGN and blksize & (blksize - 1) == 0 else _ALIGN
        buf, self._shared = _buffer()
        self._buf = memoryview(buf)
        self._array = np.frombuffer(buf, dtype=np.uint8)
        self._base = 0  # file offset of the buffer's first byte (aligned)
        self._fill = 0  # bytes in the buffer
        self.closed = False

    @property
    def alignment(self) -> int:
        """What a source's address and its file offset must agree on (modulo) for ``write`` to hand its memory to
        the device without a copy; 0 while the file is written buffered."""
        return self._align if self.direct else 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.direct and n >= IN_PLACE_FROM and (address_of(view) - self.tell()) % self._align == 0:
            self._write_in_place(view)
            return n
        while view:
            take = min(len(view), CHUNK - self._fill)
            if take < _GIL_FREE_COPY:
                self._buf[self._fill:self._fill + take] = view[:take]
            else:  # numpy copies without the GIL: a training thread beside this writer keeps running
                np.copyto(self._array[self._fill:self._fill + take], np.frombuffer(view[:take], dtype=np.uint8))
            self._fill += take
            view = view[take:]
            if self._fill == CHUNK:
                self._pwrite(self._buf, self._base)
                self._base += CHUNK
                self._fill = 0
        return n

    def tell(self) -> int:
        return self._base + self._fill

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Write what the buffer holds (padded to the block size, the file then cut to its length). The
        partial last block stays in the buffer, so later writes rewrite it whole at an aligned offset."""
        if self.closed or not self._fill:
            return
        whole = self._fill - self._fill % self._align
        padded = whole if whole == self._fill else whole + self._align
        if padded > self._fill:
            self._buf[self._fill:padded] = bytes(padded - self._fill)
        self._pwrite(self._buf[:padded], self._base)
        if padded > self._fill:
            os.ftruncate(self._fd, self._base + self._fill)
        tail = self._fill - whole
        self._buf[:tail] = self._buf[whole:self._fill]
        self._base += whole
        self._fill = tail

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            if self._fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self.closed = True
            del self._array  # a view of the buffer: gone before the buffer is released
            self._buf.release()
            if self._shared:
                _local.busy = False
            with _lock:
                stats["direct_files" if self.direct else "buffered_files"] += 1

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_in_place(self, view: memoryview) -> None:
        """``view`` lies in memory as it will in the file (modulo the alignment): the buffer takes the bytes up to
        the next block boundary and is written, the aligned middle goes from ``view``'s own memory to the device,
        and the buffer takes the rest."""
        head = -self.tell() % self._align
        self.write(view[:head])
        if self._fill:  # whole blocks now
            self._pwrite(self._buf[:self._fill], self._base)
            self._base += self._fill
            self._fill = 0
        middle = (len(view) - head) // self._align * self._align
        self._pwrite(view[head:head + middle], self._base)
        self._base += middle
        with _lock:
            stats["in_place_bytes"] += middle
        self.write(view[head + middle:])

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                done = os.pwrite(self._fd, view, offset)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # the file system took O_DIRECT at open but refuses its writes
                continue
            view, offset = view[done:], offset + done

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False


def address_of(view: memoryview) -> int:
    """The address of ``view``'s first byte (0 when empty)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def write_bytes(path: str | os.PathLike, data, fsync: bool = False) -> bool:
    """Write ``data`` (any buffer) as the file ``path``; True when it went past the page cache."""
    with DirectFile(path, fsync=fsync) as out:
        out.write(data)
    return out.direct
