"""Checkpoints written in the background (``save_async``): training goes on while the files are written.

One sequence on both backends, around ``roll.checkpoints``' crash-safe publish:

1. ``checkpoints.open_staging`` (collective): ``checkpoint-N.tmp`` exists, empty;
2. the main thread copies the state to host memory (``host_copy``; the mca backend: Megatron's
   asynchronous dist-checkpointing does it) and writes the small files itself;
3. a writer (a thread here; the mca backend: Megatron's forked writer) writes the copy into the staging
   directory and fsyncs every file, while training goes on;
4. after every optimizer step every rank asks whether all writers finished (``BackgroundSaves.poll``: one
   all-reduce of one number, only while a save is pending); once all did, ``checkpoints.complete``
   publishes ``checkpoint-N`` (barrier, rename, rotate, barrier). Until then the previous checkpoint is
   the latest.

**Memory bound:** one host copy at a time. A save first waits for the pending one (``wait``), and so do
the export of the final model and the end of training, so a run never holds two copies of its state.
**Crash safety:** a SIGKILL at any moment leaves at most ``checkpoint-N.tmp`` (removed at the next start),
never a ``checkpoint-N`` with missing files; ``resume_from_checkpoint: true`` / ``auto`` pick the last
complete one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from roll import checkpoints
from roll.logging import log_rank0, warn_once
from roll.reliability import any_rank

logger = logging.getLogger(__name__)

TEST_WRITE_DELAY_ENV = "ROLL_TEST_CHECKPOINT_WRITE_DELAY"
"""For tests only: seconds a background checkpoint writer sleeps before it writes its files, so a test's
SIGKILL lands inside an asynchronous save deterministically, and training has changed the weights in place by the
time the copy is written (a writer that read them instead of the copy would write later weights). Never
set in real runs (a warning says so when it is); it only delays, it changes nothing that is written."""


def delay_writes_for_tests() -> None:
    """Sleep ``ROLL_TEST_CHECKPOINT_WRITE_DELAY`` seconds when the variable is set (see its docstring)."""
    value = os.environ.get(TEST_WRITE_DELAY_ENV)
    if value:
        warn_once(logger, f"{TEST_WRITE_DELAY_ENV}={value}: every background checkpoint write is delayed "
                          "(a test hook)")
        time.sleep(float(value))


def host_copy(obj, keep: Callable[[torch.Tensor], bool] | None = None):
    """``obj`` (nested dicts / lists / tuples) with each tensor copied to host memory, into storage of its
    own: training changes the originals in place while the copy is written. Tensors that share storage
    (tied weights) share one copy. ``keep(t)`` true: ``t`` is kept as is (a frozen weight that cannot
    change). Other leaves are kept as they are (numbers, strings: immutable)."""
    copies: dict[tuple, torch.Tensor] = {}

    def copy(value):
        if isinstance(value, torch.Tensor):
            if keep is not None and keep(value):
                return value
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride(), value.device)
            if key not in copies:
                copies[key] = value.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(value, dict):
            return type(value)((k, copy(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(copy(v) for v in value)
        return value

    return copy(obj)


@dataclass
class _Pending:
    output_dir: str
    step: int
    is_writer: bool
    keep: int | None
    nested: bool
    started: float
    thread: threading.Thread | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class BackgroundSaves:
    """At most one checkpoint written by a thread at a time, published from the main thread (``poll``)."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self, output_dir: str, step: int, writes: list[Callable[[], None]], *, is_writer: bool,
              keep: int | None = None, nested: bool = False, started: float | None = None) -> None:
        """Run ``writes`` (each writes one file of ``checkpoint-<step>.tmp`` from a host copy) in a thread,
        then fsync the staging directory. ``open_staging`` ran before, and the save before this one
        finished (``wait``): that is the one-copy memory bound."""
        assert self._pending is None, "wait() for the pending save before starting another"
        pending = _Pending(output_dir, step, is_writer, keep, nested, started or time.perf_counter())
        staging = os.path.join(output_dir, f"{checkpoints.PREFIX}{step}.tmp")

        def run() -> None:
            try:
                delay_writes_for_tests()
                for write in writes:
                    write()
                checkpoints.fsync_tree(staging)
            except BaseException as exc:  # reported on the main thread by poll()
                pending.error = exc
            finally:
                pending.done.set()

        pending.thread = threading.Thread(target=run, name=f"roll-save-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    def poll(self, blocking: bool = False) -> str | None:
        """Collective (every rank, at the same step): publish the pending checkpoint once every rank's writer
        finished; its path, or None (nothing pending, or still writing). ``blocking``: wait for it."""
        pending = self._pending
        if pending is None:
            return None
        if blocking:
            pending.done.wait()
        if any_rank(not pending.done.is_set()):
            return None
        self._pending = None
        if any_rank(pending.error is not None):
            if pending.error is not None:
                raise pending.error
            raise RuntimeError(f"another rank failed to write checkpoint-{pending.step} (its log says why)")
        final = checkpoints.complete(pending.output_dir, pending.step, is_writer=pending.is_writer,
                                     keep=pending.keep, nested=pending.nested, flush=False)
        log_rank0(logger, "saved checkpoint %s in the background in %.1fs", final,
                  time.perf_counter() - pending.started)
        return final

    def wait(self) -> str | None:
        """Collective: finish and publish the pending save (before the next save, the export, the end)."""
        return self.poll(blocking=True)
