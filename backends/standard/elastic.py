"""Resuming a DeepSpeed checkpoint at another data-parallel size (a requeued job on fewer or more nodes).

The sample order continues when the global batch (per_device_train_batch_size x gradient_accumulation_steps
x processes) is the checkpoint's (``roll.preflight`` checks it against ``roll_batch.json``). The optimizer
state is the other half: ZeRO-1/2/3 save each rank's slice of it (ZeRO-3: of the weights too) in
``global_stepN/*zero_pp_rank_R_*_optim_states.pt``, and DeepSpeed's own load refuses another number of
slices. ``prepare_resume`` converts such a checkpoint once to DeepSpeed's universal checkpoint
(``deepspeed.checkpoint.ds_to_universal``: one file per parameter and state, whole) next to it, in
``checkpoint-N/global_stepN_universal`` with a ``latest_universal`` tag, and turns on the engine's
``checkpoint.load_universal`` for this run, which slices it for the new size. At the size it was saved at
nothing is converted and the checkpoint loads as always; a later resume at another size reuses the
conversion.

What cannot load is refused before any model loads, naming what would work: a DeepSpeed checkpoint resumed
without DeepSpeed (or the reverse), another ZeRO stage family (0, 1-2, 3), and an optimizer offloaded to
NVMe at another size (its swap files are per rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import shutil
import time
from argparse import Namespace

from backends.standard.ds_config import DeepSpeedSettings
from roll import checkpoints
from roll.errors import ConfigError
from roll.logging import log_rank0
from roll.reliability import barrier

logger = logging.getLogger(__name__)

UNIVERSAL_TAG_FILE = "latest_universal"
"""DeepSpeed's file naming the universal checkpoint's folder (its ``latest`` names the native one)."""

_OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_ZERO3_MODEL_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """What a standard-backend checkpoint's DeepSpeed files say about the run that wrote them."""

    tag: str
    """The folder of DeepSpeed's files (``global_stepN``, from the checkpoint's ``latest``)."""
    zero_family: str
    """``"0"`` (no ZeRO), ``"1-2"`` or ``"3"``: stages within one family load each other's files."""
    dp_size: int
    """The number of ZeRO partitions (data-parallel ranks) the optimizer state is in (1 without ZeRO)."""


def zero_family(stage: int) -> str:
    return {0: "0", 1: "1-2", 2: "1-2", 3: "3"}[stage]


def saved_layout(ckpt: str) -> SavedLayout | None:
    """The DeepSpeed layout of ``ckpt``; None when it holds no DeepSpeed files (a run without DeepSpeed)."""
    latest = os.path.join(ckpt, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as fh:
        tag = fh.read().strip()
    folder = os.path.join(ckpt, tag)
    if not tag or os.path.basename(tag) != tag or not os.path.isdir(folder):
        raise ConfigError(f"resume_from_checkpoint={ckpt!r}: its DeepSpeed 'latest' file names {tag!r}, "
                          "which is not a folder of the checkpoint; resume from a complete checkpoint-N.")
    names = os.listdir(folder)
    ranks = {int(match.group(1)) for match in map(_OPTIM_STATES.match, names) if match}
    if any(_ZERO3_MODEL_STATES.match(name) for name in names):
        family = "3"
    else:
        family = "1-2" if ranks else "0"
    return SavedLayout(tag=tag, zero_family=family, dp_size=len(ranks) or 1)


def prepare_resume(ds: DeepSpeedSettings | None, ckpt: str | None, *, world_size: int,
                   is_writer: bool) -> DeepSpeedSettings | None:
    """The DeepSpeed settings that load ``ckpt`` at ``world_size`` data-parallel ranks (``ds`` itself, or
    ``ds`` with ``checkpoint.load_universal`` after converting ``ckpt``); ConfigError for a layout that cannot
    load. Collective when it converts: ``is_writer`` ranks convert (global rank 0; each node's first with
    save_on_each_node), all meet after."""
    if ckpt is None:
        return ds
    saved = saved_layout(ckpt)
    _check_loadable(ds, ckpt, saved, world_size)
    if ds is None or saved is None or saved.zero_family == "0" or saved.dp_size == world_size:
        return ds  # DeepSpeed's own load: the same partitions, or none
    if is_writer:
        convert_to_universal(ckpt, saved)
    barrier()
    config = dict(ds.config)
    config["checkpoint"] = {**(config.get("checkpoint") or {}), "load_universal": True}
    log_rank0(logger, "resuming %s (ZeRO state saved by %d ranks) on %d ranks: loading DeepSpeed's universal "
              "checkpoint %s", ckpt, saved.dp_size, world_size, os.path.join(ckpt, universal_folder(saved)))
    return dataclasses.replace(ds, config=config)


def _check_loadable(ds: DeepSpeedSettings | None, ckpt: str, saved: SavedLayout | None,
                    world_size: int) -> None:
    where = f"resume_from_checkpoint={ckpt!r}"
    if ds is None and saved is not None:
        raise ConfigError(f"{where} was written under DeepSpeed (ZeRO stage {saved.zero_family}, its "
                          f"optimizer state in {saved.tag}/) but this run has no deepspeed config: its "
                          "optimizer state would not load. Resume with a deepspeed config of that ZeRO stage "
                          f"(e.g. recipes/deepspeed/{_example_file(saved.zero_family)}), or start a fresh "
                          "run.")
    if ds is not None and saved is None:
        raise ConfigError(f"{where} was written without DeepSpeed (optimizer.pt) but this run has "
                          f"deepspeed={ds.source}: DeepSpeed loads only its own global_stepN/ files. Resume "
                          "without the deepspeed key, or start a fresh run.")
    if ds is None or saved is None:
        return
    if zero_family(ds.zero_stage) != saved.zero_family:
        raise ConfigError(f"{where} was written under ZeRO stage {saved.zero_family}, this run's deepspeed "
                          f"config {ds.source} has stage {ds.zero_stage}: the optimizer state is laid out "
                          "differently. Resume with a deepspeed config of the stage it was written with "
                          f"(e.g. recipes/deepspeed/{_example_file(saved.zero_family)}), or start a fresh "
                          "run.")
    nvme = (ds.config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    swapped = os.path.isdir(os.path.join(ckpt, saved.tag, "offloaded_tensors"))  # saved under NVMe offload
    resized = saved.dp_size != world_size and saved.zero_family != "0"
    if resized and (nvme.get("device") == "nvme" or swapped):
        raise ConfigError(f"{where} holds ZeRO state of {saved.dp_size} ranks, this run has {world_size}: "
                          "with offload_optimizer on NVMe the optimizer state lives in per-rank swap files "
                          f"that DeepSpeed cannot re-slice. Resume on {saved.dp_size} processes (nnodes x "
                          "nproc_per_node), or offload the optimizer to the CPU (device: cpu) in the run "
                          "that writes the checkpoint.")
    converted = _read(os.path.join(ckpt, UNIVERSAL_TAG_FILE)) == universal_folder(saved)
    if resized and not converted and not _writable(ckpt):
        raise ConfigError(f"{where} holds ZeRO state of {saved.dp_size} ranks, this run has {world_size}: "
                          "it is converted once to DeepSpeed's universal checkpoint, written into the "
                          "checkpoint folder, which this run cannot write. Copy the checkpoint into "
                          f"output_dir and resume from the copy, or resume on {saved.dp_size} processes.")


def _example_file(family: str) -> str:
    return {"0": "ds_z0.json", "1-2": "ds_z2.json", "3": "ds_z3.json"}[family]


def universal_folder(saved: SavedLayout) -> str:
    return f"{saved.tag}_universal"


def convert_to_universal(ckpt: str, saved: SavedLayout) -> str:
    """``ckpt/<tag>_universal`` from ``ckpt/<tag>`` (once: a complete earlier conversion is reused). Written
    under a temporary name and renamed into place, then ``latest_universal`` is replaced: a conversion killed
    at any moment leaves either nothing or a ``.tmp`` the next conversion removes; the checkpoint's own files
    are only read."""
    from backends.standard import _compat

    name = universal_folder(saved)
    final, tag_file = os.path.join(ckpt, name), os.path.join(ckpt, UNIVERSAL_TAG_FILE)
    if os.path.isdir(final) and _read(tag_file) == name:
        logger.info("reusing the universal checkpoint %s", final)
        return final
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    started = time.perf_counter()
    logger.info("converting %s (ZeRO state of %d ranks) to DeepSpeed's universal checkpoint %s",
                os.path.join(ckpt, saved.tag), saved.dp_size, final)
    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(input_folder=os.path.join(ckpt, saved.tag), output_folder=staging, num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    printed = io.StringIO()
    # It prints its progress (and tqdm's bars): kept out of the run's output, logged at debug level.
    with _compat.restricted_torch_loads(), contextlib.redirect_stdout(printed), \
            contextlib.redirect_stderr(printed):
        ds_to_universal.main(args)
    logger.debug("ds_to_universal: %s", printed.getvalue())
    checkpoints.fsync_tree(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    # ds_to_universal wrote latest_universal naming the staging folder: name the published one.
    with open(tag_file + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(name)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tag_file + ".tmp", tag_file)
    checkpoints.fsync_dir(ckpt)  # both renames are durable
    logger.info("converted in %.1fs (a later resume at another size reuses it)",
                time.perf_counter() - started)
    return final


def _writable(folder: str) -> bool:
    return os.access(folder, os.W_OK)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return None
