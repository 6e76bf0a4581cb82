"""Logging set-up and rank-aware helpers. Library code logs through these; it never prints."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[%(asctime)s] [%(levelname)s] [rank%(rank)s] %(name)s: %(message)s"
_warned: set[str] = set()

TRAIN_LOG_FILE = "train_log.jsonl"
"""Every log line of a run (loss, lr, grad_norm, tokens/s, ...), one JSON object per line, in output_dir;
the same file name and keys on both backends."""


class _CurrentStderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is written, not when roll was set up: a
    notebook, a test or an in-process caller that swaps sys.stderr (and closes the old one) still sees
    roll's lines."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property always reads sys.stderr
        pass


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def setup_logging(level: str | int = "INFO") -> None:
    """Configure the ``roll`` and ``backends`` loggers once: stderr, timestamps and rank."""
    for name in ("roll", "backends"):
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def get_rank() -> int:
    """Global rank from the launcher's environment (0 outside a launcher)."""
    return int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    return get_rank() == 0


def log_rank0(logger: logging.Logger, msg: str, *args, level: int = logging.INFO) -> None:
    """Log on global rank 0 only, so N ranks do not print the same line N times."""
    if is_rank0():
        logger.log(level, msg, *args)


def warn_once(logger: logging.Logger, msg: str, level: int = logging.WARNING) -> None:
    """Warn once per process and message (e.g. for a recipe value the active backend ignores); ``level``
    INFO for a line that reports rather than warns."""
    if msg not in _warned:
        _warned.add(msg)
        log_rank0(logger, msg, level=level)


def byte_progress(total: int, desc: str, rank0_only: bool = True):
    """A tqdm bar on stderr counting bytes with their rate (e.g. ``1.2GB/s``), for long I/O such as a
    checkpoint conversion; disabled off rank 0 (``rank0_only``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr,
                mininterval=0.5, dynamic_ncols=True, disable=rank0_only and not is_rank0())
