"""The ``.safetensors`` format's header, and a writer of whole files past the page cache.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces to a
multiple of 8, then the data, offsets relative to its start. ``encode_header`` lays the tensors out as
``safetensors.torch.save_file`` does (by dtype, the largest first in the Rust crate's ``Dtype`` order, then by
name), so a file written from it has that function's bytes.

``write_direct`` is for background checkpoint writers: safetensors' own ``save_file`` holds the GIL for the
whole write (transformers says so beside its call) and writes through the page cache; this one writes through
``roll.direct_write.DirectFile``, whose copies and writes release the GIL.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from roll.direct_write import DirectFile

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
    signature, so it can stand in for it)."""
    header, order = encode_header(tensors, metadata)
    with DirectFile(path) as out:
        out.write(header)
        for name in order:
            tensor = tensors[name]
            if tensor.nbytes:
                out.write(tensor.reshape(-1).view(torch.uint8).numpy())
