"""How the standard backend writes a checkpoint's large files (``model.safetensors``, ``optimizer.pt``).

Both go past the page cache (``roll.direct_write.DirectFile``), and a background save's writer thread
(``save_async``) takes as little CPU from training as the files allow:

- ``model.safetensors`` of a background save is written by ``roll.safetensors_file.write_direct`` (W12: safetensors'
  own writer holds the GIL for the whole write); where the weights lie in memory as they will in the file (a model
  loaded from safetensors keeps one buffer in the file's order) ``DirectFile`` hands their memory to the device.
- ``optimizer.pt`` is ``torch.save``'s archive without the CRC-32 of each record (0.3 CPU s per GB; ``torch.load``
  never checks it) and with each large tensor's record placed so that its bytes lie at a file offset congruent to
  their address modulo the device's block size: a small zip member (``roll_pad/...``, zeros) before it makes up the
  difference, and ``DirectFile`` writes the tensor from its own memory, no copy (W13). ``torch.load`` reads records
  by name: the padding members are never read.

Measured on the bench model (0.94 GB of Adam state, writer thread's CPU per save): 0.46-0.51 s before (0.29 s of it
the CRC-32, most of the rest the copy into the aligned buffer); see ``docs/performance.md``.
"""

from __future__ import annotations

import os

import torch

from backends.standard import _compat
from roll.direct_write import IN_PLACE_FROM, DirectFile

PAD_PREFIX = "roll_pad/"
"""Zip members that only place the next record (zeros; never read)."""

_LOCAL_HEADER = 30
"""A zip local file header's fixed bytes."""
_U32_MAX = 0xFFFFFFFF


def save_direct(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``'s objects, written through ``roll.direct_write`` without the CRC-32, large tensors
    from their own memory (see the module doc). ``torch.load`` reads it as it reads ``torch.save``'s file; the
    archive's folder is ``archive/`` (``torch.save`` to a stream) instead of the file's stem."""
    with DirectFile(path) as out:
        _compat.torch_save_records(obj, out, before_storage=lambda write_record, name, storage, size:
                                   _place(out, write_record, name, storage.data_ptr(), size))


def _place(out: DirectFile, write_record, name: str, address: int, size: int) -> None:
    """Before the record ``name`` (``size`` bytes at ``address``) is written to ``out``: write a padding member when
    that makes the record's data lie at a file offset congruent to ``address`` modulo ``out.alignment``. Nothing
    when the file is written buffered, the tensor is small, it already lands so, or its address is not a multiple of
    torch's storage alignment (its data offset always is one)."""
    block, align = out.alignment, torch.serialization._get_storage_alignment()
    if not block or size < IN_PLACE_FROM or address % align or block % align:
        return
    at = out.tell()
    if (data_offset(at, name, size, align) - address) % block == 0:
        return
    pad_name = f"{PAD_PREFIX}{name}"
    # the padding's bytes begin at a multiple of align and are followed by miniz's data descriptor; `pad` bytes
    # (a multiple of align) move the record's header, and so its data, as far
    after = data_offset(at, pad_name, 0, align) + _descriptor(at)
    pad = (address - data_offset(after, name, size, align)) % block or block  # an empty member has no descriptor
    if (data_offset(after + pad, name, size, align) - address) % block:
        return  # a header that grows with the offset (past 4 GiB): left as torch places it
    write_record(pad_name, bytes(pad), pad)


def data_offset(cursor: int, name: str, size: int, align: int) -> int:
    """Where torch's zip writer puts the data of record ``name`` (``size`` bytes) whose local header begins at
    ``cursor``: after the header (its name under ``archive/``, the extra field torch pads with, and zip64 fields for
    sizes or offsets past 4 GiB), rounded up to ``align`` (``caffe2/serialize/inline_container.cc``, ``getPadding``)."""
    start = cursor + _LOCAL_HEADER + len(f"archive/{name}") + 4
    if size >= _U32_MAX or cursor >= _U32_MAX:
        start += 4 + (16 if size >= _U32_MAX else 0) + (8 if cursor >= _U32_MAX else 0)
    return -(-start // align) * align


def _descriptor(cursor: int) -> int:
    """Bytes of the data descriptor miniz writes after a member's data (signature, CRC-32 and the two sizes; 8-byte
    sizes in a zip64 archive, past 4 GiB)."""
    return 24 if cursor >= _U32_MAX else 16


def write_weights(save_pretrained, save_directory: str, weights: dict, kwargs: dict) -> None:
    """The model's ``save_pretrained`` of ``weights`` in the background thread: its shards through roll's writer
    (``_compat.safetensors_written_past_the_gil``)."""
    with _compat.safetensors_written_past_the_gil():
        save_pretrained(save_directory, state_dict=weights, **kwargs)
