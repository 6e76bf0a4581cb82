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


def launch_command(config: RunConfig, argv: list[str]) -> list[str]:
    """The launcher command that runs ``roll-train argv`` on nproc_per_node processes."""
    t = config.training
    if t.nnodes > 1:
        raise ConfigError("nnodes > 1: start roll-train on each node with your cluster launcher "
                          "(torchrun --nnodes ... or deepspeed --hostfile ...); roll-train only spawns local processes.")
    port = str(free_port())
    if not t.use_mca and t.deepspeed:
        # --no_local_rank: roll reads LOCAL_RANK from the environment, not from an injected argument.
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(t.nproc_per_node),
                "--master_port", port, "--no_local_rank", "--module", "roll.cli", *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(t.nproc_per_node),
            "--master_addr", "127.0.0.1", "--master_port", port, "-m", "roll.cli", *argv]


def relaunch(config: RunConfig, argv: list[str]) -> int:
    """Run the launcher as a child; forward Ctrl-C / SIGTERM so every rank stops; return its exit code."""
    cmd = launch_command(config, argv)
    env = dict(os.environ, **{LAUNCHED_ENV: "1"})
    env.setdefault("OMP_NUM_THREADS", "1")  # the deepspeed launcher does not set it; 2-4x slower without
    from roll.platform import current_platform

    if not current_platform().is_accelerator:
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would detect it too, with a warning per rank
    logger.info("launching %d processes: %s", config.training.nproc_per_node, " ".join(cmd))
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
