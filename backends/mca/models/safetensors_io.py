"""Read a ``.safetensors`` file tensor by tensor with positioned reads, straight into a given tensor.

``safetensors.safe_open`` maps the whole file and hands out tensors that view the mapping, so a
conversion copies every byte twice (page cache -> mapped tensor -> parameter) and the mapped pages of
the whole file count in the process's resident memory until it is closed. Here the header is parsed
once and each tensor's bytes are read with ``os.preadv`` into its destination: the parameter itself
when no conversion is needed (a 1:1 rename at the parameter's dtype and shape), or the parameter's slices
a fused tensor's inputs fill (q/k/v, gate/up: ``read_into``), else a buffer of that one tensor. Nothing
else of the file is ever resident in this process. A conversion that only writes the model out again may
instead take tensors stored one after the other as a view of a private map of the file (``mapped``): no copy
at all, and no fresh memory to fault in.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes
of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data, offsets relative to its start.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import sys
import weakref
from typing import Callable

import torch

from roll.errors import ModelError
from roll.safetensors_file import DTYPES, encode_header

_MAX_HEADER = 100 * 1024**2  # the format's own limit
_IOV_MAX = 1024  # Linux's limit on the buffers of one preadv
_MAPS: dict[int, tuple[int, int]] = {}  # start address of a live map of ``mapped`` -> (its length, its file's descriptor)
# start address of a live ``unread_memory`` -> (its length, its ``file_backed`` spans: begin, end, a descriptor of the
# file, the offset in it, the map that keeps that descriptor open)
_UNREAD: dict[int, tuple[int, list[tuple[int, int, int, int, mmap.mmap]]]] = {}


def mapped_source(address: int, nbytes: int) -> tuple[int, int] | None:
    """(a descriptor of the file, the offset in it) of the ``nbytes`` bytes at ``address`` when they lie in one live
    map of ``private_map`` (``SafetensorsFile.mapped``, a Megatron checkpoint's files in ``roll-convert mca2hf``),
    else None: a writer can then have the kernel copy them file to file (``os.copy_file_range``) instead of faulting
    the map's pages in to copy them from memory."""
    for start, (length, fd) in list(_MAPS.items()):
        if start <= address and address + nbytes <= start + length:
            return fd, address - start
    return None


def private_map(fd: int) -> mmap.mmap:
    """A private (copy-on-write) map of the whole file ``fd``, known to ``mapped_source`` while it lives (it keeps a
    descriptor of its own, closed with the map's last user). A write to a tensor over it copies the page it
    touches, never the file, and is not seen by a writer that copies the file's bytes: map only tensors that are
    written out unchanged."""
    mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start, own = _address(mapping), os.dup(fd)
    _MAPS[start] = (len(mapping), own)
    weakref.finalize(mapping, _forget, start, own)  # with the last tensor over the map
    return mapping


def _forget(start: int, fd: int) -> None:
    _MAPS.pop(start, None)
    os.close(fd)


def unread_memory(nbytes: int) -> mmap.mmap:
    """``nbytes`` of address space that may not be touched at all, for a tensor whose bytes lie only in files
    (``file_backed`` records where): ``write_file`` copies them from there, and any read of the memory is a crash,
    never wrong bytes. ``roll-convert mca2hf``'s fused gate/up weights, stored as two archives that no one map
    view covers (``checkpoint_map.MappedParams``), so no fresh memory is faulted in for them."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)
    start = _address(mapping)
    _UNREAD[start] = (nbytes, [])
    weakref.finalize(mapping, _UNREAD.pop, start, None)  # with the last tensor over it
    return mapping


def file_backed(memory: mmap.mmap, begin: int, nbytes: int, source: mmap.mmap, offset: int) -> None:
    """Record that bytes ``[begin, begin + nbytes)`` of ``unread_memory`` ``memory`` are those at ``offset`` of the
    file that ``source`` (a ``private_map``) maps; the record keeps ``source``, and so its descriptor, open."""
    _UNREAD[_address(memory)][1].append((begin, begin + nbytes, _MAPS[_address(source)][1], offset, source))


def file_span(address: int, nbytes: int) -> tuple[int, int] | None:
    """(a descriptor of the file, the offset in it) of the ``nbytes`` bytes at ``address`` when they lie in
    ``unread_memory``, else None; bytes there that no one ``file_backed`` span holds are a bug (they were never
    read), refused."""
    for start, (length, spans) in list(_UNREAD.items()):
        if start < address + nbytes and address < start + length:
            for begin, end, fd, offset, _ in spans:
                if start + begin <= address and address + nbytes <= start + end:
                    return fd, offset + address - start - begin
            raise AssertionError(f"{nbytes} bytes at {address:#x} of unread memory lie in no one file span")
    return None


def _address(mapping: mmap.mmap) -> int:
    import warnings

    with warnings.catch_warnings():  # a map with no access is a read-only buffer to Python; its address is read only
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()


class SafetensorsFile:
    """One open ``.safetensors`` file: ``keys()``, ``nbytes(name)``, ``read(name, out=None)``. ``expand``: turns the
    parsed header into the entries the reader serves (``fused_experts.expand_header``: a fused expert tensor as
    per-expert tensors over its bytes)."""

    def __init__(self, path: str, expand: Callable[[dict[str, dict], str], dict[str, dict]] | None = None) -> None:
        if sys.byteorder != "little":
            raise ModelError("reading safetensors needs a little-endian host (the format's byte order).")
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._map: mmap.mmap | None = None
        try:
            self._entries, self._base = self._parse_header()
            if expand is not None:
                self._entries = expand(self._entries, path)
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> tuple[dict[str, dict], int]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise ModelError(f"{self.path}: not a safetensors file (header length {length}, file {size} bytes); "
                             "is the download complete?")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except ValueError as err:
            raise ModelError(f"{self.path}: unreadable safetensors header ({err}).") from None
        header.pop("__metadata__", None)
        base = 8 + length
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ModelError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which roll cannot read.")
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            if end - begin != numel * dtype.itemsize or base + end > size:
                raise ModelError(f"{self.path}: tensor {name!r} lies outside the file or does not match its shape "
                                 "(truncated or corrupt file).")
            entry["torch_dtype"] = dtype
        return header, base

    def keys(self) -> list[str]:
        return list(self._entries)

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name]["data_offsets"]
        return end - begin

    def info(self, name: str) -> tuple[torch.dtype, list[int]]:
        """(dtype, shape) of the tensor ``name``."""
        entry = self._entries[name]
        return entry["torch_dtype"], entry["shape"]

    def fits(self, name: str, out: torch.Tensor) -> bool:
        """Whether ``read(name, out)`` can fill ``out`` in place (same dtype and shape, contiguous, CPU)."""
        entry = self._entries[name]
        return (out.device.type == "cpu" and out.is_contiguous() and out.dtype == entry["torch_dtype"]
                and list(out.shape) == entry["shape"])

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``name``, read into ``out`` when given (it must ``fit``), else into a new tensor."""
        entry = self._entries[name]
        if out is None:
            out = torch.empty(entry["shape"], dtype=entry["torch_dtype"])
        assert self.fits(name, out), f"{name}: {out.dtype}{tuple(out.shape)} cannot hold {entry}"
        self._read_bytes(name, [out])
        return out

    def read_into(self, name: str, outs: list[torch.Tensor]) -> None:
        """The tensor ``name``'s elements, in order, into the contiguous CPU tensors ``outs`` of its dtype (one
        after the other: e.g. each query group's rows of a fused q/k/v parameter), in one positioned read."""
        dtype, numel = self._entries[name]["torch_dtype"], sum(out.numel() for out in outs)
        assert all(out.device.type == "cpu" and out.is_contiguous() and out.dtype == dtype for out in outs) and \
            numel * dtype.itemsize == self.nbytes(name), f"{name}: {self._entries[name]} does not fill {len(outs)} slots"
        self._read_bytes(name, outs)

    def mapped(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        """The elements of the tensors ``names``, stored one after the other in this order at ``dtype``, as one
        1-D tensor over a private (copy-on-write) memory map of the file, or None when they are not. No byte is
        copied: the tensor's pages are the page cache's own, so a model that is only written out again
        (``roll-convert hf2mca``) never faults in fresh memory for it (3-6x the cost of reading cached bytes
        into touched memory, docs/performance.md). A write to the tensor copies the page it touches, never
        the file, and is not seen by ``copying_from_maps``, which copies the file's bytes: map only tensors that
        are written out unchanged (``load_hf_weights(map_files=True)``, for hf2mca). The map lives as long as a
        tensor over it."""
        entries = [self._entries[name] for name in names]
        begin = entries[0]["data_offsets"][0] if entries else 0
        end = begin
        for entry in entries:
            if entry["torch_dtype"] != dtype or entry["data_offsets"][0] != end:
                return None
            end = entry["data_offsets"][1]
        if end == begin or (self._base + begin) % dtype.itemsize:
            return None
        if self._map is None:
            self._map = private_map(self._fd)
        return torch.frombuffer(self._map, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                offset=self._base + begin)

    def _read_bytes(self, name: str, outs: list[torch.Tensor]) -> None:
        views = [memoryview(out.view(torch.uint8).reshape(-1).numpy()) for out in outs if out.numel()]
        position = self._base + self._entries[name]["data_offsets"][0]
        while views:  # a read stops at ~2 GiB on Linux, and takes at most IOV_MAX buffers
            got = os.preadv(self._fd, views[:_IOV_MAX], position)
            if got <= 0:
                raise ModelError(f"{self.path}: file ended inside tensor {name!r} (truncated?).")
            position += got
            while views and got >= len(views[0]):
                got -= len(views.pop(0))
            if got:
                views[0] = views[0][got:]

    def close(self) -> None:
        self._map = None  # tensors over it keep it (and the file's pages) alive; closed with the last one
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wrapping_write_streams(create_stream, wrap):
    """PyTorch's ``FileSystem.create_stream`` whose write streams are ``wrap(stream)`` (read streams unchanged)."""

    @contextlib.contextmanager
    def create(path, mode: str):
        with create_stream(path, mode) as stream:
            yield wrap(stream) if "w" in mode else stream

    return create


def copying_from_maps(create_stream):
    """PyTorch's ``FileSystem.create_stream`` whose write streams hand each write of bytes lying in a map of
    ``SafetensorsFile.mapped`` (``roll-convert hf2mca``'s parameters) to the kernel, file to file."""
    return wrapping_write_streams(create_stream, _MapCopyingStream)


class _MapCopyingStream:
    """A binary write stream whose writes of at least a page from a safetensors file's map are done with
    ``os.copy_file_range`` from that file: the kernel copies page cache to page cache, without faulting the map's
    pages into this process (0.15 against 0.33-0.41 s of CPU for 0.47 GB, docs/performance.md). Anything else,
    or a file system that refuses the copy, is written as before."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, data) -> int:
        import numpy as np

        view = memoryview(data)
        if view.nbytes >= mmap.PAGESIZE and view.c_contiguous:
            source = mapped_source(int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data), view.nbytes)
            if source is not None and self._copy(*source, view.nbytes):
                return view.nbytes
        return self._stream.write(data)

    def _copy(self, fd: int, offset: int, nbytes: int) -> bool:
        self._stream.flush()
        at = self._stream.tell()
        if not copy_range(fd, offset, self._stream.fileno(), at, nbytes):
            return False
        self._stream.seek(at + nbytes)
        return True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> bool:
    """``nbytes`` of file ``src`` from ``src_offset`` to ``dst_offset`` of file ``dst`` by ``os.copy_file_range`` (the
    kernel copies page cache to page cache); False when the file systems refuse it (EXDEV on older kernels, or no
    support), the caller then writes the bytes itself."""
    done = 0
    try:
        while done < nbytes:
            got = os.copy_file_range(src, dst, nbytes - done, src_offset + done, dst_offset + done)
            if got <= 0:
                raise OSError("copy_file_range copied nothing")
            done += got
    except OSError:
        return False
    return True


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (contiguous, CPU) to a new ``.safetensors`` file ``path``, the same bytes as
    ``safetensors.torch.save_file`` writes; returns the bytes the kernel copied file to file. A tensor over a live
    ``private_map`` is copied from its file by ``copy_range`` (``roll-convert mca2hf``: the parameters over the
    Megatron checkpoint's files), any other written from its memory in one positioned write; nothing is copied
    into a buffer first (safetensors' own writer does not either, but it cannot copy file to file)."""
    import numpy as np

    header, order = encode_header(tensors, metadata)
    copied, fd = 0, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, memoryview(header), 0)
        position = len(header)
        for name in order:
            tensor = tensors[name]
            if not tensor.nbytes:
                continue
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            only_in_file = file_span(int(data.ctypes.data), tensor.nbytes)
            if only_in_file is not None:  # its memory may not be read: copied, or read from the file
                if copy_range(*only_in_file, fd, position, tensor.nbytes):
                    copied += tensor.nbytes
                else:
                    _copy_by_reading(*only_in_file, fd, position, tensor.nbytes)
                position += tensor.nbytes
                continue
            source = mapped_source(int(data.ctypes.data), tensor.nbytes) if tensor.nbytes >= mmap.PAGESIZE else None
            if source is not None and copy_range(*source, fd, position, tensor.nbytes):
                copied += tensor.nbytes
            else:
                _pwrite_all(fd, memoryview(np.ascontiguousarray(data)), position)
            position += tensor.nbytes
    finally:
        os.close(fd)
    return copied


def _copy_by_reading(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    """``copy_range``'s fallback: 64 MiB at a time through a buffer."""
    done = 0
    while done < nbytes:
        chunk = os.pread(src, min(64 * 1024**2, nbytes - done), src_offset + done)
        if not chunk:
            raise ModelError(f"file descriptor {src} ended {nbytes - done} bytes before a tensor's end (truncated?).")
        _pwrite_all(dst, memoryview(chunk), dst_offset + done)
        done += len(chunk)


def _pwrite_all(fd: int, view: memoryview, position: int) -> None:
    while len(view):  # a write stops at ~2 GiB on Linux
        done = os.pwrite(fd, view, position)
        view, position = view[done:], position + done
