"""roll.direct_write: the same bytes as a buffered write, past the page cache where the file system allows it."""

from __future__ import annotations

import errno
import io
import mmap
import os

import pytest
import torch

from roll import direct_write

O_DIRECT = getattr(os, "O_DIRECT", 0)


@pytest.fixture
def small_chunks(monkeypatch):
    """A 3-block buffer, so that small writes cross its boundary (the buffer is remade at the new size)."""
    monkeypatch.setattr(direct_write, "CHUNK", 3 * 4096)


def _supports_o_direct(folder) -> bool:
    """Independently of the module: can a file in ``folder`` be opened with O_DIRECT and take an aligned write."""
    if not O_DIRECT:
        return False
    path = os.path.join(folder, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | O_DIRECT)
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, 4096), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(path)


@pytest.mark.parametrize("sizes", [[0], [1], [4095, 1], [4096], [5000, 7000, 3], [3 * 4096 + 1, 2 * 4096, 17]])
def test_the_file_holds_exactly_the_bytes_written(tmp_path, small_chunks, sizes):
    """Tails shorter than a block, writes across the buffer's end, flushes in the middle (PyTorch's writer
    fsyncs a stream without closing it): the file is the concatenation, no padding left, none missing."""
    pieces = [os.urandom(n) for n in sizes]
    path = tmp_path / "out.bin"
    with direct_write.DirectFile(path, fsync=True) as out:
        for piece in pieces:
            assert out.write(piece) == len(piece)
            out.flush()
            assert os.path.getsize(path) == out.tell()
    assert path.read_bytes() == b"".join(pieces)


def test_torch_save_through_it_is_byte_identical_to_a_buffered_stream(tmp_path):
    state = {"exp_avg": torch.randn(1000, 77), "step": torch.tensor(3.0), "ids": torch.arange(5)}
    buffered = io.BytesIO()
    torch.save(state, buffered)
    with direct_write.DirectFile(tmp_path / "optimizer.pt") as out:
        torch.save(state, out)
    assert (tmp_path / "optimizer.pt").read_bytes() == buffered.getvalue()


def test_a_file_system_that_takes_o_direct_gets_it(tmp_path, small_chunks):
    """The direct path must not fall back silently: the open file carries O_DIRECT (its fdinfo flags, read by
    the kernel) after the writes, and the counter says so."""
    if not _supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    before = direct_write.stats["direct_files"]
    with direct_write.DirectFile(tmp_path / "d.bin") as out:
        out.write(os.urandom(5 * 4096 + 7))
        out.flush()
        with open(f"/proc/self/fdinfo/{out.fileno()}") as fh:
            flags = int(next(line for line in fh if line.startswith("flags:")).split()[1], 8)
        assert flags & O_DIRECT and out.direct
    assert direct_write.stats["direct_files"] == before + 1


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this OS")
@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_refused_o_direct_falls_back_to_the_same_bytes_buffered(tmp_path, small_chunks, monkeypatch, refused_at):
    real_open, real_pwrite = os.open, os.pwrite

    def open_(path, flags, *args):
        if refused_at == "open" and flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def pwrite(fd, data, offset):
        if refused_at == "write" and direct_write.fcntl.fcntl(fd, direct_write.fcntl.F_GETFL) & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwrite", pwrite)
    data = os.urandom(4 * 4096 + 100)
    assert direct_write.write_bytes(tmp_path / "b.bin", data, fsync=True) is False
    assert (tmp_path / "b.bin").read_bytes() == data


def test_two_files_open_at_once_in_one_thread_keep_their_own_bytes(tmp_path, small_chunks):
    """The thread's reused buffer goes to one open file at a time; a second one open beside it gets its own."""
    first, second = os.urandom(5 * 4096 + 7), os.urandom(4 * 4096 + 3)
    with direct_write.DirectFile(tmp_path / "a") as a, direct_write.DirectFile(tmp_path / "b") as b:
        for i in range(0, max(len(first), len(second)), 1000):
            a.write(first[i:i + 1000])
            b.write(second[i:i + 1000])
    assert (tmp_path / "a").read_bytes() == first
    assert (tmp_path / "b").read_bytes() == second
    with direct_write.DirectFile(tmp_path / "c") as c:  # the shared buffer is free again
        c.write(first)
    assert (tmp_path / "c").read_bytes() == first


@pytest.mark.parametrize("lead", [100, 4096 + 64, 0])
def test_a_source_in_memory_order_goes_to_the_device_uncopied_with_the_same_bytes(tmp_path, small_chunks, lead):
    """A write of at least ``IN_PLACE_FROM`` bytes whose address agrees with its file offset modulo the block size is
    written from the caller's memory (the aligned middle; the partial blocks around it through the buffer); one
    that does not agree is copied. The file's bytes are the same either way."""
    if not _supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    source = mmap.mmap(-1, 3 << 20)  # page-aligned
    source[:] = os.urandom(3 << 20)
    view = memoryview(source)[lead:]
    header = os.urandom(lead + 4096 * 7)  # the source's offset in the file agrees with its address
    before = direct_write.stats["in_place_bytes"]
    with direct_write.DirectFile(tmp_path / "in_place.bin") as out:
        out.write(header[:lead])
        out.write(view)  # lead + len(view) = 3 MiB: the middle is all of it but nothing
        out.write(header)
    moved = direct_write.stats["in_place_bytes"] - before
    assert moved == (len(view) // 4096 * 4096 if lead % 4096 == 0 else (len(view) - (-lead % 4096)) // 4096 * 4096)
    assert (tmp_path / "in_place.bin").read_bytes() == header[:lead] + bytes(view) + header
    with direct_write.DirectFile(tmp_path / "copied.bin") as out:
        out.write(header[:lead + 8])  # 8 bytes off: copied
        out.write(view)
    assert direct_write.stats["in_place_bytes"] - before == moved
    assert (tmp_path / "copied.bin").read_bytes() == header[:lead + 8] + bytes(view)
    del view
    source.close()


def _saved(value) -> bytes:
    """The reference: ``torch.save``'s own bytes of ``value`` with the CRC-32 off (as roll's writers save)."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        out = io.BytesIO()
        torch.save(value, out)
        return out.getvalue()
    finally:
        torch.serialization.set_crc32_options(previous)


def test_mca_background_writer_writes_torch_saves_bytes_each_large_tensor_in_place(tmp_path):
    """``checkpoint_background._write_buckets`` (save_async's writer): every tensor's entry is byte for byte what
    ``torch.save`` writes of it, though a tensor of a dtype and shape seen before is written as a cached frame around
    its own memory (tensors alike in size but not in shape, dtype or the stride of a dimension of size 1 must not
    share one; tensors alike in all of it but their values do); bytes items are their bytes; every entry starts at a multiple of 64 bytes (mca2hf maps it); a
    large tensor whose address allows it is written from its own memory. Twice, the second time from the cache."""
    if not _supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    import queue

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from backends.mca.checkpoint_background import _write_buckets
    from backends.mca.checkpoint_io import exact_storage

    odd = exact_storage(torch.randn(400_001)[1:])  # 4 bytes past a 64-byte boundary: cannot agree, not placed
    tensors = [torch.randn(300_000), torch.randn(5), odd, torch.randn(1000, 700)[:, :512].contiguous(),
               torch.randn(4, 8), torch.randn(8, 4), torch.randn(2, 8), torch.randn(32).to(torch.int32),
               torch.randn(64).to(torch.bfloat16), torch.randn(1, 8), torch.randn(8, 1).t(), torch.tensor(3.0),
               torch.zeros(0, 4), torch.randn(6, 5).t(), torch.randn(2 << 18), torch.randn(4, 8), torch.randn(300_000)]
    blobs = [io.BytesIO(os.urandom(n)) for n in (1, 100, 5000)]
    items = [(WriteItem(MetadataIndex(f"b{i}"), WriteItemType.BYTE_IO), blob) for i, blob in enumerate(blobs)]
    items += [(WriteItem(MetadataIndex(f"t{i}"), WriteItemType.TENSOR), t) for i, t in enumerate(tensors)]
    large = sum(t.nbytes for t in tensors if t.nbytes >= 1 << 20 and t is not odd)
    for attempt in range(2):
        path, results, before = tmp_path / f"__0_{attempt}.distcp", queue.SimpleQueue(), direct_write.stats["in_place_bytes"]
        _write_buckets([(str(path), path.name, items[1:]), (str(tmp_path / "other.distcp"), "other", items[:1])], results)
        written = results.get()
        assert large - 3 * 2 * 4096 <= direct_write.stats["in_place_bytes"] - before <= large  # 2 partial blocks each
        data = path.read_bytes()
        assert [r.index for r in written[0]] == [item.index for item, _ in items[1:]]
        for result, (_, value) in zip(written[0], items[1:]):
            info = result.storage_data
            assert info.relative_path == path.name and info.offset % 64 == 0 and result.size_in_bytes == info.length
            stored = data[info.offset:info.offset + info.length]
            assert stored == (value.getvalue() if isinstance(value, io.BytesIO) else _saved(value)), result.index
        assert (tmp_path / "other.distcp").read_bytes() == blobs[0].getvalue()
