"""The mca backend's ``save_async`` write: Megatron's asynchronous ``torch_dist`` save, its files written by a thread.

megatron-core 0.16.1's asynchronous save plans on the main thread (collective), then runs the write in a
forked process (``AsyncCallsQueue``) that forks one more process per file. On a CPU run the fork is the
snapshot: every page training updates while the child lives is copied once (copy-on-write faults in the
trainer, about a CPU second per GB on the dev VM), and the children's buffered writes cost the kernel about
another second per GB; on that VM the asynchronous save cost training more than a synchronous one.

Here the same plan and the same finalize (``save_state_dict_async_plan`` / ``save_state_dict_async_finalize``:
the write results gathered, the metadata written once every rank finished) frame a write that
``roll.background_save.BackgroundSaves`` runs in a thread of this process. Each ``__<rank>_<i>.distcp`` file is
written as the synchronous save writes its files (``checkpoint_io.direct_streams``: past the page cache, each
archive 64-byte aligned, no CRC-32; the same format, though not the same bytes: Megatron's buckets order the
items their own way, and each large tensor's archive is placed so its data is written from the tensor's own
memory, ``_place_in_memory_order``). Tensors on an
accelerator are copied to host memory on the main thread first (Megatron's device-to-host copy); tensors
already in host memory are written from training's own memory, no copy, and the request is ``live``: the
loop calls ``BackgroundSaves.fence`` before each optimizer step, which waits until the writer has read them.
"""

from __future__ import annotations

import functools
import os
import queue

import torch

from roll.direct_write import address_of


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

    from backends.mca.checkpoint_io import direct_streams, exact_storage

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
            write = functools.partial(_write_buckets, getattr(self, "transforms", None), direct_streams())
            return write, None, [self.write_buckets, self.results_queue]

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


def _write_buckets(transforms, create_stream, buckets, results: queue.SimpleQueue) -> None:
    """Write each bucket's items into its file (bytes items first, then tensors, as PyTorch's writer does) and
    put their ``WriteResult``s where ``FileSystemWriterAsync.retrieve_write_results`` reads them. An exception
    propagates (``BackgroundSaves`` reports it on the main thread, and nothing is published)."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

    written = {}
    for i, (path, storage_key, data) in enumerate(buckets):
        with create_stream(path, "wb") as stream:
            written[i] = []
            for item, value in data:
                if isinstance(value, torch.Tensor):
                    _place_in_memory_order(stream, value)
                written[i].append(_write_item(*([transforms] if transforms is not None else []), stream, value, item,
                                              storage_key, serialization_format=SerializationFormat.TORCH_SAVE))
    results.put(written)


_IN_PLACE_FROM = 1 << 20
"""Bytes from which a tensor's archive is placed so that its data is written from the tensor's own memory."""


def _place_in_memory_order(stream, tensor: torch.Tensor) -> None:
    """Pad ``stream`` (a ``direct_streams`` stream) so that ``tensor``'s bytes in the archive ``torch.save`` writes
    next lie at a file offset congruent to their address modulo the device's block size: ``DirectFile`` then hands
    that memory to the device, no copy (``write`` ``in_place_bytes``). The archive still starts at a multiple of 64
    bytes (``checkpoint_map.ALIGNMENT``); nothing is padded when that cannot hold, for small tensors, or when the
    file is written buffered. Where the data lies in the archive is found by a dry run of ``torch.save`` that
    copies nothing."""
    from backends.mca.checkpoint_map import ALIGNMENT

    block = getattr(stream, "alignment", 0)
    if not block or tensor.nbytes < _IN_PLACE_FROM:
        return
    locator = _Locator(tensor.data_ptr())
    torch.save(tensor, locator)
    if locator.found is None or (tensor.data_ptr() - locator.found) % ALIGNMENT:
        return
    at = stream.tell()  # the archive's start at a multiple of ALIGNMENT
    pad = (tensor.data_ptr() - locator.found - at) % block
    if pad:
        stream.write(bytes(pad))


class _Locator:
    """A write-only stream that keeps no byte: where ``torch.save`` writes the memory at ``address``."""

    def __init__(self, address: int) -> None:
        self.address, self.position, self.found = address, 0, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.found is None and len(view) and address_of(view) == self.address:
            self.found = self.position
        self.position += len(view)
        return len(view)

    def flush(self) -> None:
        pass
