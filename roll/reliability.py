"""What a rank does when a run goes wrong, the same on both backends.

- **Preemption** (``StopSignal``): SIGTERM / SIGINT set a flag; the training loop asks at the end of
  every optimizer step whether *any* rank got one (``poll``: one tiny all-reduce), so all ranks stop after
  the same step, save a checkpoint (``save_on_preemption``) and end with ``Preempted`` (exit code 75).
  A second signal stops at once; under SLURM, which signals every process of a step together (and a
  launcher forwards what it got), the signals of one burst (``BURST_S``) are one request. The early-warning
  signal (``slurm_signal``, e.g. SLURM's ``--signal=USR1@300``) saves a checkpoint after the step and trains
  on, or with ``slurm_requeue`` saves, stops and has the job requeued (``roll.slurm.requeue``).
- **Non-finite steps** (``SkipCounter``): a step whose loss or grad norm is not finite makes no
  update and is counted; ``max_consecutive_skipped_steps`` in a row end the run with ``Diverged``
  (exit code 3), naming the step and the samples of its global batch.
- **Collective failures** (``collective_failure``): a gloo / NCCL collective that timed out after
  ``ddp_timeout`` or lost its peer becomes ``Hung`` (exit code 4), naming the rank and what it was
  doing (``set_activity``) instead of a C++ backtrace.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import signal
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from roll.errors import Diverged, Hung
from roll.logging import get_rank

logger = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


BURST_S = 10.0
"""Under SLURM (SLURM_JOB_ID set), a stop signal this soon after the first is part of the same request: SLURM
signals the batch shell and every process of a step at once, srun and roll-train forward what they got, and a
launcher (torchrun, DeepSpeed's) that got it too stops its ranks with one more SIGTERM."""


class Action(enum.IntEnum):
    """What every rank does after a step (``StopSignal.poll``); the largest any rank asks for wins."""

    CONTINUE = 0
    SAVE = 1
    STOP = 2


class StopSignal:
    """The process's preemption flag; ``install()`` once per rank, before training."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.warned: int | None = None
        """The early-warning signal, received and not yet acted on."""
        self.warning: int | None = None
        self.requeue = False
        self.requeued = False
        """The stop is the early warning's with ``slurm_requeue``: the job is requeued once saved, and SLURM's
        SIGTERM to the requeued job's processes (sent to every rank, also while it exits) is expected."""
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self, warning: int | None = None, requeue: bool = False) -> None:
        """Catch SIGTERM / SIGINT and the early-warning signal ``warning`` (main thread only; a no-op
        elsewhere). Installing again (another run in the same process) keeps the handlers found the first
        time, so ``uninstall`` restores those, not its own."""
        self.signum = self.warned = None
        self.warning, self.requeue, self.requeued = warning, requeue, False
        signals = (*_STOP_SIGNALS, *((warning,) if warning else ()))
        try:
            for sig in signals:
                handler = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, handler)
        except ValueError:  # not the main thread (e.g. a notebook's worker thread)
            self._previous = {}

    def uninstall(self) -> None:
        """Put the handlers found back; after a requeue SIGTERM stays ignored (SLURM stops the job's processes
        while they exit, and this one has nothing left to save)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.requeued and sig == signal.SIGTERM else handler)
        self._previous = {}

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if signum == self.warning and signum not in _STOP_SIGNALS:
            self.warned = signum
            logger.warning("rank %d got %s (the early warning): saving a checkpoint after this step%s",
                           get_rank(), name, ", then requeueing the job" if self.requeue else "")
            return
        if self.signum is not None and (self.requeued or self._in_burst()):
            logger.info("rank %d got %s again: part of the same stop", get_rank(), name)
            return
        if self.signum is not None:  # the second signal: stop now, the default way
            self.uninstall()
            if signal.getsignal(signum) == signal.SIG_IGN:
                # A background job of a non-interactive shell (`roll-train ... &`, nohup) starts with SIGINT
                # ignored; the user still asked to stop at once.
                default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                signal.signal(signum, default)
            signal.raise_signal(signum)
            return
        self.signum, self._first_at = signum, time.monotonic()
        again = "again after %.0f s" % BURST_S if "SLURM_JOB_ID" in os.environ else "it again"
        logger.warning("rank %d got %s: finishing this step, then saving a checkpoint and stopping "
                       "(send %s to stop at once)", get_rank(), name, again)

    def _in_burst(self) -> bool:
        return "SLURM_JOB_ID" in os.environ and time.monotonic() - self._first_at < BURST_S

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a stop signal"

    def requested(self) -> bool:
        """Whether any rank got a stop signal. Collective when a process group exists: call it at the
        same point on every rank."""
        return any_rank(self.signum is not None)

    def poll(self) -> Action:
        """What every rank does after this step: STOP when any rank got a stop signal, or the early warning
        with ``requeue``; SAVE when any got the early warning; else CONTINUE. Collective (one all-reduce):
        call it at the same point on every rank."""
        local = Action.STOP if self.signum is not None else Action.SAVE if self.warned else Action.CONTINUE
        action = Action(max_over_ranks(int(local)))
        if action is Action.SAVE:
            self.warned = None
            if self.requeue:
                self.signum, self.requeued = self.signum or self.warning, True
                return Action.STOP
        return action


STOP = StopSignal()
"""The one flag of this process (signal handlers are process-global)."""


def barrier() -> None:
    """Wait for every rank (a no-op without a multi-rank process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over all ranks (one all-reduce when a multi-rank process group exists)."""
    return bool(max_over_ranks(1 if flag else 0))


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of all ranks (one all-reduce when a multi-rank process group exists).

    Host only: the all-reduce runs on a CPU tensor, over the default group when it has a CPU backend (gloo) and
    otherwise (NCCL) over a gloo group of all ranks (``host_group``), so the per-step stop poll never waits for
    the accelerator: on NCCL an all-reduce of a device tensor read back with ``.item()`` would wait for every
    kernel queued before it, once per step."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=host_group())
    return int(tensor.item())


_host: tuple[weakref.ref, weakref.ref] | None = None
"""Weak references to (the default process group, ``host_group``'s group for it)."""


def host_group():
    """The group ``max_over_ranks`` all-reduces a CPU tensor over: None (the default group) when that has a CPU
    backend, else a gloo group of all ranks with the default group's timeout (``ddp_timeout``), made at the first
    call (collective: every rank calls it at the same point, as every caller of ``max_over_ranks`` does) and
    kept while the default group lives.

    Only weak references are kept: ``destroy_process_group`` must drop the last ones. A group still referenced
    here after it was destroyed went at interpreter exit instead, and its gloo threads then aborted the process
    ("terminate called without an active exception") on one run in four."""
    global _host
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD
    if "gloo" in dist.get_backend():  # "gloo", or a mixed "cpu:gloo,cuda:nccl"
        return None
    group = _host[1]() if _host is not None and _host[0]() is world else None
    if group is None:
        timeout = None
        try:  # the default group's collective timeout (ProcessGroupNCCL's options); torch's default otherwise
            timeout = world._get_backend(torch.device("cuda")).options._timeout
        except (AttributeError, RuntimeError):
            pass
        group = dist.new_group(backend="gloo", timeout=timeout)
        _host = (weakref.ref(world), weakref.ref(group))
    return group


# ---- non-finite steps ---------------------------------------------------------------------------

def global_batch_samples(step: int, global_batch_size: int, num_samples: int) -> range:
    """Positions in the (shuffled) training set of global step ``step``'s samples (0-based step):
    ``[j*B, (j+1)*B)`` of its epoch, the epoch's last step taking what is left (DESIGN.md section 3)."""
    steps_per_epoch = max(1, math.ceil(num_samples / global_batch_size))
    start = (step % steps_per_epoch) * global_batch_size
    return range(start, min(start + global_batch_size, num_samples))


@dataclass
class SkipCounter:
    """Counts skipped (non-finite) steps; raises ``Diverged`` after ``limit`` in a row (0: never)."""

    limit: int
    total: int = 0
    consecutive: int = 0

    def record(self, skipped: bool, step: int, samples: Sequence[int] = ()) -> None:
        """``step`` is 1-based (the step just done); ``samples`` the global batch's positions."""
        if not skipped:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        logger.warning("step %d skipped: the loss or grad norm is not finite, no update made (%d in a row, "
                       "%d in all)", step, self.consecutive, self.total)
        if self.limit and self.consecutive >= self.limit:
            raise Diverged(
                f"step {step}: the loss or grad norm was not finite for {self.consecutive} steps in a row "
                f"(max_consecutive_skipped_steps={self.limit}), so training stopped; no update was made in those "
                f"steps. Step {step}'s global batch held training samples {_ranges(samples)} (rows of the "
                "prepared training set, 0-based: roll.data.order's rows of that step). Lower learning_rate, check those "
                "samples, or raise "
                "max_consecutive_skipped_steps (0: never stop); resume_from_checkpoint: true continues from the "
                "last checkpoint.")


def _ranges(values: Sequence[int]) -> str:
    values = sorted(values)
    if not values:
        return "(unknown)"
    parts, start, prev = [], values[0], values[0]
    for value in [*values[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ", ".join(parts)


# ---- collective failures ------------------------------------------------------------------------

_activity = "setting up"

_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                 "nccl communicator was aborted", "remote process exited", "connection refused")


def set_activity(text: str) -> None:
    """What this rank is doing now (``"training step 12"``), for the message when a collective fails."""
    global _activity
    _activity = text


def collective_failure(exc: BaseException, timeout_seconds: float | None = None) -> Hung | None:
    """``exc`` as a ``Hung`` when it is a collective that timed out or lost a peer; None otherwise."""
    text = str(exc)
    lowered = text.lower()
    is_dist_error = type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistError") or (
        isinstance(exc, RuntimeError) and ("gloo" in lowered or "nccl" in lowered))
    if not is_dist_error:
        return None
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    rank = get_rank()
    if any(marker in lowered for marker in _TIMEOUT_MARKERS):
        limit = f" after ddp_timeout={timeout_seconds:g}s" if timeout_seconds else ""
        return Hung(f"rank {rank}: a collective did not complete{limit} while {_activity}: another rank hangs "
                    f"or is much slower (see its log). Detail: {first_line}. If that rank is merely slow (e.g. a "
                    "long save or data preprocessing on rank 0), raise ddp_timeout.")
    if any(marker in lowered for marker in _PEER_MARKERS):
        return Hung(f"rank {rank}: lost a peer rank while {_activity}: another rank died (out of memory, "
                    f"killed, or crashed: see its log above). Detail: {first_line}")
    return None

