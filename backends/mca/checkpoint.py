"""Model checkpoints in Megatron's distributed format (``torch_dist``), loadable at any layout.

Every rank writes only its shards, tagged with their place in the global tensors, so a checkpoint
saved at TP1 loads at TP2 or PP2 (and back) without a conversion step. The files go straight into
``ckpt_dir`` (``metadata.json``, ``common.pt``, ``__*.distcp``); callers may keep their own small
files there (e.g. ``mca_config.json``).

Only model weights live here; optimizer/scheduler/RNG state belongs to the trainer.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from typing import Sequence

import torch.distributed as dist
from torch import nn

from backends.mca.models.unwrap import unwrap_model
from roll.errors import ModelError, RollError
from roll.unpickle import UntrustedPickle
from roll.logging import byte_progress, log_rank0

logger = logging.getLogger(__name__)


def is_dist_checkpoint(ckpt_dir: str) -> bool:
    """True if ``ckpt_dir`` holds a Megatron distributed checkpoint (has its ``metadata.json``)."""
    from megatron.core import dist_checkpointing

    return os.path.isdir(ckpt_dir) and dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir)


def sharded_model_state_dict(model_chunks: Sequence[nn.Module]) -> dict:
    """The chunks' sharded state dicts under ``model`` (one chunk) or ``model0..N`` (virtual pipeline).

    The nesting key is only a container: tensors are matched by their global sharded keys (global
    layer numbers), so a VPP checkpoint loads without VPP and the other way round. Wrapped chunks
    (DDP, Float16Module, PEFT) are read through the bare model, so wrapping never changes a key.
    """
    bare = [unwrap_model(chunk) for chunk in model_chunks]  # DDP/Float16Module/PEFT would prefix every key
    if len(bare) == 1:
        return {"model": bare[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(bare)}


def save_checkpoint(model_chunks: Sequence[nn.Module], ckpt_dir: str, sync_files: bool = True,
                    direct: bool = False) -> None:
    """Write the model chunks' weights to ``ckpt_dir``; a collective call on every rank.

    Written in this process by ``in_process_save_strategy`` (I/O threads, no helper processes), in the
    same ``torch_dist`` format Megatron's default writer produces, so any layout loads it. ``sync_files``
    False leaves flushing the files to the OS (as ``save_pretrained`` does): a conversion can be rerun.
    ``direct``: the ``.distcp`` files are written past the page cache (``roll.direct_write``; the same bytes).
    """
    from megatron.core import dist_checkpointing

    from backends.mca.checkpoint_io import in_process_save_strategy

    _require_model_chunks(model_chunks)
    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    start = time.perf_counter()
    with byte_progress(0, "write Megatron weights") as bar:
        dist_checkpointing.save(sharded_model_state_dict(model_chunks), ckpt_dir,
                                sharded_strategy=in_process_save_strategy(sync_files=sync_files, progress=bar,
                                                                          direct=direct))
    elapsed = time.perf_counter() - start
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(ckpt_dir, "*.distcp")))  # every rank's files
    log_rank0(logger, "saved model checkpoint (torch_dist, %.2f GB) to %s in %.1fs (%.2f GB/s%s)", size / 1e9,
              ckpt_dir, elapsed, size / 1e9 / elapsed, "" if sync_files else ", not fsync'ed")


def load_checkpoint(model_chunks: Sequence[nn.Module], ckpt_dir: str, map_files: bool = False) -> None:
    """Load weights saved by ``save_checkpoint`` (at any TP/PP/VPP/EP layout) into ``model_chunks``. ``map_files``:
    the parameters stored whole become views of private maps of the checkpoint's files, and (in a process of its own)
    the fused gate/up weights unread memory whose halves their archives back (``checkpoint_map``), for a model that
    is only written out again (``roll-convert mca2hf``).

    Raises ``ModelError`` when ``ckpt_dir`` is not a distributed checkpoint or lacks tensors the
    model needs (another architecture, or a model built with different options).
    """
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from backends.mca.checkpoint_map import MappedParams

    _require_model_chunks(model_chunks)
    if not is_dist_checkpoint(ckpt_dir):
        raise ModelError(f"{ckpt_dir} is not a Megatron distributed checkpoint (no metadata.json from "
                         "dist_checkpointing); point to the directory save_checkpoint wrote.")
    start = time.perf_counter()
    sharded = sharded_model_state_dict(model_chunks)
    mapped = MappedParams(model_chunks) if map_files else None
    (state, _, not_in_checkpoint), nbytes = load_sharded(sharded, ckpt_dir, "Megatron weights", mapped=mapped,
                                                         strict=StrictHandling.RETURN_ALL)
    if not_in_checkpoint:
        raise ModelError(f"checkpoint {ckpt_dir} lacks {len(not_in_checkpoint)} tensor(s) this model needs, e.g. "
                         f"{sorted(not_in_checkpoint)[:5]}. Was it saved from another architecture or config?")
    for name, chunk in zip(sharded, model_chunks):
        result = unwrap_model(chunk).load_state_dict(state[name], strict=False)
        # `_extra_state` entries (FP8 metadata; None for local modules) are not always checkpointed.
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ModelError(f"checkpoint {ckpt_dir} does not fit model chunk {name}: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}.")
    if mapped is not None:  # after load_state_dict, which would copy the taken parameters' unread memory
        mapped.apply()
    elapsed = time.perf_counter() - start
    log_rank0(logger, "loaded model checkpoint %s (%.2f GB on this rank%s) in %.1fs (%.2f GB/s)", ckpt_dir, nbytes / 1e9,
              "" if mapped is None else f", {mapped.nbytes / 1e9:.2f} GB of it mapped, not copied", elapsed,
              nbytes / 1e9 / max(elapsed, 1e-9))


def load_sharded(sharded: dict, ckpt_dir: str, what: str, mapped=None, **kwargs) -> tuple[object, int]:
    """``dist_checkpointing.load(sharded, ckpt_dir, **kwargs)`` through roll's reader, and the bytes this rank
    read. Every stored tensor (at another layout, the part of it this rank needs) is read with positioned reads
    straight into its destination (``checkpoint_io.direct_load_strategy``; anything else through PyTorch's reader), the
    halves of a fused gate/up tensor merge into that tensor itself (``checkpoint_io.merge_in_place``), a byte
    bar ``read <what>`` counts it, and a refusal of roll's inside PyTorch's reader comes out alone
    (``user_errors_of``). Model weights (``load_checkpoint``), a run's resume (weights or LoRA adapters, and
    the optimizer state: ``trainer.checkpointing.load``) and adapter checkpoints all load through here. ``mapped``:
    a ``checkpoint_map.MappedParams`` (``load_checkpoint(map_files=True)``)."""
    from megatron.core import dist_checkpointing

    from backends.mca.checkpoint_io import direct_load_strategy, merge_in_place

    merge_in_place(sharded)
    with user_errors_of(ckpt_dir), byte_progress(0, f"read {what}") as bar:
        strategy = direct_load_strategy(bar, mapped)
        loaded = dist_checkpointing.load(sharded, ckpt_dir, sharded_strategy=strategy, **kwargs)
    return loaded, strategy.bytes_read


@contextlib.contextmanager
def user_errors_of(ckpt_dir: str):
    """Around ``dist_checkpointing.load``: PyTorch's checkpoint reader wraps every rank's exception in a
    ``CheckpointException`` (a BaseException listing each rank's traceback); a refusal of roll's inside it
    (``roll.unpickle``: a file that would run code) is the user's to fix, so it is raised alone, with the
    checkpoint directory added to file names the reader gives relative to it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for error, _ in exc.failures.values():
            if isinstance(error, UntrustedPickle):
                raise error.within(ckpt_dir) from None
            if isinstance(error, RollError):
                raise error from None
        raise


def _require_model_chunks(model_chunks: Sequence[nn.Module]) -> None:
    if isinstance(model_chunks, nn.Module) or not model_chunks:
        raise TypeError("pass the list of model chunks (one per virtual pipeline stage), not a single module")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call initialize_megatron first")
