"""``OUTPUT_DIR/train_log.jsonl``: every log record of a run, one JSON object per line, written by global
rank 0 the same way on both backends (the file's name is ``roll.logging.TRAIN_LOG_FILE``).

A record is ``{"step": N, **fields}``. A training record (one with ``loss``) carries every speed field of
``roll.perf.SPEED_KEYS``, ``null`` when it could not be computed; evaluation records carry ``eval_*``.
A fresh run starts the file empty; a resumed run appends to it.
"""

from __future__ import annotations

import json
import os

from roll.logging import TRAIN_LOG_FILE, is_rank0
from roll.perf import SPEED_KEYS


def train_log_path(output_dir: str) -> str:
    return os.path.join(output_dir, TRAIN_LOG_FILE)


def start_train_log(output_dir: str, *, fresh: bool) -> None:
    """Rank 0: create output_dir; a fresh run empties the log (a resumed run appends to it)."""
    if not is_rank0():
        return
    os.makedirs(output_dir, exist_ok=True)
    if fresh:
        open(train_log_path(output_dir), "w", encoding="utf-8").close()


def append_record(output_dir: str, step: int, fields: dict) -> dict:
    """Rank 0 appends ``{"step": step, **fields}`` (a training record completed with null speed fields);
    returns the record (every rank, so each can keep the history)."""
    record = {"step": step, **fields}
    if "loss" in fields:
        record.update({key: fields.get(key) for key in SPEED_KEYS})
    if is_rank0():
        os.makedirs(output_dir, exist_ok=True)
        with open(train_log_path(output_dir), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    return record
