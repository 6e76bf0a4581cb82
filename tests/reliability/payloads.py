"""Planting pickles that would run code: each one, when unpickled, only creates a marker file."""

from __future__ import annotations

import os
import pickle
import shutil

import torch


class Payload:
    """Unpickling calls ``open(marker, "a")``: the marker file then exists. Nothing else happens."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "a")


def plant_torch(path: str, marker: str) -> None:
    """Replace a ``torch.save`` file by one holding the payload."""
    torch.save({"state": Payload(marker)}, path)


def plant_pickle(path: str, marker: str) -> None:
    """Replace a plain pickle (distributed-checkpoint ``.metadata``) by the payload."""
    with open(path, "wb") as fh:
        pickle.dump(Payload(marker), fh)


def plant_distcp_bytes(ckpt_dir: str, marker: str) -> str:
    """Point one bytes entry (``_extra_state``) of a distributed checkpoint at a payload appended to its
    ``.distcp`` file; ``.metadata`` stays clean (only allowed classes), so only the bytes can run code.
    Returns the entry's name."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_path = os.path.join(ckpt_dir, ".metadata")
    with open(meta_path, "rb") as fh:
        metadata = pickle.load(fh)  # our own, untampered file
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    path = os.path.join(ckpt_dir, info.relative_path)
    info.offset, info.length = os.path.getsize(path), len(blob.getvalue())
    with open(path, "ab") as fh:
        fh.write(blob.getvalue())
    with open(meta_path, "wb") as fh:
        pickle.dump(metadata, fh)
    return key


def copy_tree(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst
