"""Checkpoints written in the background (``save_async``): training goes on while the files are written.

One sequence on both backends, around ``roll.checkpoints``' crash-safe publish:

1. ``checkpoints.open_staging`` (collective): ``checkpoint-N.tmp`` exists, empty;
2. the main thread writes the small files itself and prepares the writes: tensors on an accelerator are
   copied to host memory (``host_copy``); tensors already in host memory (a CPU run) are not copied: the
   writer reads training's own tensors, and the next in-place update of them waits until it has
   (``BackgroundSaves.fence``, called before every optimizer step: CheckFreq's snapshot pipelined with the
   next step's forward and backward, Mohan et al., FAST '21);
3. a writer thread writes them into the staging directory and fsyncs every file, while training goes on;
4. after every optimizer step every rank asks whether all writers finished (``BackgroundSaves.poll``: one
   all-reduce of one number, only while a save is pending); once all did, the caller's ``finalize`` runs
   (the mca backend: Megatron's metadata) and ``checkpoints.complete`` publishes ``checkpoint-N`` (barrier,
   rename, rotate, barrier). Until then the previous checkpoint is the latest.

**Memory bound:** at most one host copy, and on a CPU run none. A save first waits for the pending one
(``wait``), and so do the export of the final model and the end of training.
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
"""For tests only: seconds a background checkpoint writer sleeps after it wrote its files (and released the
``fence``: training goes on meanwhile), before it fsyncs them and reports done, so a test's SIGKILL lands
inside an asynchronous save deterministically."""
TEST_READ_DELAY_ENV = "ROLL_TEST_CHECKPOINT_READ_DELAY"
"""For tests only: seconds a background checkpoint writer sleeps before it writes its files. A save that reads
training's own tensors holds the ``fence`` meanwhile, so the next optimizer step waits; one that failed to would
write weights of a later step, which a run resumed from it shows. Neither hook is set in real runs (a warning
says so when one is); they only delay, they change nothing that is written."""


def delay_for_tests(variable: str = TEST_WRITE_DELAY_ENV) -> None:
    """Sleep as many seconds as the test hook ``variable`` says, when it is set (see the two hooks above)."""
    value = os.environ.get(variable)
    if value:
        warn_once(logger, f"{variable}={value}: every background checkpoint write is delayed (a test hook)")
        time.sleep(float(value))


def host_copy(obj, keep: Callable[[torch.Tensor], bool] | None = None):
    """``obj`` (nested dicts / lists / tuples) with each tensor copied to host memory, into storage of its
    own: training changes the originals in place while the copy is written. Tensors that share storage
    (tied weights) share one copy. ``keep(t)`` true: ``t`` is kept as is (a frozen weight that cannot
    change; with ``live=True`` saves, a tensor already in host memory). Other leaves are kept as they are
    (numbers, strings: immutable)."""
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
    live: bool
    finalize: Callable[[], None] | None
    thread: threading.Thread | None = None
    error: BaseException | None = None
    fence_wait: float = 0.0
    """Seconds training waited in ``fence`` for this save's writer."""
    writer_cpu: float | None = None
    """CPU seconds of the writer thread (where the OS counts a thread's own)."""
    written: threading.Event = field(default_factory=threading.Event)
    """Set once the writes returned: they no longer read training's tensors (``fence``)."""
    done: threading.Event = field(default_factory=threading.Event)


class BackgroundSaves:
    """At most one checkpoint written by a thread at a time, published from the main thread (``poll``)."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self.fence_waits = 0.0
        """Seconds training waited in ``fence`` (for a writer still reading its tensors), in all."""

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self, output_dir: str, step: int, writes: list[Callable[[], None]], *, is_writer: bool,
              keep: int | None = None, nested: bool = False, started: float | None = None, live: bool = False,
              finalize: Callable[[], None] | None = None) -> None:
        """Run ``writes`` (each writes files of ``checkpoint-<step>.tmp``) in a thread, then fsync the staging
        directory. ``live``: the writes read training's own tensors, not a host copy; the caller calls ``fence``
        before each in-place update of them. ``finalize``: run by ``poll`` on every rank (collective) once every
        rank's writer finished, before the publish. ``open_staging`` ran before, and the save before this one
        finished (``wait``): that is the one-copy memory bound."""
        assert self._pending is None, "wait() for the pending save before starting another"
        pending = _Pending(output_dir, step, is_writer, keep, nested, started or time.perf_counter(), live, finalize)
        staging = os.path.join(output_dir, f"{checkpoints.PREFIX}{step}.tmp")

        def run() -> None:
            try:
                try:
                    delay_for_tests(TEST_READ_DELAY_ENV)
                    for write in writes:
                        write()
                finally:
                    pending.written.set()
                delay_for_tests(TEST_WRITE_DELAY_ENV)
                checkpoints.fsync_tree(staging)
            except BaseException as exc:  # reported on the main thread by poll()
                pending.error = exc
            finally:
                pending.writer_cpu = _thread_cpu_seconds()
                pending.done.set()

        pending.thread = threading.Thread(target=run, name=f"roll-save-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    def fence(self) -> None:
        """Before training changes its tensors in place (the optimizer step): wait while a ``live`` save's writer
        still reads them. Not collective; returns at once when no such save is pending."""
        pending = self._pending
        if pending is None or not pending.live or pending.written.is_set():
            return
        start = time.perf_counter()
        pending.written.wait()
        pending.fence_wait += time.perf_counter() - start
        self.fence_waits += time.perf_counter() - start

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
        if pending.finalize is not None:
            pending.finalize()
        final = checkpoints.complete(pending.output_dir, pending.step, is_writer=pending.is_writer,
                                     keep=pending.keep, nested=pending.nested, flush=False)
        notes = [f"the update after it waited {pending.fence_wait:.2f}s for the writer"] if pending.live else []
        if pending.writer_cpu is not None:
            notes.append(f"the writer used {pending.writer_cpu:.2f} CPU s")
        log_rank0(logger, "saved checkpoint %s in the background in %.1fs%s", final, time.perf_counter() - pending.started,
                  f" ({'; '.join(notes)})" if notes else "")
        return final

    def wait(self) -> str | None:
        """Collective: finish and publish the pending save (before the next save, the export, the end)."""
        return self.poll(blocking=True)


def _thread_cpu_seconds() -> float | None:
    """User + system CPU seconds of the calling thread (Linux); None where the OS does not count them."""
    import resource

    if not hasattr(resource, "RUSAGE_THREAD"):
        return None
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime
