"""Start roll-train on several processes: re-execute under torchrun or the deepspeed launcher."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from roll.errors import EXIT_DIVERGED, EXIT_HUNG, EXIT_PREEMPTED, EXIT_USAGE, ConfigError
from roll.listen import AGENT_STORE_ENV, bound_store, collective_env

if TYPE_CHECKING:  # roll.config pulls in transformers; tests/helpers and the mca backend only need free_port
    from roll.config import RunConfig

logger = logging.getLogger(__name__)

LAUNCHED_ENV = "ROLL_LAUNCHED"
"""Set in the children so a launched roll-train never launches again."""


def local_rank() -> int:
    """This process's rank on its node (the launcher's ``LOCAL_RANK``; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def inside_launcher() -> bool:
    return LAUNCHED_ENV in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def needs_launch(config: RunConfig) -> bool:
    t = config.training
    return not inside_launcher() and t.nproc_per_node * t.nnodes > 1


def rank_threads(nproc_per_node: int, accelerator: bool) -> int:
    """torch threads per rank when the user set no ``OMP_NUM_THREADS``: on GPUs 1 (torchrun's own default:
    the work is on the device); on CPU this machine's usable cores split over the node's ranks, so a
    2-process run on 16 cores computes on 16, not 2, and never on more threads than cores (2 threads per
    rank made a step ~2x slower on 2 cores: the threads of one GEMM wait for each other)."""
    if accelerator:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(nproc_per_node, 1))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a launcher's or a single-process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_MULTINODE_PORT = 29500
"""torchrun's default rendezvous port, used when nnodes > 1 and none is given."""


def launch_command(config: RunConfig, argv: list[str], where: tuple[str, int] | None = None) -> list[str]:
    """The launcher command that runs ``roll-train argv`` on this node's nproc_per_node processes.

    One node: torchrun (or the deepspeed launcher) on 127.0.0.1 and a free port. nnodes > 1: this node's
    share of one job through torchrun's static rendezvous (``--nnodes --node_rank --master_addr
    --master_port``), or with a ``deepspeed`` config through the deepspeed launcher's per-node mode
    (``--hostfile --no_ssh --node_rank``, the same master_addr/master_port).
    """
    t = config.training
    addr, port = where or rendezvous(config)
    if not t.use_mca and t.deepspeed:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(t.nproc_per_node)]
        if t.nnodes > 1:
            cmd += ["--hostfile", deepspeed_hostfile(t.nnodes, t.nproc_per_node), "--no_ssh",
                    "--node_rank", str(t.node_rank)]
        # --no_local_rank: roll reads LOCAL_RANK from the environment, not from an injected argument.
        return [*cmd, "--master_addr", addr, "--master_port", str(port), "--no_local_rank",
                "--module", "roll.cli", *argv]
    cmd = [sys.executable, "-m", "roll.torchrun", "--nproc_per_node", str(t.nproc_per_node)]
    if t.nnodes > 1:
        cmd += ["--nnodes", str(t.nnodes), "--node_rank", str(t.node_rank)]
    return [*cmd, "--master_addr", addr, "--master_port", str(port), "-m", "roll.cli", *argv]


def rendezvous(config: RunConfig) -> tuple[str, int]:
    """(master_addr, master_port) for the launcher; a ConfigError naming the key a multi-node run lacks."""
    t = config.training
    if t.nnodes == 1:
        return t.master_addr or "127.0.0.1", t.master_port or free_port()
    missing = [f"{key} (or env {var})" for key, var in (("node_rank", "NODE_RANK"), ("master_addr", "MASTER_ADDR"))
               if getattr(t, key) is None]
    if missing:
        raise ConfigError(f"nnodes={t.nnodes} needs {' and '.join(missing)}: run roll-train on every node with the "
                          "same master_addr (node 0's address) and its own node_rank, e.g. "
                          "`roll-train RECIPE nnodes=2 node_rank=0 master_addr=10.0.0.1` on node 0 and node_rank=1 "
                          "on node 1.")
    return t.master_addr, t.master_port or DEFAULT_MULTINODE_PORT


def deepspeed_hostfile(nnodes: int, nproc_per_node: int) -> str:
    """A hostfile for the deepspeed launcher's per-node mode (``node0 slots=N`` ... ``node{nnodes-1}``).

    With ``--no_ssh`` the launcher contacts no host: it only counts the hostfile's hosts and slots to number
    the ranks (global rank = node_rank * nproc_per_node + local rank, WORLD_SIZE = their total), so the
    names are placeholders and every node writes the same file. Without a hostfile it would run one local
    node and reset master_addr to 127.0.0.1. Written atomically: two "nodes" on one machine may race here.
    """
    folder = tempfile.gettempdir()
    name = f"roll-deepspeed-hostfile-uid{os.getuid()}-{nnodes}x{nproc_per_node}"
    fd, partial = tempfile.mkstemp(prefix=name + ".", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.writelines(f"node{rank} slots={nproc_per_node}\n" for rank in range(nnodes))
    path = os.path.join(folder, name)
    os.replace(partial, path)
    return path


@dataclass(frozen=True)
class Outcome:
    """How a launched run ended on this node: the exit code for roll-train, and the line to show."""

    code: int
    message: str | None = None


def relaunch(config: RunConfig, argv: list[str], inherit: int | None = None) -> Outcome:
    """Run the launcher as a child and wait; the first Ctrl-C / SIGTERM asks every rank to finish its step
    and save (``roll.reliability``), a second one stops the launcher at once. The ranks report how they ended
    in status files, so the exit code is theirs (2 user mistake, 3 diverged, 4 hung, 75 preempted).

    ``inherit``: an open file (the output_dir lock, ``roll.lock``) that the launcher and every rank get as
    their stdin. torchrun and the deepspeed launcher close every other descriptor in their children but pass
    stdin on, so the lock is held as long as any process of the run lives (ranks never read stdin)."""
    from roll import redact

    t = config.training
    argv, secrets = redact.split_secrets(argv)  # launchers log their command line; ps shows it to everyone
    addr, port = rendezvous(config)
    cmd = launch_command(config, argv, (addr, port))
    env = dict(os.environ, **{LAUNCHED_ENV: "1"})
    if secrets:
        env[redact.SECRETS_ENV] = json.dumps(secrets)
    from roll.platform import current_platform

    accelerator = current_platform().is_accelerator
    # The deepspeed launcher sets no OMP_NUM_THREADS, torchrun sets 1: the ranks' share of the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(rank_threads(t.nproc_per_node, accelerator)))
    if not accelerator:
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would detect it too, with a warning per rank
    where = f" (node {t.node_rank} of {t.nnodes})" if t.nnodes > 1 else ""
    logger.info("launching %d processes%s: %s", t.nproc_per_node, where, " ".join(redact.redact_argv(cmd)))
    env.update(collective_env(addr, env))
    with tempfile.TemporaryDirectory(prefix="roll-status-") as status_dir, \
            _hosted_store(config, env, addr, port):
        env[STATUS_DIR_ENV] = status_dir
        notices = (t.slurm_signum,) if t.slurm_signum else ()
        code = run_child(cmd, graceful=True, notices=notices, env=env,
                         **({} if inherit is None else {"stdin": inherit}))
        first = (t.node_rank or 0) * t.nproc_per_node
        return summarize(read_statuses(status_dir), range(first, first + t.nproc_per_node), code)


def relaunch_tool(module: str, argv: list[str], nproc: int) -> Outcome:
    """Run ``python -m module argv`` on ``nproc`` local processes under torchrun (127.0.0.1, a free port) and
    wait: for a tool whose parallel layout needs several ranks (``roll-convert --tp 2``). Its ranks report
    how they ended with ``write_status`` as roll-train's do; the exit code and message are theirs."""
    cmd = [sys.executable, "-m", "roll.torchrun", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", module, *argv]
    env = dict(os.environ, **{LAUNCHED_ENV: "1"})
    from roll.platform import current_platform

    threads = rank_threads(nproc, current_platform().is_accelerator)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.update(collective_env("127.0.0.1", env))
    logger.info("launching %d processes: %s", nproc, " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="roll-status-") as status_dir:
        env[STATUS_DIR_ENV] = status_dir
        code = run_child(cmd, env=env)
        return summarize(read_statuses(status_dir), range(nproc), code)


@contextlib.contextmanager
def _hosted_store(config: RunConfig, env: dict[str, str], addr: str, port: int):
    """Under the DeepSpeed launcher, roll-train (node 0's) hosts the rendezvous store, listening on
    master_addr only, and every rank connects as a client; otherwise rank 0 would host it on every interface.
    torchrun's agent hosts its own (``roll.torchrun``)."""
    t = config.training
    if t.use_mca or not t.deepspeed:
        yield
        return
    env[AGENT_STORE_ENV] = "True"
    if t.nnodes > 1 and t.node_rank != 0:
        yield
        return
    store = bound_store(addr, port, world_size=t.nproc_per_node * t.nnodes,
                        timeout=timedelta(seconds=t.ddp_timeout))
    try:
        yield
    finally:
        del store


def run_child(cmd: list[str], on_signal: Callable[[int], object] | None = None, *, graceful: bool = False,
              notices: tuple[int, ...] = (), **popen_kwargs) -> int:
    """Run ``cmd`` and wait for it, forwarding Ctrl-C / SIGTERM to it (and telling ``on_signal``);
    return its exit code.

    ``graceful`` (``cmd`` is a launcher of roll ranks): the launcher runs in its own session, so a terminal's
    Ctrl-C reaches only this process; the first signal goes straight to the ranks (which finish their step
    and save), bypassing the launcher (torchrun and DeepSpeed's launcher kill ranks 30 s after forwarding);
    the second goes to the launcher. The launcher gets SIGTERM if this process dies.

    ``notices`` (with ``graceful``): signals that ask the ranks for something and stop nothing (the early
    warning, ``slurm_signal``): each goes to the ranks only, every time; the launcher ignores them (their
    default action would end it, and SLURM may signal it too).
    """
    if graceful:
        popen_kwargs.update(start_new_session=True, preexec_fn=functools.partial(_launcher_setup, notices))
    child = subprocess.Popen(cmd, **popen_kwargs)
    received: list[int] = []
    first_at: list[float] = []

    def notify(signum, _frame):
        for rank in _rank_processes(child.pid):
            _send(rank, signum)

    def forward(signum, _frame):
        if graceful and received and _same_burst(first_at):
            return  # SLURM signalled this process and its ranks together (and srun forwards it once more)
        received.append(signum)
        first_at.append(time.monotonic())
        if on_signal is not None:
            on_signal(signum)
        if child.poll() is not None:
            return
        ranks = _rank_processes(child.pid) if graceful and len(received) == 1 else []
        if ranks:
            logger.warning("stopping: every rank finishes its step and saves a checkpoint (unless "
                           "save_on_preemption is false); signal again to stop at once")
            for rank in ranks:
                _send(rank, signum)
        else:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous.update({sig: signal.signal(sig, notify) for sig in notices if graceful})
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- how the ranks ended ------------------------------------------------------------------------

STATUS_DIR_ENV = "ROLL_STATUS_DIR"
"""Set by ``relaunch`` in the ranks' environment: where each rank writes ``rank_R.json`` when it ends."""

_SEVERITY = (EXIT_USAGE, EXIT_HUNG, EXIT_DIVERGED, EXIT_PREEMPTED)
"""Which rank's report wins when ranks disagree: a user mistake explains everything after it."""


def under_roll_launcher() -> bool:
    return STATUS_DIR_ENV in os.environ


def write_status(code: int, message: str) -> None:
    """Tell the roll-train that launched this rank how it ended (a no-op without one)."""
    folder = os.environ.get(STATUS_DIR_ENV)
    if not folder:
        return
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(folder, f"rank_{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump({"code": code, "message": message}, fh)
    except OSError:  # the parent is gone; its status directory with it
        pass


def read_statuses(folder: str) -> dict[int, dict]:
    found = {}
    for name in os.listdir(folder):
        if name.startswith("rank_") and name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                found[int(name[5:-5])] = json.load(fh)
    return found


def summarize(statuses: dict[int, dict], ranks: range, launcher_code: int) -> Outcome:
    """One exit code and message for this node from its ranks' reports and the launcher's exit code."""
    silent = [rank for rank in ranks if rank not in statuses]
    dead = f"rank {', '.join(map(str, silent))} ended without a report (killed, e.g. out of memory, or " \
           "crashed: see its log above)" if silent and launcher_code != 0 else None
    for code in _SEVERITY:
        reports = [statuses[rank]["message"] for rank in sorted(statuses) if statuses[rank]["code"] == code]
        if reports:
            return Outcome(code, "; ".join(filter(None, [dead, reports[0]])))
    if dead:
        return Outcome(launcher_code or 1, dead)
    return Outcome(launcher_code)


def _rank_processes(launcher_pid: int) -> list:
    """The roll-train ranks under the launcher (not the launcher processes themselves)."""
    import psutil

    ranks = []
    try:
        for proc in psutil.Process(launcher_pid).children(recursive=True):
            cmdline = " ".join(proc.cmdline())
            if "roll.cli" in cmdline and not any(name in cmdline for name in _LAUNCHERS):
                ranks.append(proc)
    except psutil.Error:
        return []
    return ranks


_LAUNCHERS = ("roll.torchrun", "torch.distributed.run", "deepspeed.launcher", "deepspeed/launcher")


def _send(proc, signum: int) -> None:
    import psutil

    try:
        proc.send_signal(signum)
    except psutil.Error:
        pass


def _same_burst(first_at: list[float]) -> bool:
    """Under SLURM, a signal within ``roll.reliability.BURST_S`` of the first is part of the same stop."""
    from roll.reliability import BURST_S

    return "SLURM_JOB_ID" in os.environ and time.monotonic() - first_at[0] < BURST_S


def _launcher_setup(notices: tuple[int, ...]) -> None:
    """In the launcher child, before it starts: ignore ``notices`` (the ranks it starts inherit that, until
    roll-train installs its handlers) and die with roll-train."""
    for sig in notices:
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()


def _die_with_parent() -> None:
    """In the launcher child: get SIGTERM when roll-train dies (Linux), as it no longer shares its session."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
