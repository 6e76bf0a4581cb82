"""Reading pickle-based files (``torch.save`` files, PyTorch distributed-checkpoint metadata) without
running code from them.

A pickle names Python callables that unpickling calls, so loading one made by someone else can run
anything (``os.system`` included). roll reads checkpoints and Megatron-format model folders through
the functions here, which allow only tensors, plain containers and the few classes roll's, PyTorch's,
Megatron's and DeepSpeed's own states hold (:func:`allowed_globals`); a file that names anything else is
refused with an :class:`UntrustedPickle` (exit 2) naming the file and the opt-in key. With
``trust_checkpoint_pickles: true`` (:func:`set_trusted`) files load as the libraries would load them.
The threat model: docs/reliability.md, "What roll trusts".
"""

from __future__ import annotations

import functools
import glob
import os
import pickle
import re
import sys
import zipfile
from typing import IO, Any

from roll.errors import ModelError

TRUST_KEY = "trust_checkpoint_pickles"

_trusted = False


class UntrustedPickle(ModelError):
    """A pickle-based file names a callable outside :func:`allowed_globals`, or cannot be read at all."""

    def __init__(self, message: str, path: str = "", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.path, self.cause = path, cause

    def within(self, folder: str) -> UntrustedPickle:
        """The same refusal, ``path`` taken relative to ``folder`` (PyTorch's reader names files so)."""
        if os.path.isabs(self.path) or self.cause is None:
            return self
        return refusal(os.path.join(folder, self.path), self.cause)


def set_trusted(value: bool) -> None:
    """Whether files may be unpickled without the allow-list (``trust_checkpoint_pickles``); process-wide,
    because the loads it governs happen deep inside DeepSpeed and PyTorch (see the compat modules)."""
    global _trusted
    _trusted = bool(value)


def allowed_globals(deepspeed: bool = True) -> list:
    """What files may name besides tensors and plain containers (torch's ``weights_only`` defaults).

    numpy's RNG state (HF's ``rng_state*.pth``, as ``transformers.trainer_pt_utils.safe_globals``); PyTorch
    distributed-checkpoint metadata (``.metadata`` of Megatron checkpoints); DeepSpeed's optimizer states
    (unless ``deepspeed`` is False: naming them imports DeepSpeed, 3 s).
    """
    import numpy as np
    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    np_core = np._core if hasattr(np, "_core") else np.core
    allowed = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
               metadata.Metadata, metadata.MetadataIndex, metadata.ChunkStorageMetadata,
               metadata.TensorProperties, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size,
               torch.memory_format, torch.layout]
    if not deepspeed:
        return allowed
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # no DeepSpeed: its states cannot be there to load
        return allowed
    return allowed + [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def torch_load(source: str | IO[bytes], path: str | None = None, *, loader=None, **kwargs) -> Any:
    """``torch.load`` of a file or buffer under the allow-list; ``path``: the file, for messages. ``loader``:
    the ``torch.load`` to call (a compat patch that stands in for ``torch.load`` passes the original)."""
    import torch

    load = loader or torch.load
    path = path or str(source)
    if _trusted:
        return load(source, weights_only=False, **kwargs)
    # DeepSpeed's classes join the allow-list only for a file that names them (or once DeepSpeed is
    # imported anyway): importing it to read a Megatron checkpoint's common.pt cost 3 s per load.
    with_deepspeed = "deepspeed" in sys.modules
    start = source.tell() if hasattr(source, "tell") else None
    try:
        with torch.serialization.safe_globals(allowed_globals(deepspeed=with_deepspeed)):
            return load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        if with_deepspeed or "deepspeed." not in str(exc):
            raise refusal(path, exc) from None
    if start is not None:
        source.seek(start)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise refusal(path, exc) from None


def load_pickle(fh: IO[bytes], path: str) -> Any:
    """``pickle.load`` of ``fh`` (read from ``path``) resolving only allow-listed names: for plain pickles
    such as PyTorch distributed-checkpoint ``.metadata`` (protocol 4+, which torch's weights_only reader
    does not parse)."""
    if _trusted:
        return pickle.load(fh)
    try:
        return _RestrictedUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise refusal(path, exc) from None


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's documented way of restricting globals: ``find_class`` is the only way a pickle reaches a
    callable (REDUCE, NEWOBJ and BUILD act on what it returned; persistent ids are refused by default)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_by_name(module.startswith("deepspeed.")).get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


@functools.lru_cache(maxsize=2)
def _allowed_by_name(deepspeed: bool) -> dict[str, Any]:
    """``module.name`` -> object, for :class:`_RestrictedUnpickler`: the allow-list (DeepSpeed's classes
    only for a name in DeepSpeed's modules), the classes of PyTorch DCP's save plans (Megatron keeps them in
    ``.metadata``), torch dtypes and paths."""
    import collections
    import pathlib

    import torch
    from torch.distributed.checkpoint import planner

    objects = allowed_globals(deepspeed) + [planner.SavePlan, planner.WriteItem, planner.TensorWriteData,
                                   planner.WriteItemType, torch.serialization._get_layout,
                                   collections.OrderedDict, pathlib.PurePosixPath, pathlib.PosixPath]
    names = {f"{obj.__module__}.{obj.__qualname__}": obj for obj in objects}
    names.update({str(dtype): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)})
    return names


def refusal(path: str, exc: BaseException) -> UntrustedPickle:
    """The one-paragraph message for a file the allow-list refused (or that is not a readable pickle)."""
    text = str(exc).split("WeightsUnpickler error:")[-1].strip()  # torch's weights_only wraps the reason
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found is None and not re.search(r"allowed|allowlisted|unrecognized function", text):
        reason = text.splitlines()[0] if text else type(exc).__name__
        return UntrustedPickle(f"cannot read {path}: {reason}. The file is damaged or not what its name "
                               "says: copy it again.", path, exc)
    what = f"names {found.group(1)}, which" if found else "holds an object that"
    return UntrustedPickle(
        f"refusing to load {path}: it is a pickle that {what} is not among the tensors and plain data "
        "roll loads from checkpoints and model folders, and unpickling it could run code. If you made this "
        f"file or trust where it came from, set {TRUST_KEY}: true (recipe key or --{TRUST_KEY} true; "
        f"roll-convert: --{TRUST_KEY.replace('_', '-')}).", path, exc)


# ---- checking a folder before anything loads ---------------------------------------------------

_SKIPPED = ("training_args.bin",)
"""Pickles roll never reads (HF's saved TrainingArguments: roll writes training_args.json instead)."""


def pickle_files(folder: str) -> list[str]:
    """The pickle-based files of a checkpoint or model folder that roll or its libraries read: ``*.pt``,
    ``*.pth``, ``*.bin`` and distributed-checkpoint ``.metadata``, in subfolders too (DeepSpeed's
    ``global_stepN/``, mca's ``rng/``). ``.distcp`` bytes are checked when read (the mca compat patch)."""
    found = []
    for pattern in ("*.pt", "*.pth", "*.bin", "*.metadata", ".metadata"):
        found += glob.glob(os.path.join(folder, "**", pattern), recursive=True)
    return sorted({path for path in found if os.path.basename(path) not in _SKIPPED and os.path.isfile(path)})


def check_folder(folder: str) -> None:
    """Every pickle in ``folder`` loads under the allow-list (nothing in it is executed), else an
    :class:`UntrustedPickle` naming the first that does not. Tensors are memory-mapped, not read: cheap for
    large files."""
    if _trusted or not os.path.isdir(folder):
        return
    for path in pickle_files(folder):
        if path.endswith(".metadata"):
            with open(path, "rb") as fh:
                load_pickle(fh, path)
        else:
            try:
                torch_load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))
            except UntrustedPickle:
                raise
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to replace
                raise refusal(path, exc) from None
