"""How roll writes and reads ``torch_dist`` model checkpoints in its own process, near the disk's speed.

Writing (``in_process_save_strategy``): Megatron's planner and PyTorch's ``FileSystemWriter`` threads, no
helper processes, every tensor written straight from the model (the halves of a fused gate/up weight, which
Megatron saves as two tensors, are not cloned first; a tensor over a safetensors file's map, as ``roll-convert
hf2mca`` makes them, copied file to file by the kernel), a byte progress bar.

Reading (``direct_load_strategy``): one positioned read per tensor, straight into the model. PyTorch's ``FileSystemReader`` (under Megatron's ``TorchDistLoadShardedStrategy``) copies every tensor three
times: the file slice into a ``BytesIO``, ``torch.load`` of it into a new tensor, that tensor into the
model's. Each stored tensor is a ``torch.save`` archive (an uncompressed zip: ``data.pkl`` describing the
tensor, ``data/<key>`` its storage bytes) at an offset of a ``.distcp`` file; ``DirectReader`` reads the
archive's small ``data.pkl`` (through an unpickler that accepts only a tensor record, never runs code),
finds the storage bytes and reads them with ``os.preadv`` into the destination tensor, when the stored
tensor is contiguous and of the destination's dtype, and the destination a CPU tensor into which the part asked
for lands in contiguous runs (``box_runs``: the whole tensor into a contiguous parameter is one read; at another
layout, a TP shard along the first dimension one read, along another dimension one per row). Anything else (a
transform, a target no run fits, another device, bytes entries) goes through PyTorch's own per-item path,
unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict, defaultdict

import torch

from roll.direct_write import DirectFile

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then name and extra-field lengths at offset 26


def in_process_save_strategy(thread_count: int = 2, sync_files: bool = True, progress=None, direct: bool = False):
    """A synchronous ``torch_dist`` save strategy that writes from this process.

    Megatron 0.16's default (``TorchDistSaveShardedStrategy``) is built for asynchronous saves: even a
    synchronous ``dist_checkpointing.save`` starts a ``spawn`` multiprocessing manager (a fresh interpreter
    that re-imports the caller: 3.1 s of a 4.7 s save of the 0.47 GB bench model) and forks one writer
    process per file. This strategy keeps Megatron's translation of sharded tensors and its planner and
    hands them to PyTorch's own ``FileSystemWriter``, whose ``thread_count`` threads write one
    ``__<rank>_<i>.distcp`` file each straight from the tensors (fsync'ed unless ``sync_files`` is off).
    The files, ``.metadata`` and Megatron's ``metadata.json`` / ``common.pt`` are the same format, so
    ``load_checkpoint`` (Megatron's loader) reads them at any layout. ``progress``: a byte counter
    (``roll.logging.byte_progress``) told this rank's total once planned and each tensor as it is written.
    ``direct``: each ``.distcp`` file is written past the page cache (``roll.direct_write``, the same bytes),
    which takes a fraction of a buffered write's CPU (training checkpoints; a conversion copying from
    safetensors maps keeps the kernel's file-to-file copy).
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    from backends.mca.checkpoint_map import aligning_archives
    from backends.mca.models.safetensors_io import copying_from_maps

    def item_bytes(item) -> int:
        return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize

    class Planner(MCoreSavePlanner):
        def finish_plan(self, new_plan):
            if progress is not None:
                progress.total = sum(item_bytes(i) for i in new_plan.items if i.type != WriteItemType.BYTE_IO)
                progress.refresh()
            return super().finish_plan(new_plan)

        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if not isinstance(data, torch.Tensor):
                return data
            if progress is not None:
                progress.update(item_bytes(write_item))
            return exact_storage(data)

    class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = dcp.FileSystemWriter(checkpoint_dir, thread_count=self.thread_count, sync_files=sync_files)
            # every file is written with the CRC-32 off, in whichever thread writes it, each tensor's archive at a
            # multiple of 64 bytes (mca2hf can map it); a training save's files past the page cache (``direct``),
            # a conversion's: hf2mca's mapped tensors copied file to file
            writer.fs.create_stream = (direct_streams(sync_files) if direct else
                                       _without_crc32(aligning_archives(copying_from_maps(writer.fs.create_stream))))
            planner = Planner(flatten_state_dict=False, can_run_decentralized_global_plan=False)
            dcp.save(mcore_to_pyt_state_dict(state, False), storage_writer=writer, planner=planner)

    return InProcessSaveStrategy("torch_dist", 1, thread_count=thread_count)


def direct_streams(sync_files: bool = True):
    """``FileSystem.create_stream`` for a training save's ``.distcp`` files: each written past the page cache
    (``roll.direct_write``; fsync'ed unless ``sync_files`` is off), each archive at a multiple of 64 bytes
    (``checkpoint_map.aligning_archives``: mca2hf can map it), without CRC-32."""
    from backends.mca.checkpoint_map import aligning_archives

    return _without_crc32(aligning_archives(functools.partial(_direct_stream, fsync=sync_files)))


@contextlib.contextmanager
def _direct_stream(path, mode: str, fsync: bool):
    """``FileSystem.create_stream`` for the ``.distcp`` files: a ``roll.direct_write.DirectFile``, fsync'ed when
    it closes (PyTorch's writer fsyncs the stream before it closes it, without a flush: bytes still in the
    aligned buffer then are written at the close, hence the fsync there)."""
    assert "w" in mode, mode
    with DirectFile(path, fsync=fsync) as stream:
        yield stream


def _without_crc32(create_stream):
    """``create_stream`` with ``torch.save``'s CRC-32 off in the calling thread while the stream is open. The switch
    (``torch.serialization.set_crc32_options``) holds for one thread only, and PyTorch's ``FileSystemWriter`` writes
    from its own threads too: set once around ``dcp.save`` it left the CRC-32 of every file but the calling thread's
    computed (reading every byte: 0.3 s of CPU per 0.5 GB). ``torch.load`` never checks it; roll's reader neither."""
    @contextlib.contextmanager
    def create(path, mode: str):
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            with create_stream(path, mode) as stream:
                yield stream
        finally:
            torch.serialization.set_crc32_options(previous)

    return create


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or, for a contiguous CPU view of a larger storage (each half of Megatron's fused gate/up
    weight), a tensor over exactly its bytes sharing its memory: ``torch.save`` writes a tensor's whole
    storage, so PyTorch's writer clones such views first (a copy of 2 x 46 MB in the bench model's save)."""
    tensor = tensor.detach()
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel()
            or tensor.untyped_storage().nbytes() == tensor.nbytes):
        return tensor
    raw = torch.from_numpy(tensor.reshape(-1).view(torch.uint8).numpy())  # numpy keeps `tensor` alive
    return raw.view(tensor.dtype).view(tensor.shape)


def direct_load_strategy(progress=None, mapped=None):
    """Megatron's ``torch_dist`` load strategy reading tensors through ``DirectReader`` (same planner, same
    checks, same result). ``progress``: a byte counter (``roll.logging.byte_progress``); the strategy's
    ``bytes_read`` counts this rank's bytes too (a bar is disabled off rank 0). ``mapped``: a
    ``checkpoint_map.MappedParams`` that takes the whole parameters it can serve from the files' maps, unread."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    class DirectLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
        bytes_read = 0

        def count(self, nbytes: int) -> None:
            self.bytes_read += nbytes
            if progress is not None:
                progress.update(nbytes)

        def load(self, sharded_state_dict, checkpoint_dir):
            _exact_shapes_exactly(self, sharded_state_dict, checkpoint_dir)
            # Megatron builds its reader inside ``load`` through this module-level name (0.16.1).
            previous = mcore_torch.CachedMetadataFileSystemReader
            mcore_torch.CachedMetadataFileSystemReader = _direct_reader_class(progress, self.count, mapped)
            try:
                return super().load(sharded_state_dict, checkpoint_dir)
            finally:
                mcore_torch.CachedMetadataFileSystemReader = previous

    return DirectLoadStrategy()


def _exact_shapes_exactly(strategy, sharded_state_dict, checkpoint_dir) -> None:
    """Clear ``allow_shape_mismatch`` (the vocab-padded embedding and output layer) where the stored tensor has the
    model's shape: Megatron zero-fills such a tensor before reading into it, in case part of it is not stored (0.14 s
    of the bench model's 0.31 GB embedding, every page of it faulted in, though every element is then read); with
    the shapes equal every element is read, and Megatron checks the shapes instead."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    flexible = [tensor for tensor in nested_values(sharded_state_dict)
                if isinstance(tensor, ShardedTensor) and tensor.allow_shape_mismatch]
    if flexible:
        stored = strategy.load_tensors_metadata(checkpoint_dir)
        for tensor in flexible:
            if tensor.key in stored and tuple(stored[tensor.key].global_shape) == tuple(tensor.global_shape):
                tensor.allow_shape_mismatch = False


def merge_in_place(sharded_state_dict) -> None:
    """Let Megatron's tensor factories (the fused gate/up weight, saved as its two halves) give back the parameter
    itself when the loaded pieces are the views of it their ``build_fn`` made, in order and covering it: the
    load wrote straight into them, so the parameter already holds the merged value. Megatron's own merge
    concatenates them into a new tensor, and keeps every layer's until the state dict is applied: at a 7B shape
    in fp32, 15 GB on top of the model. Anything else (pieces in other memory) keeps Megatron's merge."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for factory in nested_values(sharded_state_dict):
        if isinstance(factory, ShardedTensorFactory) and isinstance(factory.data, torch.Tensor):
            factory.merge_fn = _merge_into(factory.data, factory.merge_fn)


def _merge_into(data: torch.Tensor, merge):
    def merged(parts):
        return data if _tiles(parts, data) else merge(parts)

    return merged


def _tiles(parts, data: torch.Tensor) -> bool:
    """Whether ``parts`` are contiguous tensors lying one after the other over all of ``data``'s memory."""
    if not isinstance(parts, list) or not parts or not data.is_contiguous():
        return False
    at = data.data_ptr()
    for part in parts:
        if not isinstance(part, torch.Tensor) or part.dtype != data.dtype or not part.is_contiguous() \
                or part.device != data.device or part.data_ptr() != at:
            return False
        at += part.nbytes
    return at == data.data_ptr() + data.nbytes


def _direct_reader_class(progress, count, mapped=None):
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader)
    from torch.distributed.checkpoint.planner import LoadItemType

    class DirectReader(CachedMetadataFileSystemReader):
        """``read_data`` reads what it can in place (module docstring) and hands the rest to PyTorch's."""

        def read_data(self, plan, planner):
            per_file: dict[str, list] = defaultdict(list)
            rest = []
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.TENSOR and not info.transform_descriptors:
                    per_file[info.relative_path].append(req)
                else:
                    rest.append(req)
            if progress is not None:
                progress.total = sum(self.storage_data[r.storage_index].length for r in plan.items)
                progress.refresh()
            for relative_path, reqs in per_file.items():
                path = str(self.fs.concat_path(self.path, relative_path))
                fd = os.open(path, os.O_RDONLY)
                try:
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        take = None if mapped is None else functools.partial(mapped.take, fd, path)
                        if not _read_in_place(fd, self.storage_data[req.storage_index], req, planner, take):
                            rest.append(req)
                        else:
                            count(self.storage_data[req.storage_index].length)
                finally:
                    os.close(fd)
            done = super().read_data(dataclasses.replace(plan, items=rest), planner)
            count(sum(self.storage_data[r.storage_index].length for r in rest))
            return done

    return DirectReader


def _read_in_place(fd: int, info, req, planner, take=None) -> bool:
    """Read ``req``'s part of the tensor archived at ``info.offset`` into the planner's destination; False (nothing
    read) when the fast path does not apply. ``take(position, target)``: asked first, when the destination is the
    whole stored tensor (``MappedParams.take``); True leaves it unread, to be served from the file's map."""
    found = stored_tensor(fd, info.offset, info.length)
    if found is None:
        return False
    data_offset, dtype, size = found
    if len(req.storage_offsets) != len(size) or len(req.lengths) != len(size):
        return False
    target = planner.resolve_tensor(req)
    if getattr(planner, "_intermediate_read_item_and_target", None) is not None:  # an FP8 copy (Megatron + TE)
        planner._intermediate_read_item_and_target = None
        return False
    target = target.detach()
    if (type(target) is not torch.Tensor or target.device.type != "cpu" or target.dtype != dtype
            or list(target.shape) != list(req.lengths)):
        return False
    runs = box_runs(size, list(req.storage_offsets), target)
    if runs is None:
        return False
    whole = len(runs) == 1 and runs[0][0] == 0 and target.numel() == math.prod(size)
    if whole and take is not None and take(info.offset + data_offset, target):
        planner.commit_tensor(req, target)
        return True
    for at, dest in runs:
        if dest.numel():
            _preadv_exact(fd, memoryview(dest.reshape(-1).view(torch.uint8).numpy()),
                          info.offset + data_offset + at * dtype.itemsize)
    planner.commit_tensor(req, target)
    return True


def box_runs(size: list[int], offsets: list[int], target: torch.Tensor) -> list[tuple[int, torch.Tensor]] | None:
    """How the box ``[offsets, offsets + target.shape)`` of a C-contiguous tensor of shape ``size`` lands in
    ``target``: (element offset in the stored tensor, the contiguous part of ``target`` it fills) per run of
    consecutive stored elements, in order; None when the runs would not be contiguous in ``target``. The whole
    stored tensor into a contiguous target is one run; a TP shard of it along the first dimension (resuming a TP1
    checkpoint at TP2) one run; along another dimension, or into a shard of a larger target (a TP2 checkpoint read
    into a whole TP1 parameter), one run per row."""
    lengths, ndim = list(target.shape), len(size)
    if len(offsets) != ndim or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, size)):
        return None
    if not target.numel():
        return []

    def spans(split: int) -> bool:  # a run spans dims split.. : those after it whole, contiguous in target
        return (all(offsets[d] == 0 and lengths[d] == size[d] for d in range(split + 1, ndim))
                and target[(0,) * split].is_contiguous())

    split = next((split for split in range(ndim) if spans(split)), None) if ndim else 0
    if split is None:
        return None
    strides = [math.prod(size[d + 1:]) for d in range(ndim)]
    head = sum(offsets[d] * strides[d] for d in range(split, ndim))  # offsets past split are 0 by construction
    return [(head + sum((offsets[d] + i) * strides[d] for d, i in enumerate(index)), target[index])
            for index in itertools.product(*(range(n) for n in lengths[:split]))]


def stored_tensor(fd: int, offset: int, length: int) -> tuple[int, torch.dtype, list[int]] | None:
    """(offset of the storage bytes in the archive, dtype, shape) of the ``torch.save`` archive of one tensor at
    ``offset`` of file ``fd``, when it is a contiguous tensor filling its whole storage; else None. The members
    are located through the zip directory and read by their local headers (roll's writer switches torch's
    CRC-32 off, which ``zipfile``'s own reads would check)."""
    try:
        archive = zipfile.ZipFile(_FileSlice(fd, offset, length))
        pickled = next(info for info in archive.infolist() if info.filename.endswith("/data.pkl"))
        begin = _member_offset(fd, offset, pickled)
        record = _TensorRecordUnpickler(io.BytesIO(os.pread(fd, pickled.file_size, offset + begin))).load()
        if not isinstance(record, _TensorRecord):
            return None
        entry = archive.getinfo(pickled.filename[: -len("data.pkl")] + f"data/{record.key}")
        data_offset = _member_offset(fd, offset, entry)
    except (zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, ValueError, KeyError, EOFError, TypeError):
        return None
    numel = math.prod(record.size)
    expected_stride, step = [], 1
    for dim in reversed(record.size):
        expected_stride.insert(0, step)
        step *= dim
    if record.storage_offset != 0 or record.numel != numel or (numel > 1 and record.stride != expected_stride):
        return None
    if entry.file_size != numel * record.dtype.itemsize or data_offset + entry.file_size > length:
        return None
    return data_offset, record.dtype, record.size


def _member_offset(fd: int, offset: int, entry: zipfile.ZipInfo) -> int:
    """Where the bytes of the stored (uncompressed) zip member ``entry`` begin, from the archive's start."""
    head = os.pread(fd, _LOCAL_HEADER.size, offset + entry.header_offset)
    if entry.compress_type != zipfile.ZIP_STORED or len(head) != _LOCAL_HEADER.size:
        raise zipfile.BadZipFile("not a stored member")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(head)
    if signature != b"PK\x03\x04":
        raise zipfile.BadZipFile("no local header")
    return entry.header_offset + _LOCAL_HEADER.size + name_length + extra_length


@dataclasses.dataclass
class _TensorRecord:
    key: str
    dtype: torch.dtype
    numel: int
    storage_offset: int = 0
    size: list[int] = dataclasses.field(default_factory=list)
    stride: list[int] = dataclasses.field(default_factory=list)


class _TensorRecordUnpickler(pickle.Unpickler):
    """Unpickles ``torch.save``'s ``data.pkl`` of one tensor into a ``_TensorRecord``; any other global is
    refused (the caller then falls back to PyTorch's reader, with roll's restricted unpickling)."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor record")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("not a storage record")
        _, storage_type, key, _, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("unknown storage type")
        try:  # torch.FloatStorage -> torch.float32, as torch.load maps it
            dtype = torch.storage._get_dtype_from_pickle_storage_type(storage_type.name)
        except (AttributeError, KeyError):
            raise pickle.UnpicklingError(f"unknown storage type {storage_type.name}") from None
        return _TensorRecord(str(key), dtype, int(numel))


@dataclasses.dataclass(frozen=True)
class _StorageType:
    name: str


def _rebuild(storage, storage_offset, size, stride, *_):
    if not isinstance(storage, _TensorRecord):
        raise pickle.UnpicklingError("not a tensor record")
    return dataclasses.replace(storage, storage_offset=storage_offset, size=list(size), stride=list(stride))


class _FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of file descriptor ``fd`` as a seekable read-only file (positioned
    reads: the descriptor's own position is never used)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, count, self._offset + self._pos) if count else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _preadv_exact(fd: int, view: memoryview, position: int) -> None:
    while len(view):  # a read stops at ~2 GiB on Linux
        got = os.preadv(fd, [view], position)
        if got <= 0:
            raise OSError(f"checkpoint file ended inside a tensor at byte {position}")
        view, position = view[got:], position + got
