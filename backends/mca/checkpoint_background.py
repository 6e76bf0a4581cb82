"""The mca backend's ``save_async`` write: Megatron's asynchronous ``torch_dist`` save, its files written by a thread.

megatron-core 0.16.1's asynchronous save plans on the main thread (collective), then runs the write in a
forked process (``AsyncCallsQueue``) that forks one more process per file. On a CPU run the fork is the
snapshot: every page training updates while the child lives is copied once (copy-on-write faults in the
trainer, about a CPU second per GB on the dev VM), and the children's buffered writes cost the kernel about
another second per GB; on that VM the asynchronous save cost training more than a synchronous one.

Here the same plan and the same finalize (``save_state_dict_async_plan`` / ``save_state_dict_async_finalize``:
the write results gathered, the metadata written once every rank finished) frame a write that
``roll.background_save.BackgroundSaves`` runs in a thread of this process. Each ``__<rank>_<i>.distcp`` file is
in the format the synchronous save writes (``checkpoint_io.direct_streams``: every item as PyTorch's writer writes
it, a tensor as its ``torch.save`` archive, each at a multiple of 64 bytes, no CRC-32), though not the same bytes:
Megatron's buckets order the items their own way, and each large tensor's archive is placed so that its data is
written from the tensor's own memory (``_place_in_memory_order``). The writer is ``_write_buckets``, not PyTorch's
``_write_item``: the file past the page cache (``roll.direct_write``), no per-item wrapper nor flush, and each
tensor's archive its frame around its memory (``_archive_frame``: the bytes ``torch.save`` writes besides the data,
taken once per dtype and shape), so that its CPU is the kernel's and little Python per item. Tensors on an
accelerator are copied to host memory on the main thread first (Megatron's device-to-host copy); tensors
already in host memory are written from training's own memory, no copy, and the request is ``live``: the
loop calls ``BackgroundSaves.fence`` before each optimizer step, which waits until the writer has read them.
"""

from __future__ import annotations

import os
import queue

import torch

from roll.direct_write import IN_PLACE_FROM, DirectFile, address_of


def background_save_strategy(thread_count: int = 2):
    """A ``torch_dist`` save strategy for ``dist_checkpointing.save(..., async_sharded_save=True)``: the returned
    ``AsyncRequest``'s ``async_fn`` writes this rank's files in the calling thread (``BackgroundSaves`` runs it),
    its ``finalize_fns`` are Megatron's (collective: run them on every rank once every writer finished). After
    the save, ``strategy.live`` says whether the writes read training's own tensors (see the module doc)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync, _split_by_size_and_type)
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.distributed.checkpoint.planner import WriteItemType

    from backends.mca.checkpoint_io import exact_storage

    class ThreadWriter(FileSystemWriterAsync):
        live = False

        def prepare_write_data(self, plan, planner) -> None:
            """Megatron's buckets (one file each), their tensors resolved now: host tensors as they are (views
            of a larger storage as tensors over their own bytes, anything else that ``torch.save`` would write
            with more bytes than its own copied, as PyTorch's writer does), accelerator tensors copied to host."""
            self.write_buckets, device_copies = [], False
            buckets = [bucket for bucket in _split_by_size_and_type(self.thread_count, plan.items) if bucket]
            for i, bucket in enumerate(buckets):
                data = [(item, planner.resolve_data(item)) for item in bucket if item.type == WriteItemType.BYTE_IO]
                for item in bucket:
                    if item.type == WriteItemType.BYTE_IO:
                        continue
                    tensor = planner.resolve_data(item).detach()
                    if tensor.device.type != "cpu":
                        tensor, device_copies = tensor.to("cpu", non_blocking=True), True
                    elif tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()
                    else:
                        self.live = True
                    data.append((item, tensor))
                name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
                self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name, data))
            if device_copies and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.results_queue = queue.SimpleQueue() if self.write_buckets else None

        def get_save_function_and_args(self):
            if not self.write_buckets:
                return None, None, []
            # no stream transforms here (PyTorch's writer runs them per item; Megatron's async writer sets none)
            assert not getattr(getattr(self, "transforms", None), "extensions", ()), "stream transforms unsupported"
            return _write_buckets, None, [self.write_buckets, self.results_queue]

    class Planner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return exact_storage(data) if isinstance(data, torch.Tensor) else data

    class BackgroundSaveStrategy(TorchDistSaveShardedStrategy):
        live = False

        def async_save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = ThreadWriter(checkpoint_dir, thread_count=self.thread_count)
            planner = Planner(flatten_state_dict=False, can_run_decentralized_global_plan=False)
            planned = save_state_dict_async_plan(mcore_to_pyt_state_dict(state, False), writer, None, 0,
                                                 planner=planner)[0]
            self.live = writer.live
            return self._get_save_and_finalize_callbacks(writer, planned)

    return BackgroundSaveStrategy("torch_dist", 1, thread_count=thread_count)


def _write_buckets(buckets, results: queue.SimpleQueue) -> None:
    """Write each bucket's items into its file (bytes items first, then tensors, as PyTorch's writer does; each at a
    multiple of 64 bytes, ``checkpoint_map.ALIGNMENT``: mca2hf maps it) and put their ``WriteResult``s where
    ``FileSystemWriterAsync.retrieve_write_results`` reads them. An exception propagates (``BackgroundSaves`` reports it
    on the main thread, and nothing is published). The files: ``DirectFile`` (past the page cache), fsync'ed."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # this thread's torch.save calls (``_archive_frame``): no CRC-32
    try:
        written = {}
        for i, (path, storage_key, data) in enumerate(buckets):
            with DirectFile(path, fsync=True) as stream:
                written[i] = [_write_entry(stream, item, value, storage_key) for item, value in data]
    finally:
        torch.serialization.set_crc32_options(previous)
    results.put(written)


def _write_entry(stream, item, value, storage_key: str):
    """One item as PyTorch's ``_write_item`` writes it with no stream transforms (a tensor: its ``torch.save``
    archive; bytes: as they are), without its per-item wrapper class and flushes (each flush of ``DirectFile``
    writes the partial last block and truncates the file: two system calls and a device request per item)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from backends.mca.checkpoint_map import ALIGNMENT

    stream.write(bytes(-stream.tell() % ALIGNMENT))
    if item.type == WriteItemType.BYTE_IO:
        offset = stream.tell()
        stream.write(value.getbuffer())
    else:
        offset = _write_tensor(stream, value)
    length = stream.tell() - offset
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length))


def _write_tensor(stream, tensor: torch.Tensor) -> int:
    """Write the bytes ``torch.save(tensor)`` writes (CRC-32 off); where its archive starts. ``stream`` is at a
    multiple of 64 bytes. A tensor ``_archive_frame`` covers is written as its frame around its own memory, a large
    one placed in memory order (``_place_in_memory_order``); anything else through ``torch.save``."""
    frame = _archive_frame(tensor)
    if frame is None:
        offset = stream.tell()
        torch.save(tensor, stream)
        return offset
    head, tail = frame
    _place_in_memory_order(stream, tensor, len(head))
    offset = stream.tell()
    stream.write(head)
    stream.write(tensor.reshape(-1).view(torch.uint8).numpy())
    stream.write(tail)
    return offset


_FRAMES: dict[tuple, tuple[bytes, bytes] | None] = {}
"""``_archive_frame``'s, by what ``torch.save`` writes of a tensor besides its bytes."""
_FRAMES_KEPT = 4096


def _archive_frame(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """(the bytes ``torch.save`` writes before ``tensor``'s data, those after), CRC-32 off; None when that does not
    hold (the tensor's archive is then written by ``torch.save``). With the CRC-32 off the archive of a plain,
    contiguous CPU tensor over exactly its storage is its data between bytes that depend only on its dtype, shape
    and the flags ``torch.save`` records (the zip records, ``data.pkl``, the serialization id, the 64-byte padding
    before the data; with the stride, which ``is_contiguous`` leaves free along dimensions of size 1): they are
    taken once per such key from a ``torch.save`` of the first tensor that has it, which
    writes its data in one piece and copies nothing (``_Frame``), and reused for every later one, in this save and
    the next. ``torch.save``'s cost per call is a few hundred Python-level writes through the stream and a pickler
    class made per call: about 0.1 s of the writer's CPU per save of the bench model's 198 tensors."""
    if (type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided
            or tensor.is_quantized or not tensor.numel() or not tensor.is_contiguous() or tensor.storage_offset()
            or tensor.untyped_storage().nbytes() != tensor.nbytes or tensor.__dict__):
        return None
    # the stride too: a contiguous tensor's stride along a dimension of size 1 is free, and torch.save records it
    key = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.requires_grad, tensor.is_conj(), tensor.is_neg(),
           torch.serialization.get_crc32_options())
    if key not in _FRAMES:
        if len(_FRAMES) >= _FRAMES_KEPT:
            _FRAMES.clear()
        capture = _Frame(tensor.data_ptr(), tensor.nbytes)
        torch.save(tensor, capture)
        _FRAMES[key] = capture.frame()
    return _FRAMES[key]


def _place_in_memory_order(stream, tensor: torch.Tensor, data_at: int) -> None:
    """Pad ``stream`` (a ``DirectFile`` at a multiple of 64 bytes) so that ``tensor``'s bytes, ``data_at`` bytes into
    the archive written next, lie at a file offset congruent to their address modulo the device's block size:
    ``DirectFile`` then hands that memory to the device, no copy (``write`` ``in_place_bytes``). The archive still
    starts at a multiple of 64 bytes (``checkpoint_map.ALIGNMENT``); nothing is padded when that cannot hold, for
    small tensors, or when the file is written buffered."""
    from backends.mca.checkpoint_map import ALIGNMENT

    block = getattr(stream, "alignment", 0)
    if not block or tensor.nbytes < IN_PLACE_FROM or (tensor.data_ptr() - data_at) % ALIGNMENT:
        return
    pad = (tensor.data_ptr() - data_at - stream.tell()) % block
    if pad:
        stream.write(bytes(pad))


class _Frame:
    """A write-only stream that keeps every byte ``torch.save`` writes but those of the tensor's data (the memory
    at ``address``, ``nbytes`` long, written in one piece): ``frame`` gives the bytes before and after it."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes
        self.head, self.tail, self.found = bytearray(), bytearray(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) == self.nbytes and address_of(view) == self.address:
            self.found += 1
        else:
            (self.tail if self.found else self.head).extend(view)
        return len(view)

    def flush(self) -> None:
        pass

    def frame(self) -> tuple[bytes, bytes] | None:
        return (bytes(self.head), bytes(self.tail)) if self.found == 1 else None
