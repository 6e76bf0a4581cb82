"""The ``.safetensors`` format's header, and a writer of whole files past the page cache.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces to a
multiple of 8, then the data, offsets relative to its start. ``encode_header`` lays the tensors out as
``safetensors.torch.save_file`` does (by dtype, the largest first in the Rust crate's ``Dtype`` order, then by
name), so a file written from it has that function's bytes.

``write_direct`` is for background checkpoint writers: safetensors' own ``save_file`` holds the GIL for the
whole write (transformers says so beside its call) and writes through the page cache; this one writes through
``roll.direct_write.DirectFile``, whose copies and writes release the GIL, and hands tensors whose memory lies as
their bytes will in the file (modulo the device's block size) to the device uncopied. The format allows no gap
between tensors, so only the header can move them: it is padded with spaces (JSON whitespace, which the format's
readers skip; safetensors' own writer pads it so, to a multiple of 8) so that the most bytes land so. Weights
loaded from a safetensors file lie in one buffer in the file's order (transformers 5), so a model saved with the
names it was loaded with goes to the device whole.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter

import torch

from roll.direct_write import IN_PLACE_FROM, DirectFile

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""The format's dtype names."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ORDER = {name: rank for rank, name in enumerate(
    ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64"))}


def encode_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The file's bytes before the data (length and JSON header) and the names in the order their data follows.
    Every tensor must be a contiguous CPU tensor."""
    order = sorted(tensors, key=lambda name: (-_ORDER[_NAMES[tensors[name].dtype]], name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name in order:
        tensor = tensors[name]
        assert tensor.device.type == "cpu" and tensor.is_contiguous(), f"{name}: write a contiguous CPU tensor"
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [at, at + tensor.nbytes]}
        at += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, order


def write_direct(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                 metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``'s file, written past the page cache (the same
    signature, so it can stand in for it); its header may end in more spaces (``place``)."""
    header, order = encode_header(tensors, metadata)
    with DirectFile(path) as out:
        out.write(place(header, [tensors[name] for name in order], out.alignment))
        for name in order:
            tensor = tensors[name]
            if tensor.nbytes:
                out.write(tensor.reshape(-1).view(torch.uint8).numpy())


def place(header: bytes, tensors: list[torch.Tensor], block: int) -> bytes:
    """``header`` (``encode_header``'s, for ``tensors`` in file order) padded with spaces, a multiple of 8 of them,
    so that the most bytes of tensors of at least ``IN_PLACE_FROM`` lie at file offsets congruent to their addresses
    modulo ``block``; as it is when ``block`` is 0 (a buffered file) or no padding places more than none."""
    if not block:
        return header
    shifts: Counter[int] = Counter()
    at = len(header)
    for tensor in tensors:
        if tensor.nbytes >= IN_PLACE_FROM:
            shifts[(tensor.data_ptr() - at) % block] += tensor.nbytes
        at += tensor.nbytes
    best = max((shift for shift in shifts if shift % 8 == 0), key=lambda shift: (shifts[shift], -shift), default=0)
    if not best:
        return header
    return struct.pack("<Q", len(header) - 8 + best) + header[8:] + b" " * best
