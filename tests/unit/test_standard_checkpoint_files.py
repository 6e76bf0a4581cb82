"""backends.standard.checkpoint_files: ``optimizer.pt`` without CRC-32, large tensors written from their own memory,
read back by ``torch.load`` and roll's allow-list loader as ``torch.save``'s file is."""

from __future__ import annotations

import struct
import zipfile

import torch

from backends.standard.checkpoint_files import PAD_PREFIX, save_direct
from roll import direct_write, unpickle
from tests.unit.test_direct_write import _supports_o_direct


def _adam_state() -> dict:
    """An AdamW state of parameters of several sizes (their tensors land at various addresses modulo a page), one
    parameter a view of a larger tensor (saved as its whole storage), some under the in-place size."""
    torch.manual_seed(0)
    big = torch.randn(300_000)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (262_144 + 48, 262_144 * 3 + 16, 700_001, 300, 1)]
    params.append(torch.nn.Parameter(big[1000:]))
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()
    state["extra"] = {"view": big[10:20], "ids": torch.arange(5), "note": "plain data", "ratio": 0.5}
    return state


def _members(path) -> dict[str, tuple[int, int]]:
    """Each zip member's (data offset, CRC-32), read from its own local header."""
    out = {}
    with open(path, "rb") as fh, zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            fh.seek(info.header_offset)
            name_length, extra_length = struct.unpack("<HH", fh.read(30)[26:30])
            out[info.filename] = (info.header_offset + 30 + name_length + extra_length, info.CRC)
    return out


def _assert_same(loaded, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert loaded.dtype == expected.dtype and torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert loaded.keys() == expected.keys()
        for key in expected:
            _assert_same(loaded[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(loaded) == len(expected)
        for a, b in zip(loaded, expected):
            _assert_same(a, b)
    else:
        assert loaded == expected


def test_optimizer_file_loads_as_torch_saves_and_its_large_tensors_are_written_in_place(tmp_path):
    """Read back by ``torch.load`` (mapped too) and by roll's allow-list loader (what HF's resume goes through):
    every tensor bit for bit, views and plain data included; no member carries a CRC-32; and where the file system
    takes O_DIRECT every tensor of at least 1 MiB went from its own memory to the device (DirectFile's counter: all
    but the unaligned head and tail of each), its bytes at a file offset congruent to its address."""
    state = _adam_state()
    path = tmp_path / "optimizer.pt"
    before = direct_write.stats["in_place_bytes"]
    save_direct(state, path)
    in_place = direct_write.stats["in_place_bytes"] - before
    _assert_same(torch.load(path, weights_only=True), state)
    _assert_same(torch.load(path, weights_only=True, mmap=True), state)
    _assert_same(unpickle.torch_load(str(path), map_location="cpu"), state)
    unpickle.check_folder(str(tmp_path))
    members = _members(path)
    assert all(crc == 0 for _, crc in members.values())
    large = [t.nbytes for s in state["state"].values() for t in s.values() if t.nbytes >= 1 << 20]
    assert len(large) == 8  # exp_avg and exp_avg_sq of four parameters
    large.append(state["extra"]["view"].untyped_storage().nbytes())  # a view saves its whole storage
    if not _supports_o_direct(tmp_path):
        assert in_place == 0
        return
    assert sum(large) - 2 * 4096 * len(large) <= in_place <= sum(large)
    assert any(name.startswith(f"archive/{PAD_PREFIX}") for name in members)


def test_a_buffered_file_is_torch_saves_without_padding(tmp_path, monkeypatch):
    """Where the file system refuses O_DIRECT nothing is placed: the members are ``torch.save``'s own."""
    monkeypatch.setattr(direct_write.os, "O_DIRECT", 0, raising=False)
    state = _adam_state()
    save_direct(state, tmp_path / "optimizer.pt")
    _assert_same(torch.load(tmp_path / "optimizer.pt", weights_only=True), state)
    assert not any(PAD_PREFIX in name for name in _members(tmp_path / "optimizer.pt"))


def test_weights_in_one_buffer_in_file_order_go_to_the_device_whole(tmp_path):
    """``write_direct`` (a background save's ``model.safetensors``) of tensors that are views of one buffer in the
    file's order, as transformers 5 loads them from a safetensors file, at an address no header length makes
    congruent by chance: the header's padding moves them all so; safetensors reads the same tensors back."""
    from safetensors.torch import load_file

    from roll.safetensors_file import encode_header, write_direct

    flat = torch.randn(3 * 262_144 + 1000)
    names = ("a.weight", "b.weight", "c.weight")  # save_file's order: by name within a dtype
    tensors = {name: flat[1000 + i * 262_144:1000 + (i + 1) * 262_144].view(512, 512) for i, name in enumerate(names)}
    header, order = encode_header(tensors)
    assert order == list(names)
    before = direct_write.stats["in_place_bytes"]
    write_direct(tensors, tmp_path / "model.safetensors")
    in_place = direct_write.stats["in_place_bytes"] - before
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], tensors[n]) for n in names)
    if _supports_o_direct(tmp_path):
        assert 3 * 262_144 * 4 - 3 * 4096 <= in_place <= 3 * 262_144 * 4  # each: a block at most through the buffer


class _Positions:
    """A stream that keeps no byte (``alignment`` as ``DirectFile``'s): the file offset of each large write whose
    memory is one of ``watched`` (address -> name)."""

    alignment = 4096

    def __init__(self, watched: dict[int, str]) -> None:
        self.position, self.watched, self.found = 0, watched, {}

    def tell(self) -> int:
        return self.position

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= 1 << 20 and direct_write.address_of(view) in self.watched:
            self.found[self.watched[direct_write.address_of(view)]] = self.position
        self.position += len(view)
        return len(view)

    def flush(self) -> None:
        pass


def test_placement_holds_past_4_gib_where_the_archive_is_zip64():
    """A record of over 4 GiB and records whose headers start past 4 GiB get zip64 fields and descriptors: each
    large tensor's bytes still land at an offset congruent to its address (never-touched memory: no RAM used)."""
    from backends.standard import _compat
    from backends.standard.checkpoint_files import _place

    state = {"huge": torch.empty(1_100_000_000)}
    state.update({f"after{k}": torch.empty(262_144 + 3 * k) for k in range(24)})  # headers at every offset mod 64
    out = _Positions({tensor.data_ptr(): name for name, tensor in state.items()})
    _compat.torch_save_records(state, out, before_storage=lambda write_record, name, storage, size:
                               _place(out, write_record, name, storage.data_ptr(), size))
    assert out.found.keys() == state.keys() and out.found["after0"] > 4 << 30
    assert all((out.found[name] - tensor.data_ptr()) % 4096 == 0 for name, tensor in state.items())
