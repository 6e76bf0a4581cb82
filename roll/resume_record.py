"""What a checkpoint records about the run's position, and the check that a resumed run continues it.

Both backends write ``roll_resume.json`` into every ``checkpoint-N``: the steps done, the samples they
consumed, the skipped-step count, and the training set (the recipe's ``dataset``, its row count and a
content fingerprint, ``roll.data.fingerprint``). On resume, ``check_same_data`` refuses a training set that
changed since (exit 2): the sample order the checkpoint stopped in would not continue, and the resumed run
would silently train other samples than the uninterrupted one. ``skipped_steps`` lets the resumed run's
log continue the count. A streamed training set (``streaming: true``) is marked ``streamed``: its length is
``max_steps`` global batches, so a resumed run may change it; its fingerprint is the stream's.
"""

from __future__ import annotations

import json
import logging
import math
import os

from roll.config.training import read_json_object
from roll.errors import ConfigError
from roll.logging import warn_once

logger = logging.getLogger(__name__)

RECORD = "roll_resume.json"


def consumed_samples(steps: int, global_batch_size: int, num_samples: int) -> int:
    """Samples that ``steps`` optimizer steps read: full epochs, then whole global batches (each epoch's last
    step takes what is left, ``roll.reliability.global_batch_samples``)."""
    per_epoch = max(1, math.ceil(num_samples / global_batch_size))
    epochs, rest = divmod(steps, per_epoch)
    return epochs * num_samples + min(rest * global_batch_size, num_samples)


def write(checkpoint_dir: str, dataset, *, dataset_spec: str | None, global_step: int, global_batch_size: int,
          skipped_steps: int, consumed: int | None = None) -> None:
    """``checkpoint_dir/roll_resume.json`` (rank 0, inside the not yet published checkpoint). ``consumed``:
    the loop's own count of samples read (default: what ``global_step`` steps read)."""
    from roll.data.fingerprint import dataset_fingerprint

    if consumed is None:
        consumed = consumed_samples(global_step, global_batch_size, len(dataset))
    record = {"global_step": global_step, "global_batch_size": global_batch_size, "consumed_samples": consumed,
              "skipped_steps": skipped_steps, "dataset": dataset_spec, "num_samples": len(dataset),
              "dataset_fingerprint": dataset_fingerprint(dataset)}
    if _streamed(dataset):
        record["streamed"] = True
    with open(os.path.join(checkpoint_dir, RECORD), "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2)


def _streamed(dataset) -> bool:
    return bool(getattr(dataset, "streamed", False))


def read(checkpoint_dir: str) -> dict | None:
    """The checkpoint's record; None for a checkpoint written before roll recorded one."""
    path = os.path.join(checkpoint_dir, RECORD)
    if not os.path.isfile(path):
        return None
    return read_json_object(path, path, ConfigError)


def check_same_data(checkpoint_dir: str, dataset, *, dataset_spec: str | None, global_batch_size: int) -> None:
    """ConfigError when this run's training set is not the one ``checkpoint_dir`` was trained on."""
    from roll.data.fingerprint import dataset_fingerprint

    record = read(checkpoint_dir)
    if record is None:
        warn_once(logger, f"{checkpoint_dir} has no {RECORD} (written before roll recorded the training "
                          "set): resuming without checking that the dataset is the same.")
        return
    changes = []
    if record.get("dataset") != dataset_spec:
        changes.append(f"dataset was {record.get('dataset')!r}, now {dataset_spec!r}")
    # A stream's length is max_steps global batches: a resumed run may extend max_steps.
    if record.get("num_samples") != len(dataset) and not (record.get("streamed") and _streamed(dataset)):
        changes.append(f"{record.get('num_samples')} training samples then, {len(dataset)} now")
    elif record.get("dataset_fingerprint") != dataset_fingerprint(dataset):
        changes.append(f"the same number of samples ({len(dataset)}) with other contents or order "
                       f"(fingerprint {record.get('dataset_fingerprint')} then, {dataset_fingerprint(dataset)} now)")
    steps = record.get("global_step", 0)
    now = consumed_samples(steps, global_batch_size, len(dataset))
    if not changes and record.get("consumed_samples") != now:
        changes.append(f"its {steps} steps consumed {record.get('consumed_samples')} samples, on this training "
                       f"set they consume {now}")
    if changes:
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint_dir!r} was trained on another training set than this run's "
            f"(dataset={dataset_spec!r}): {'; '.join(changes)}. Resuming would not continue its sample order. "
            "Resume with the data and the data keys it was trained with (dataset, max_samples, val_size, "
            "cutoff_len, template, packing, packing_algorithm, shuffle, seed), or start a fresh run on the new data: "
            "overwrite_output_dir: true (deletes the old checkpoints) or another output_dir.")
