"""One run per output_dir: an exclusive lock on ``OUTPUT_DIR/.roll.lock`` for the whole run.

The lock is ``fcntl.flock`` on that file, so the kernel releases it when the last process holding the open
file dies, SIGKILL included; the file records who took it (host, PID, start time, command) for the message
a second run shows. Who holds it:

- ``roll-train`` itself before it launches ranks (or trains in its own process); the launcher and every rank
  inherit the open file as their stdin (``roll.launch.relaunch``), so the lock lives as long as any process
  of the run does. After a SIGKILL of roll-train its launcher and ranks live on until the parent-death
  signal has stopped them (they finish their step and may save): a rerun on this host waits for them
  (``ORPHAN_WAIT_S``) instead of writing next to them;
- under the user's own ``torchrun`` / deepspeed launcher, global rank 0, before any rank writes (a rank 0
  that refuses ends the job: the launcher stops the other ranks);
- with ``nnodes > 1`` only node 0's roll-train (the nodes share output_dir); ``srun`` with one task per rank:
  the task of global rank 0 (``roll.slurm``).

A lock left by a run that is gone (its file remains, nobody holds it) is taken over with a log line. A
live run's lock refuses the second run with exit code 2, naming the host and PID, except a lock held by an
earlier run of the same requeued SLURM job (same SLURM_JOB_ID, lower SLURM_RESTART_COUNT, recorded in the
file): SLURM is stopping that one, so the new run waits for it (``ORPHAN_WAIT_S``), as for orphans.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

from roll.errors import ConfigError
from roll.slurm import restart_count

logger = logging.getLogger(__name__)

LOCK_NAME = ".roll.lock"
ORPHAN_WAIT_S = 90.0
"""How long a new run waits for the launcher and ranks of a killed roll-train on this host to stop: torchrun
gives ranks 30 s after SIGTERM before it kills them, and a rank may be saving a checkpoint."""


@dataclass
class OutputDirLock:
    """The held lock: ``fd`` is the open lock file (keep it open for the whole run)."""

    path: str
    fd: int
    created: str | None = None
    """The top-most directory ``acquire`` created for output_dir (None: output_dir existed)."""

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and close it; the lock is gone with the last holder.
        The directories ``acquire`` created go too while empty: a run that failed before writing anything
        leaves no empty output_dir behind."""
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
        remove_created(os.path.dirname(self.path), self.created)


def takes_lock(training, environ=None) -> bool:
    """Whether this process takes the output_dir lock (see the module doc for who holds it)."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    from roll.launch import LAUNCHED_ENV, inside_launcher

    if inside_launcher():
        return LAUNCHED_ENV not in environ and environ.get("RANK", "0") == "0"
    return training.nnodes == 1 or (training.node_rank or 0) == 0


def acquire(output_dir: str, *, wait_s: float = ORPHAN_WAIT_S) -> OutputDirLock:
    """Create output_dir if needed and lock it; ConfigError when another live run holds it or output_dir
    cannot be written (what it created for output_dir is removed again then)."""
    created = _first_missing(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        remove_created(output_dir, created)
        raise ConfigError(f"output_dir={output_dir!r} cannot be created ({exc.strerror}): choose an "
                          "output_dir you can write.") from None
    try:
        return _lock(output_dir, wait_s, created)
    except ConfigError:
        remove_created(output_dir, created)
        raise


def _first_missing(path: str) -> str | None:
    """The top-most directory of ``path`` that does not exist yet (None when ``path`` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_created(output_dir: str, created: str | None) -> None:
    """Remove output_dir and its parents up to ``created`` (what a run created), each only while empty."""
    if created is None:
        return
    path = os.path.abspath(output_dir)
    while os.path.commonpath([path, created]) == created:  # never above what was created
        try:
            os.rmdir(path)  # fails on a directory that holds anything: nothing is lost
        except OSError:
            return
        if path == created:
            return
        path = os.path.dirname(path)


def _lock(output_dir: str, wait_s: float, created: str | None) -> OutputDirLock:
    path = os.path.join(output_dir, LOCK_NAME)
    deadline = None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"output_dir={output_dir!r} is not writable ({exc.strerror}): choose an "
                              "output_dir you can write.") from None
        holder = _try_lock(fd, path)
        if holder is None:
            if not _same_file(fd, path):  # the holder released (removed the file) between open and lock
                os.close(fd)
                continue
            _take(fd, path)
            return OutputDirLock(path, fd, created)
        os.close(fd)
        earlier = _earlier_run_of_this_job(holder)
        if not (earlier or _orphaned(holder)):
            raise ConfigError(_refusal(output_dir, holder))
        if deadline is None:
            deadline = time.monotonic() + wait_s
            if earlier:
                logger.warning("output_dir %s is still locked by an earlier run of this requeued SLURM job "
                               "%s (PID %s on %s); waiting up to %.0f s for SLURM to stop it", output_dir,
                               holder.get("slurm_job"), holder.get("pid"), holder.get("host"), wait_s)
            else:
                logger.warning("output_dir %s is still locked by the launcher or ranks of a roll-train that "
                               "is gone (PID %s on this host); waiting up to %.0f s for them to stop",
                               output_dir, holder.get("pid"), wait_s)
        if time.monotonic() >= deadline:
            raise ConfigError(_refusal(output_dir, holder, waited=wait_s))
        time.sleep(0.5)


def _try_lock(fd: int, path: str) -> dict | None:
    """None when this process now holds the lock, else the holder's record (possibly {})."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # a file system without flock: fall back to the record alone
            logger.warning("cannot lock %s (%s): two runs on this output_dir are not prevented", path,
                           exc.strerror)
            record = _read(fd)
            return record if record and record.get("host") == _host() and _alive(record) else None
    return _read(fd)


def _take(fd: int, path: str) -> None:
    """Record this process as the holder; log the previous holder, a run that ended without releasing."""
    previous = _read(fd)
    if previous:
        logger.warning("taking over %s, left by PID %s on %s (started %s), which is no longer running", path,
                       previous.get("pid"), previous.get("host"), _when(previous))
    from roll.redact import redact_argv

    record = {"host": _host(), "pid": os.getpid(), "started": _start_time(os.getpid()),
              "command": " ".join(redact_argv(sys.argv))}  # shown by the refusal; no hub_token there
    if os.environ.get("SLURM_JOB_ID"):  # a requeued run of the same job knows its predecessor by these
        record.update(slurm_job=os.environ["SLURM_JOB_ID"], slurm_restart=restart_count())
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)


def _refusal(output_dir: str, holder: dict, waited: float | None = None) -> str:
    who = f"PID {holder.get('pid', '?')} on {holder.get('host', 'an unknown host')}"
    if waited is not None:
        return (f"output_dir {output_dir!r} is still in use by the launcher or ranks of a killed run ({who}, "
                f"started {_when(holder)}) after {waited:.0f} s. Stop those processes (they are this run's "
                "processes still writing there), then run again.")
    command = f" ({holder['command']})" if holder.get("command") else ""
    return (f"output_dir {output_dir!r} is in use by another run: {who}, started {_when(holder)}{command}. "
            "Two runs would overwrite each other's checkpoints: wait for it to finish, stop it, or choose "
            "another output_dir.")


def _orphaned(holder: dict) -> bool:
    """Held, but the process that took it (on this host) is gone: its launcher or ranks still run."""
    return bool(holder) and holder.get("host") == _host() and not _alive(holder)


def _earlier_run_of_this_job(holder: dict) -> bool:
    """Held by a run of this same SLURM job before it was requeued (a lower SLURM_RESTART_COUNT): SLURM is
    stopping it (SIGTERM, then SIGKILL after KillWait), on this host or another, so wait, never refuse."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and holder.get("slurm_job") == job and isinstance(holder.get("slurm_restart"), int) \
        and holder["slurm_restart"] < restart_count()


def _alive(record: dict) -> bool:
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    started = _start_time(pid)
    return started is not None and (record.get("started") is None or abs(started - record["started"]) < 1.0)


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), None when there is no such process; tells a reused PID
    from the recorded one. psutil comes with accelerate, which the standard backend needs."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def _host() -> str:
    return socket.gethostname()


def _when(record: dict) -> str:
    started = record.get("started")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "at an unknown time"
