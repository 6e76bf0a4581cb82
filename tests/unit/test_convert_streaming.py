"""Conversion at disk speed (issue 20 item 3): the HF reader streams shard by shard with bounded memory,
and ``roll-convert`` writes Megatron checkpoints from its own process with a progress bar.

- in-process: the streaming loader on a tiny checkpoint saved in many shards, through a spy on its
  safetensors reader: every file is read once, in order, tensor by tensor; at the file's dtype every tensor
  lands in its parameter directly (1:1 renames whole, q/k/v and gate/up in the slices of the fused
  parameter), nothing buffered; at another dtype each is converted into place as it arrives, so the HF
  tensors held at any moment are one tensor, below the largest shard (a whole-model read would hold all
  of them);
- one subprocess: ``roll-convert hf2mca`` then ``mca2hf`` with process creation made to fail (Megatron's
  default writer spawns a manager and forks writers), bit-exact round trip, a byte progress bar on stderr
  for each of the four phases, and every tensor of the Megatron checkpoint read straight into the model
  (``backends.mca.checkpoint_io``: one positioned read, not PyTorch's three copies);
- ``roll-convert mca2hf`` maps what it writes unchanged: every stored tensor 64-byte aligned in its ``.distcp`` file
  (``checkpoint_map``), the parameters stored whole served from the files' private maps and copied file to file
  into the HF files (counted, so a silent fallback to reading fails), the fused gate/up weight's halves (two
  archives) left unread and copied from their own file spans, and a checkpoint of the layout before that
  (archives 1-byte aligned) still converts bit-exactly; its safetensors writer writes safetensors' own bytes;
- ``checkpoint_io.stored_tensor`` on ``torch.save`` archives: it finds the bytes of a whole contiguous tensor
  (checked against ``torch.load``) and declines every other layout, which must go through PyTorch's reader.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import output_of, run

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca



def _sharded_copy(src: str, dst: str, max_shard: str = "60KB") -> str:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst, max_shard_size=max_shard)
    assert len(glob.glob(os.path.join(dst, "*.safetensors"))) >= 4
    return dst


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    return {name: tensor for f in files for name, tensor in load_file(f).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["in_place", "buffered"])
def test_loader_reads_shard_by_shard_with_bounded_memory(tiny_model_factory, tmp_path, monkeypatch, dtype):
    from backends.mca.models import layout, loader
    from backends.mca.models.config import McaModelConfig
    from backends.mca.models.template import get_template
    from tests.unit.test_mca_templates import _fake_chunk

    model_dir = _sharded_copy(tiny_model_factory("qwen2", tie_word_embeddings=False), str(tmp_path / "hf"))
    hf = _weights(model_dir)
    config = McaModelConfig.from_hf(json.loads(open(os.path.join(model_dir, "config.json")).read()))
    expected = {layout.to_impl_name(n, config): t for n, t in get_template("qwen2").hf_to_mca(hf, config).items()}
    expected = {n: t.to(dtype) for n, t in expected.items()}
    chunk = _fake_chunk({n: tuple(t.shape) for n, t in expected.items()}).to(dtype)
    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in chunk.parameters()]

    def inside_a_parameter(tensor) -> bool:
        return any(begin <= tensor.data_ptr() < end for begin, end in spans)

    reads: list[tuple[str, str, bool]] = []  # (file, tensor, read straight into a parameter)
    held = {"now": 0, "peak": 0}

    def release(nbytes: int) -> None:
        held["now"] -= nbytes

    class Spy(loader.SafetensorsFile):
        def read(self, name, out=None):
            tensor = super().read(name, out)
            reads.append((os.path.basename(self.path), name, out is not None and inside_a_parameter(out)))
            if out is None:  # a buffer the loader holds until its mapping is complete
                nbytes = tensor.numel() * tensor.element_size()
                held["now"] += nbytes
                held["peak"] = max(held["peak"], held["now"])
                weakref.finalize(tensor, release, nbytes)
            return tensor

        def read_into(self, name, outs):
            super().read_into(name, outs)
            reads.append((os.path.basename(self.path), name, all(inside_a_parameter(out) for out in outs)))

    monkeypatch.setattr(loader, "SafetensorsFile", Spy)
    coords = {"tp_size": 1, "tp_rank": 0, "etp_size": 1, "etp_rank": 0}
    place = layout.placement(config, pp_rank=0, vpp_stage=0, ep_rank=0)
    report = loader.load_hf_weights([chunk], config, model_dir, placements=[place], coords=coords)

    loaded = chunk.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in expected.items()), [n for n in expected if not
                                                                        torch.equal(loaded[n], expected[n])]
    files = [f for f, _, _ in reads]
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert runs == sorted(set(files)) == report.files_read  # each file once, in order, never reopened
    assert sorted(n for _, n, _ in reads) == sorted(hf)  # tensor by tensor, each exactly once
    largest_shard = max(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")))
    total = sum(t.numel() * t.element_size() for t in hf.values())
    if dtype == torch.float32:  # the file's: every byte straight into its place, q/k/v and gate/up included
        assert all(direct for _, _, direct in reads) and held["peak"] == 0, (reads, held)
    else:  # converted into place through a buffer of one tensor at a time
        assert not any(direct for _, _, direct in reads)
        largest_tensor = max(t.numel() * t.element_size() for t in hf.values())
        assert 0 < held["peak"] <= largest_tensor < largest_shard < total / 3, (held, largest_shard, total)
    assert held["now"] == 0  # nothing kept after the load
    assert report.bytes_read == total and report.bytes_mapped == 0  # maps only when asked (roll-convert hf2mca)


def test_safetensors_spans_are_mapped_copy_on_write(tmp_path):
    """``SafetensorsFile.mapped``: tensors stored one after the other, in the order asked and at the dtype asked,
    come back as one view of the file's bytes; any other request gets None; writing into a view never reaches
    the file (a private map: ``roll-convert hf2mca`` must leave the user's checkpoint as it was)."""
    from safetensors.torch import save_file

    from backends.mca.models.safetensors_io import SafetensorsFile

    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(10.0, 14.0), "c": torch.arange(20.0, 23.0),
               "h": torch.ones(3, dtype=torch.bfloat16)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    before = open(path, "rb").read()
    with SafetensorsFile(path) as fh:
        order = sorted(fh.keys(), key=lambda n: fh._entries[n]["data_offsets"][0])
        assert order[:3] == ["a", "b", "c"], order  # safetensors' own order: by dtype size, then name
        span = fh.mapped(["a", "b"], torch.float32)
        assert torch.equal(span, torch.cat([tensors["a"].reshape(-1), tensors["b"]]))
        assert torch.equal(fh.mapped(["c"], torch.float32), tensors["c"])
        assert fh.mapped(["a", "c"], torch.float32) is None  # b lies between them
        assert fh.mapped(["b", "a"], torch.float32) is None  # stored the other way round
        assert fh.mapped(["h"], torch.float32) is None  # another dtype
    span.fill_(-1.0)  # the map outlives the file object; the write copies the page, never the file
    assert torch.equal(span, torch.full((10,), -1.0)) and open(path, "rb").read() == before


def test_safetensors_writer_writes_safetensors_own_bytes_and_copies_mapped_tensors(tmp_path, monkeypatch):
    """``safetensors_io.write_file`` (mca2hf's writer) and ``roll.safetensors_file.write_direct`` (a background
    save's): the same bytes as ``safetensors.torch.save_file`` for every dtype roll reads (its own order: by dtype,
    then name; header padded to 8; write_direct's maybe with more spaces), and a tensor over a live ``private_map`` copied from its file by the kernel:
    exactly those bytes, and only when the map lives."""
    from safetensors.torch import save_file

    from backends.mca.models.safetensors_io import private_map, write_file
    from roll.safetensors_file import write_direct

    tensors = {"b.weight": torch.randn(3, 5), "a.bias": torch.randn(7).to(torch.bfloat16), "ids": torch.arange(5),
               "mask": torch.ones(2, dtype=torch.bool), "h": torch.randn(2, 2).half(), "scalar": torch.tensor(3.0),
               "empty": torch.empty(0, 3), "i8": torch.ones(3, dtype=torch.int8), "f64": torch.randn(2).double(),
               "i32": torch.ones(1, dtype=torch.int32), "u8": torch.ones(1, dtype=torch.uint8),
               "i16": torch.ones(2, dtype=torch.int16), "f8": torch.ones(4).to(torch.float8_e4m3fn),
               "large": torch.randn(300_000)}  # over DirectFile's small-copy size
    for metadata in ({"format": "pt"}, None):
        save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
        assert write_file(str(tmp_path / "ours.safetensors"), tensors, metadata) == 0
        write_direct(tensors, str(tmp_path / "direct.safetensors"), metadata=metadata)
        theirs = (tmp_path / "theirs.safetensors").read_bytes()
        assert (tmp_path / "ours.safetensors").read_bytes() == theirs
        direct = (tmp_path / "direct.safetensors").read_bytes()
        length = int.from_bytes(direct[:8], "little")  # write_direct may pad its header further (placement)
        header = direct[8:8 + length].rstrip(b" ")
        header += b" " * (-len(header) % 8)
        assert len(header).to_bytes(8, "little") + header + direct[8 + length:] == theirs
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(3 * 4096 + 100))
    fd = os.open(source, os.O_RDONLY)
    try:
        mapping = private_map(fd)
    finally:
        os.close(fd)  # the map keeps a descriptor of its own
    over_map = {"big": torch.frombuffer(mapping, dtype=torch.int32, count=2048, offset=100),  # 2 pages: copied
                "small": torch.frombuffer(mapping, dtype=torch.int32, count=16, offset=8)}  # under a page: written
    copied = write_file(str(tmp_path / "copied.safetensors"), over_map)
    assert copied == over_map["big"].nbytes
    assert _weights_of(str(tmp_path / "copied.safetensors")) == {n: t.tolist() for n, t in over_map.items()}
    expected = {n: t.clone() for n, t in over_map.items()}
    _unread_halves_come_from_their_files(tmp_path, mapping, monkeypatch)
    del over_map, mapping
    assert write_file(str(tmp_path / "written.safetensors"), expected) == 0  # no live map: written from memory


def _unread_halves_come_from_their_files(tmp_path, mapping, monkeypatch) -> None:
    """A tensor over ``unread_memory`` (mca2hf's gate/up weight) whose halves two file spans back, in the other
    order: each half written is its own span's bytes (copied, or read from the file where the kernel refuses),
    whatever its size, and a tensor across both spans is refused, not written from memory it never held."""
    import warnings

    from backends.mca.models import safetensors_io

    memory = safetensors_io.unread_memory(2 * 4096)
    safetensors_io.file_backed(memory, 4096, 4096, mapping, 8)
    safetensors_io.file_backed(memory, 0, 4096, mapping, 100 + 4096)
    with warnings.catch_warnings():  # no access at all: a read-only buffer to Python
        warnings.simplefilter("ignore", UserWarning)
        gate, up = torch.frombuffer(memory, dtype=torch.int32).view(2, 1024).chunk(2)
        across = torch.frombuffer(memory, dtype=torch.int32, count=1024, offset=2048)
    want = {"gate": torch.frombuffer(mapping, dtype=torch.int32, count=1024, offset=100 + 4096).tolist(),
            "up": torch.frombuffer(mapping, dtype=torch.int32, count=1024, offset=8).tolist()}
    tensors = {"gate": gate.reshape(-1), "up": up.reshape(-1), "up.row": up[0, :16]}
    want["up.row"] = want["up"][:16]
    assert safetensors_io.write_file(str(tmp_path / "halves.safetensors"), tensors) == 2 * 4096 + 64
    assert _weights_of(str(tmp_path / "halves.safetensors")) == want
    monkeypatch.setattr(safetensors_io, "copy_range", lambda *args: False)
    assert safetensors_io.write_file(str(tmp_path / "read.safetensors"), tensors) == 0
    assert _weights_of(str(tmp_path / "read.safetensors")) == want
    with pytest.raises(AssertionError, match="no one file span"):
        safetensors_io.write_file(str(tmp_path / "across.safetensors"), {"across": across})


def _weights_of(path: str) -> dict[str, list]:
    from safetensors.torch import load_file

    return {name: tensor.tolist() for name, tensor in load_file(path).items()}


def test_mapped_params_take_row_blocks_whole_or_partly(tmp_path):
    """``checkpoint_map.MappedParams`` on a parameter stored as two archives (the fused gate/up weight): both halves
    taken, the parameter is unread memory whose halves ``write_file`` copies from their own file spans (stored in the
    other order here); one half taken, that half is copied into the parameter from the map, the other kept."""
    from backends.mca.checkpoint_map import MappedParams
    from backends.mca.models.safetensors_io import write_file

    source = tmp_path / "archives.bin"
    source.write_bytes(torch.randn(5 * 1024).numpy().tobytes())
    stored = torch.frombuffer(bytearray(source.read_bytes()), dtype=torch.float32)
    up_at, gate_at = 64, 2 * 4096 + 128  # byte offsets of each half's bytes in the file
    gate, up = stored[gate_at // 4:gate_at // 4 + 1024].view(2, 512), stored[up_at // 4:up_at // 4 + 1024].view(2, 512)
    for taken in ("both", "up", "both, not gated"):
        chunk = torch.nn.Module()
        chunk.config = SimpleNamespace(gated_linear_unit=taken != "both, not gated")
        chunk.linear_fc1 = fc1 = torch.nn.Linear(512, 4, bias=False)
        before = fc1.weight.detach().clone()
        mapped = MappedParams([chunk])
        fd = os.open(source, os.O_RDONLY)
        try:
            halves = fc1.weight.data.chunk(2)
            assert mapped.take(fd, str(source), up_at, halves[1])
            assert taken == "up" or mapped.take(fd, str(source), gate_at, halves[0])
        finally:
            os.close(fd)
        mapped.apply()
        if taken == "up":
            assert torch.equal(fc1.weight[:2], before[:2]) and torch.equal(fc1.weight[2:], up)
            continue
        if taken == "both, not gated":  # halves of another weight (a TP2 save's): copied in, read as memory
            assert torch.equal(fc1.weight, torch.cat([gate, up]))
            continue
        assert mapped.nbytes == fc1.weight.nbytes
        out = str(tmp_path / "fc1.safetensors")
        halves = fc1.weight.data.chunk(2)
        assert write_file(out, {"gate_proj": halves[0], "up_proj": halves[1]}) == fc1.weight.nbytes
        assert _weights_of(out) == {"gate_proj": gate.tolist(), "up_proj": up.tolist()}


def test_loader_maps_whole_parameters_for_a_conversion(tiny_model_factory, tmp_path):
    """``load_hf_weights(map_files=True)`` (``roll-convert hf2mca``): every parameter stored whole in the file (1:1
    renames, gate then up) becomes a view of the file's map, nothing copied; q/k/v, interleaved per query group, is
    read into its parameter as before; the values are the template's; the file stays unchanged after writing
    into every parameter."""
    from backends.mca.models import layout, loader
    from backends.mca.models.config import McaModelConfig
    from backends.mca.models.template import get_template
    from tests.unit.test_mca_templates import _fake_chunk

    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    (file,) = glob.glob(os.path.join(model_dir, "*.safetensors"))
    before = open(file, "rb").read()
    hf = _weights(model_dir)
    config = McaModelConfig.from_hf(json.loads(open(os.path.join(model_dir, "config.json")).read()))
    expected = {layout.to_impl_name(n, config): t for n, t in get_template("qwen2").hf_to_mca(hf, config).items()}
    chunk = _fake_chunk({n: tuple(t.shape) for n, t in expected.items()})
    own = {n: p.data_ptr() for n, p in chunk.named_parameters()}
    coords = {"tp_size": 1, "tp_rank": 0, "etp_size": 1, "etp_rank": 0}
    place = layout.placement(config, pp_rank=0, vpp_stage=0, ep_rank=0)
    report = loader.load_hf_weights([chunk], config, model_dir, placements=[place], coords=coords, map_files=True)

    params = dict(chunk.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in expected.items())
    moved = {n for n, p in params.items() if p.data_ptr() != own[n]}
    assert moved == {n for n in params if "linear_qkv" not in n}, sorted(set(params) - moved)
    qkv = sum(t.nbytes for n, t in hf.items() if any(f".{x}_proj." in n for x in "qkv"))
    assert report.bytes_read == sum(t.nbytes for t in hf.values()) and report.bytes_mapped == report.bytes_read - qkv
    with torch.no_grad():
        for param in params.values():
            param.fill_(7.0)
    assert open(file, "rb").read() == before


_NO_PROCESSES = """
import multiprocessing.process, os, sys
def refuse(*args, **kwargs):
    raise RuntimeError("conversion started a process")
os.fork = refuse
multiprocessing.process.BaseProcess.start = refuse
from backends.mca import checkpoint_io, convert_cli
from roll.logging import setup_logging
setup_logging()
reads = {True: 0, False: 0}
in_place = checkpoint_io._read_in_place
def counted(*args):
    done = in_place(*args)
    reads[done] += 1
    return done
checkpoint_io._read_in_place = counted
copied, copy = [0], os.copy_file_range
def copy_counted(*args):
    done = copy(*args)
    copied[0] += done
    return done
os.copy_file_range = copy_counted
hf, mca, back, old, old_back = sys.argv[1:6]
assert convert_cli.run(["hf2mca", "--input", hf, "--output", mca]) == 0
print("bytes copied file to file", copied[0])
copied[0] = 0
assert convert_cli.run(["mca2hf", "--input", mca, "--output", back, "--max-shard-gb", "0.00005"]) == 0
print("tensors read in place", reads[True], "through PyTorch's reader", reads[False])
print("mca2hf bytes copied file to file", copied[0])
from backends.mca import checkpoint_map
checkpoint_map.aligning_archives = lambda create_stream: create_stream  # the layout before session 42
assert convert_cli.run(["hf2mca", "--input", hf, "--output", old]) == 0
assert convert_cli.run(["mca2hf", "--input", old, "--output", old_back]) == 0
"""


def _archive_alignments(mca: str) -> list[int]:
    """Where each stored tensor's bytes begin in its ``.distcp`` file, modulo 64 (``checkpoint_io.stored_tensor``
    on every item PyTorch's own ``.metadata`` lists)."""
    from torch.distributed.checkpoint import FileSystemReader

    from backends.mca.checkpoint_io import stored_tensor

    alignments = []
    for info in FileSystemReader(mca).read_metadata().storage_data.values():
        fd = os.open(os.path.join(mca, info.relative_path), os.O_RDONLY)
        try:
            found = stored_tensor(fd, info.offset, info.length)
        finally:
            os.close(fd)
        if found is not None:
            alignments.append((info.offset + found[0]) % 64)
    return alignments


def test_roll_convert_writes_from_its_own_process_with_progress(tiny_model_factory, tmp_path):
    hf = _sharded_copy(tiny_model_factory("llama", tie_word_embeddings=False), str(tmp_path / "hf"))
    mca, back, old, old_back = (str(tmp_path / name) for name in ("mca", "back", "old", "old_back"))
    proc = run([sys.executable, "-c", _NO_PROCESSES, hf, mca, back, old, old_back], timeout=240)
    assert proc.returncode == 0, output_of(proc)
    assert os.path.isfile(os.path.join(mca, "metadata.json")) and glob.glob(os.path.join(mca, "*.distcp"))
    a, b = _weights(hf), _weights(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    for bar in ("read HF weights: 100%", "write Megatron weights: 100%", "read Megatron weights: 100%",
                "write HF weights: 100%"):
        assert bar in proc.stderr and "B/s]" in proc.stderr, output_of(proc)
    for log in ("GB of HF weights from", "saved model checkpoint (torch_dist", "loaded model checkpoint", "GB/s",
                "GB of them mapped, not copied"):  # hf2mca maps what it stores unchanged: the round trip is exact
        assert log in proc.stderr, output_of(proc)
    for command, folder in (("hf2mca", hf), ("mca2hf", old_back)):  # its own time and GB/s (roll-bench reads it)
        gb = sum(os.path.getsize(path) for path in glob.glob(os.path.join(folder, "*.safetensors"))) / 1e9
        assert f"{command}: converted {gb:.3f} GB of HF weights in " in proc.stderr, output_of(proc)
    tensors = sum(1 for name in a if not name.endswith("_extra_state"))  # fused in Megatron: fewer, never 0
    counts = [int(word) for word in proc.stdout.split("tensors read in place")[1].split() if word.isdigit()]
    assert counts[0] >= tensors // 2 and counts[1] == 0, proc.stdout  # every tensor in place
    copied = int(proc.stdout.split("bytes copied file to file")[1].split()[0])
    mapped = [line for line in proc.stderr.splitlines() if "mapped, not copied" in line]
    assert copied > 0 and mapped, proc.stdout  # the mapped parameters went from the HF files to the .distcp by the kernel
    # mca2hf: every stored tensor's bytes 64-byte aligned in its file, so the parameters stored whole are views of
    # the .distcp files' maps and the gate/up halves (two archives of one parameter, each one HF tensor) lie only in
    # their archives, all copied file to file into the safetensors files; a silent fallback to reading and writing
    # them copies less. Written from memory: q/k/v (split per query group) and what a page does not hold (norms).
    assert _archive_alignments(mca) and set(_archive_alignments(mca)) == {0}
    mca2hf_copied = int(proc.stdout.split("mca2hf bytes copied file to file")[1].split()[0])
    assert mca2hf_copied == sum(t.nbytes for n, t in a.items() if not any(q in n for q in ("q_proj", "k_proj", "v_proj"))
                                and (t.nbytes >= mmap.PAGESIZE or "gate_proj" in n or "up_proj" in n)), proc.stdout
    loaded = [line for line in proc.stderr.splitlines() if "loaded model checkpoint" in line][0]
    assert "mapped, not copied" in loaded, loaded
    # a checkpoint written before the archives were aligned (most tensors at odd offsets) still converts exactly
    assert set(_archive_alignments(old)) - {0}, "the old layout's archives are 1-byte aligned"
    c = _weights(old_back)
    assert sorted(a) == sorted(c) and all(torch.equal(a[n], c[n]) for n in a)


def _archive(tmp_path, value, name: str) -> tuple[str, int, int]:
    """``value`` saved by ``torch.save`` (CRC off, as roll's writer) after 37 bytes of other data: (path,
    offset, length), the way a ``.distcp`` file holds each tensor."""
    path = str(tmp_path / name)
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with open(path, "wb") as fh:
            fh.write(b"x" * 37)
            torch.save(value, fh)
    finally:
        torch.serialization.set_crc32_options(crc32)
    return path, 37, os.path.getsize(path) - 37


def test_stored_tensor_finds_whole_contiguous_tensors_only(tmp_path):
    from backends.mca.checkpoint_io import stored_tensor

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    found = {}
    cases = {"whole": base, "bf16": base.to(torch.bfloat16), "scalar": torch.tensor(3.5),
             "transposed": base.t(), "offset_view": base[1:], "half_of_it": base.chunk(2)[0],
             "not_a_tensor": {"a": base}}
    for name, value in cases.items():
        path, offset, length = _archive(tmp_path, value, name)
        fd = os.open(path, os.O_RDONLY)
        try:
            found[name] = stored_tensor(fd, offset, length)
            if found[name] is not None:
                data_offset, dtype, size = found[name]
                out = torch.empty(size, dtype=dtype)
                os.preadv(fd, [memoryview(out.reshape(-1).view(torch.uint8).numpy())], offset + data_offset)
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    assert torch.equal(out, torch.load(fh, weights_only=True)), name  # the reader's own view
        finally:
            os.close(fd)
    assert {name for name, hit in found.items() if hit} == {"whole", "bf16", "scalar"}, found
    assert found["whole"][1:] == (torch.float32, [4, 6]) and found["bf16"][1] == torch.bfloat16
    fd = os.open(path, os.O_RDONLY)
    try:
        assert stored_tensor(fd, 0, 37) is None  # not an archive at all
    finally:
        os.close(fd)


def test_parts_of_stored_tensors_are_read_in_place_at_another_layout(tmp_path):
    """A load at another layout asks for a box of a stored tensor (a TP shard of a TP1 checkpoint) or puts a stored
    shard into a part of a larger parameter (a TP2 checkpoint into a TP1 model): ``_read_in_place`` reads each run
    of consecutive stored elements straight into its place, checked against ``torch.load`` of the whole tensor and
    indexing; a target whose runs would not be contiguous is declined (PyTorch's reader takes it)."""
    from types import SimpleNamespace

    from backends.mca import checkpoint_io

    def read(stored: torch.Tensor, offsets: list[int], target: torch.Tensor, name: str) -> bool:
        path, offset, length = _archive(tmp_path, stored, name)
        fd, committed = os.open(path, os.O_RDONLY), []
        planner = SimpleNamespace(resolve_tensor=lambda req: target, commit_tensor=lambda req, t: committed.append(t))
        try:
            done = checkpoint_io._read_in_place(fd, SimpleNamespace(offset=offset, length=length),
                                                SimpleNamespace(storage_offsets=offsets, lengths=list(target.shape)),
                                                planner)
        finally:
            os.close(fd)
        assert len(committed) == done and (not done or committed[0].data_ptr() == target.data_ptr()), name
        return done

    stored = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    big = torch.full((8, 12, 5), -1.0)
    cases = {  # name: (offsets into the stored tensor, the target, what it must hold then)
        "whole": ([0, 0, 0], torch.empty(4, 6, 5), stored),
        "first_dim_shard": ([2, 0, 0], torch.empty(2, 6, 5), stored[2:]),
        "second_dim_shard": ([0, 3, 0], torch.empty(4, 3, 5), stored[:, 3:]),
        "box": ([1, 2, 1], torch.empty(2, 3, 3), stored[1:3, 2:5, 1:4]),
        "into_a_larger_target": ([0, 0, 0], big[4:, 6:], stored),
    }
    for name, (offsets, target, expected) in cases.items():
        assert read(stored, offsets, target, name) and torch.equal(target, expected), name
    assert (big[:4] == -1).all() and (big[4:, :6] == -1).all()  # nothing written outside the target
    scalar = torch.empty(())
    assert read(torch.tensor(2.5), [], scalar, "scalar") and scalar.item() == 2.5
    crossed = torch.empty(5, 6, 4).transpose(0, 2)  # [4, 6, 5]: no run of stored elements lands contiguously
    assert not read(stored, [0, 0, 0], crossed, "crossed")
    assert len(checkpoint_io.box_runs([4, 6, 5], [0, 3, 0], torch.empty(4, 3, 5))) == 4  # a run per row
    assert len(checkpoint_io.box_runs([4, 6, 5], [2, 0, 0], torch.empty(2, 6, 5))) == 1


def test_conversion_memory_of_a_7b_shape_by_hand():
    """Qwen2.5-7B (hidden 3584, 28 heads / 4 KV of 128, FFN 18944, vocab 152064, untied), bf16 safetensors."""
    from roll.plan.convert import conversion_memory, conversion_memory_line
    from roll.plan.shape import KNOWN_SHAPES

    shape = KNOWN_SHAPES["qwen2.5-7b"]
    fp32, bf16 = conversion_memory(shape), conversion_memory(shape, megatron_bytes=2)
    assert fp32.weights == 4 * 7_615_616_512 and bf16.weights == 2 * 7_615_616_512
    assert fp32.hf2mca_extra == 152064 * 3584 * 2  # the bf16 embedding, read before its cast to fp32
    assert bf16.hf2mca_extra == 2 * 18944 * 3584 * 2 * 2  # gate + up of one layer, then their concatenation
    assert fp32.mca2hf_extra == 152064 * 3584 * 4 + 2 * 1024**3  # the staged embedding + one output shard
    assert "hf2mca 31.6 GB" in conversion_memory_line() and "15.8 GB" in conversion_memory_line()


def test_bench_times_a_process_with_its_peak_memory_and_cpu():
    """roll-bench's conversion rows: the kernel's high-water mark of the child (a 200 MB string is in it) and
    its CPU time; a failing child is reported with its exit code; the table divides the net peak by the model."""
    from roll.bench import report
    from roll.bench.convert import _row, _timed

    child = "import time; x = b'a' * 200_000_000; print(len(x)); time.sleep(0.3)"  # read every 20 ms
    held = b"b" * 400_000_000  # this process's memory must not floor the child's (wait4's ru_maxrss did)
    wall, status, out, peak, cpu = _timed([sys.executable, "-c", child], 60)
    assert status == "ok" and out.strip() == "200000000" and 200e6 < peak < 350e6 and 0 < cpu <= wall * 4
    del held
    assert _timed([sys.executable, "-c", "raise SystemExit(3)"], 60)[1].startswith("failed (exit 3)")
    rows = [_row("raw read", 10**9, 2.0, "ok", net=1.0, rss=int(1.5e9)), _row("hf2mca", 10**9, 4.0, "ok", net=2.0,
                                                                                 rss=int(2.7e9))]
    for row in rows:
        row.update(startup_s=2.0, startup_rss_gb=0.5)
    table = "\n".join(report.conversion_table(rows))
    assert "| hf2mca | 1.000 | 4.0 | 0.250 | 2.00 | 0.500 | - | - | 2.70 | 2.20 | ok |" in table, table


def test_fused_gate_up_merges_into_the_parameter_itself():
    """Megatron saves the fused gate/up weight as two halves (a ShardedTensorFactory) and on load concatenates
    them into a new tensor, every layer's held until the state dict is applied; ``merge_in_place`` returns the
    parameter the halves were loaded into instead, the same values as Megatron's own merge."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from backends.mca.checkpoint_io import merge_in_place

    param = torch.zeros(6, 4)
    factory = apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1", param), ())
    state = {"decoder": {"fc1": factory}}
    merge_in_place(state)
    assert state["decoder"]["fc1"] is factory and isinstance(factory, ShardedTensorFactory)
    halves = [sh.data for sh in factory.build()]  # what the load writes into
    for i, half in enumerate(halves):
        half.copy_(torch.arange(12.0).reshape(3, 4) + 100 * i)
    merged = factory.merge_fn(halves)
    assert merged.data_ptr() == param.data_ptr() and torch.equal(merged, torch.cat(halves))
    copies = [half.clone() for half in halves]  # pieces elsewhere (a loader that did not read in place)
    elsewhere = factory.merge_fn(copies)
    assert elsewhere.data_ptr() != param.data_ptr() and torch.equal(elsewhere, torch.cat(copies))
