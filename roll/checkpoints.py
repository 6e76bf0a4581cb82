"""Where a run's checkpoints live and which one ``resume_from_checkpoint`` means: one rule for both backends.

Checkpoints are ``OUTPUT_DIR/checkpoint-N`` (N = optimizer steps done). A backend writes one under a
temporary name (``checkpoint-N.tmp``), flushes it to disk on every rank, and renames it into place when
complete (``publish``), so a directory with this exact name is a whole checkpoint and a save killed at any
moment leaves the previous one as the latest. Both backends save through ``publishing``, the one copy of
that sequence (a save in the background, ``save_async``, calls its two halves, ``open_staging`` and
``complete``, with the writing in between: ``roll.background_save``). Old checkpoints are renamed to
``*.old`` before they are deleted, so a half-deleted one is never picked either. ``clean_stale`` removes both
kinds of leftovers at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from roll.config.coerce import coerce, is_bool_word
from roll.errors import ConfigError
from roll.reliability import barrier

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_STALE = re.compile(r"^checkpoint-\d+\.(tmp|old)$")


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path) and not os.path.islink(path):  # a link is never followed
            found.append((int(match.group(1)), path))
    return sorted(found)


def last_checkpoint(output_dir: str) -> str | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1][1] if dirs else None


AUTO = "auto"
"""``resume_from_checkpoint: auto``: the latest complete checkpoint if there is one, else a fresh run."""


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def resolve_resume(value, output_dir: str) -> str | None:
    """``resume_from_checkpoint``: true -> the latest checkpoint in output_dir; a path -> that
    checkpoint; auto -> the latest checkpoint or None; false / none / empty -> None (a fresh run)."""
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "none") or (is_bool_word(text) and not coerce(text, bool)):
        return None
    if is_auto(text):
        return last_checkpoint(output_dir)
    if is_bool_word(text):  # the recipe's boolean words: true/yes/on/1
        last = last_checkpoint(output_dir)
        if last is None:
            raise ConfigError(f"resume_from_checkpoint=true but {output_dir!r} holds no checkpoint-N "
                              "directory; train with save_steps first, give the checkpoint path, or use "
                              "resume_from_checkpoint: auto (resume if there is a checkpoint, else start "
                              "fresh).")
        return last
    if not os.path.isdir(text):
        raise ConfigError(f"resume_from_checkpoint={text!r} is not a checkpoint directory; use true "
                          "(latest in output_dir), auto (latest if any, else start fresh) or a path such as "
                          "OUTPUT_DIR/checkpoint-3.")
    return text


def rotate(output_dir: str, keep: int | None) -> list[str]:
    """Delete the oldest checkpoints so at most ``keep`` remain (None or <= 0: keep all); returns them."""
    if not keep or keep <= 0:
        return []
    doomed = [path for _, path in checkpoint_dirs(output_dir)[:-keep]]
    for path in doomed:
        os.replace(path, path + ".old")  # no longer a checkpoint name before any file of it goes
        shutil.rmtree(path + ".old", ignore_errors=True)
    return doomed


def flush_to_disk() -> None:
    """Make this rank's writes durable before the checkpoint is published (every rank, before the barrier)."""
    if hasattr(os, "sync"):
        os.sync()


def publish(tmp: str, final: str) -> None:
    """Rename a complete ``checkpoint-N.tmp`` to ``checkpoint-N`` (rank 0, after every rank flushed)."""
    if os.path.isdir(final):  # an older checkpoint of the same step (a rerun): retire it first
        os.replace(final, final + ".old")
        shutil.rmtree(final + ".old", ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")


@contextmanager
def publishing(output_dir: str, step: int, *, is_writer: bool, keep: int | None = None,
               nested: bool = False) -> Iterator[str]:
    """Save ``OUTPUT_DIR/checkpoint-<step>`` crash-safely; every rank enters it (it is collective).

    Yields the staging directory ``checkpoint-<step>.tmp`` (``open_staging``). The body writes the checkpoint
    there (``nested``: into ``staging/checkpoint-<step>``, where HF's Trainer puts it itself); then
    ``complete`` flushes, publishes and rotates. A save in the background (``roll.background_save``) calls
    the two halves itself, with the writing in between done by a thread or process.

    If the body raises, nothing is published: the exception propagates, the previous checkpoint stays the
    latest, and the staging directory is left for ``clean_stale`` at the next start (removing it here
    could pull files from under a rank still writing)."""
    staging = open_staging(output_dir, step, is_writer=is_writer)
    yield staging
    complete(output_dir, step, is_writer=is_writer, keep=keep, nested=nested)


def open_staging(output_dir: str, step: int, *, is_writer: bool) -> str:
    """Collective: the writer creates ``checkpoint-<step>.tmp`` empty (a save that died earlier is removed
    first) and all meet, so no rank writes before it exists; returns its path. ``is_writer``: global rank 0
    (or each node's first rank when every node saves its own copy)."""
    staging = os.path.join(output_dir, f"{PREFIX}{step}.tmp")
    if is_writer:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging, exist_ok=True)  # empty: Megatron's dist_checkpointing refuses a non-empty one
    barrier()
    return staging


def complete(output_dir: str, step: int, *, is_writer: bool, keep: int | None = None, nested: bool = False,
             flush: bool = True) -> str:
    """Collective, after every rank wrote its part of ``checkpoint-<step>.tmp``: every rank flushes its
    writes to disk (``flush``: false when the writer already fsynced every file, as background saves do),
    all meet at a barrier, the writer renames the checkpoint into place (``publish``: rename, then fsync of
    output_dir) and deletes the oldest beyond ``keep`` (``rotate``), and all meet again, so no rank goes on
    before the checkpoint exists. Returns its path."""
    final = os.path.join(output_dir, f"{PREFIX}{step}")
    staging = final + ".tmp"
    if flush:
        flush_to_disk()
    barrier()  # every rank's files are on disk
    if is_writer:
        publish(os.path.join(staging, os.path.basename(final)) if nested else staging, final)
        if nested:
            os.rmdir(staging)
        for path in rotate(output_dir, keep):
            logger.info("deleted old checkpoint %s (save_total_limit %s)", path, keep)
    barrier()
    return final


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (this rank's share of making a checkpoint durable
    without ``os.sync``, which would wait for every write on the machine)."""
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:  # renamed by another rank's writer, which fsyncs it under its new name
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def clean_stale(output_dir: str) -> list[str]:
    """Delete what killed saves left (``checkpoint-N.tmp``, ``checkpoint-N.old``) in output_dir; log each."""
    if not os.path.isdir(output_dir):
        return []
    stale = sorted(os.path.join(output_dir, name) for name in os.listdir(output_dir) if _STALE.match(name))
    for path in stale:
        logger.warning("removing %s, left by a save that did not finish (the last complete checkpoint is %s)",
                       path, last_checkpoint(output_dir) or "none")
        shutil.rmtree(path, ignore_errors=True)
    return stale


BATCH_RECORD = "roll_batch.json"
"""In a standard-backend checkpoint: the batch sizes it was trained with. HF's trainer_state.json records only
the per-device batch, so a changed gradient_accumulation_steps would go unnoticed and the resumed run would
read other samples than the uninterrupted one."""


def write_batch_record(checkpoint_dir: str, *, per_device: int, grad_accum: int, world_size: int) -> None:
    record = {"global_batch_size": per_device * grad_accum * world_size,
              "per_device_train_batch_size": per_device, "gradient_accumulation_steps": grad_accum,
              "world_size": world_size}
    with open(os.path.join(checkpoint_dir, BATCH_RECORD), "w", encoding="utf-8") as fh:
        json.dump(record, fh)


def fsync_dir(path: str) -> None:
    """Make the renames and creations inside ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


# ---- no lost work -------------------------------------------------------------------------------

FINAL_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "adapter_config.json", "adapter_model.safetensors", "mca_config.json")
"""Files whose presence means output_dir holds a trained model. train_log.jsonl, loss.png and runs/ alone
(a run that stopped before saving anything) do not count: there is nothing to lose but a log."""


def wants_resume(value, output_dir: str | None = None) -> bool:
    """Whether ``resume_from_checkpoint`` asks to resume (true or a path, without checking the path; auto
    when ``output_dir`` holds a complete checkpoint)."""
    if is_auto(value):
        return output_dir is not None and last_checkpoint(output_dir) is not None
    text = "" if value is None else str(value).strip()
    return not (text.lower() in ("", "none") or (is_bool_word(text) and not coerce(text, bool)))


def trained_outputs(output_dir: str) -> list[str]:
    """Names of the final-model files and checkpoint-N directories in ``output_dir``."""
    if not os.path.isdir(output_dir):
        return []
    found = [name for name in FINAL_MODEL_FILES if os.path.isfile(os.path.join(output_dir, name))]
    return found + [os.path.basename(path) for _, path in checkpoint_dirs(output_dir)]


def check_output_dir(training) -> None:
    """Refuse a fresh run into an output_dir that holds a trained model or checkpoints (they would be
    overwritten), unless ``overwrite_output_dir`` or ``resume_from_checkpoint`` is set."""
    if training.overwrite_output_dir or wants_resume(training.resume_from_checkpoint, training.output_dir):
        return
    found = trained_outputs(training.output_dir)
    if found:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise ConfigError(f"output_dir {training.output_dir!r} already holds a trained model or checkpoints "
                          f"({shown}); a fresh run would overwrite them. Set resume_from_checkpoint: true to "
                          "continue from its latest checkpoint-N, overwrite_output_dir: true to replace "
                          "them, or choose another output_dir.")


def prepare_output_dir(training, *, is_rank0: bool) -> list[str]:
    """``check_output_dir``, then, for a fresh run with ``overwrite_output_dir``, rank 0 deletes the old
    checkpoint-N directories (else ``resume_from_checkpoint: true`` could later pick an old run's latest);
    returns the deleted paths. The old final-model files are replaced when this run saves its own."""
    check_output_dir(training)
    if not (training.overwrite_output_dir and is_rank0) or wants_resume(training.resume_from_checkpoint,
                                                                        training.output_dir):
        return []
    doomed = [path for _, path in checkpoint_dirs(training.output_dir)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
