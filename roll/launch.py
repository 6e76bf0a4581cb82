"""Start roll-train on several processes: re-execute under torchrun or the deepspeed launcher."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from roll.errors import ConfigError

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a launcher's or a single-process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_MULTINODE_PORT = 29500
"""torchrun's default rendezvous port, used when nnodes > 1 and none is given."""


def launch_command(config: RunConfig, argv: list[str]) -> list[str]:
    """The launcher command that runs ``roll-train argv`` on this node's nproc_per_node processes.

    One node: torchrun (or the deepspeed launcher) on 127.0.0.1 and a free port. nnodes > 1: this node's
    share of one job through torchrun's static rendezvous (``--nnodes --node_rank --master_addr --master_port``).
    """
    t = config.training
    addr, port = rendezvous(config)
    if not t.use_mca and t.deepspeed:
        if t.nnodes > 1:
            # The deepspeed launcher's per-node mode (--no_ssh --node_rank over a hostfile) hung in the
            # two-"node" loopback test; refuse until it is tested rather than start a job that may hang.
            raise ConfigError(f"nnodes={t.nnodes} with a 'deepspeed' config is not launched by roll-train yet: "
                              "start each node yourself (`deepspeed --hostfile HOSTFILE --module roll.cli RECIPE`), "
                              "or use torchrun's rendezvous by dropping 'deepspeed' or with --use-mca.")
        # --no_local_rank: roll reads LOCAL_RANK from the environment, not from an injected argument.
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(t.nproc_per_node),
                "--master_addr", addr, "--master_port", str(port), "--no_local_rank", "--module", "roll.cli", *argv]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(t.nproc_per_node)]
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


def relaunch(config: RunConfig, argv: list[str]) -> int:
    """Run the launcher as a child; forward Ctrl-C / SIGTERM so every rank stops; return its exit code."""
    t = config.training
    cmd = launch_command(config, argv)
    env = dict(os.environ, **{LAUNCHED_ENV: "1"})
    env.setdefault("OMP_NUM_THREADS", "1")  # the deepspeed launcher does not set it; 2-4x slower without
    from roll.platform import current_platform

    if not current_platform().is_accelerator:
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would detect it too, with a warning per rank
    where = f" (node {t.node_rank} of {t.nnodes})" if t.nnodes > 1 else ""
    logger.info("launching %d processes%s: %s", t.nproc_per_node, where, " ".join(cmd))
    return run_child(cmd, env=env)


def run_child(cmd: list[str], on_signal: Callable[[int], object] | None = None, **popen_kwargs) -> int:
    """Run ``cmd`` and wait for it, forwarding Ctrl-C / SIGTERM to it (and telling ``on_signal``);
    return its exit code."""
    child = subprocess.Popen(cmd, **popen_kwargs)

    def forward(signum, _frame):
        if on_signal is not None:
            on_signal(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
