"""Helpers shared by tests: starting real processes (every subprocess gets a timeout), and batches
in the column layout ``datasets.map(batched=True)`` hands to a processor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from roll.launch import free_port
from roll.platform import current_platform

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_ACCELERATOR = current_platform().is_accelerator
cpu_only = pytest.mark.skipif(ON_ACCELERATOR, reason="checks what happens on a machine without a GPU "
                              "(CPU patches, the local layer spec, gloo)")
"""For a test whose expected values hold only without a GPU: it is skipped on one, not failed."""

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "ROLL_LAUNCHED", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without launcher variables (nor SLURM's: a suite run inside an allocation
    must not make its roll-train runs tasks of that job), with OMP_NUM_THREADS=1."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root, capture output; fail the test (not hang) after ``timeout``."""
    return subprocess.run(cmd, cwd=REPO, env=clean_env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)


def run_stopping(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root in a session of its own, capture output; past ``timeout`` it gets
    SIGTERM first (roll-parity and roll-train forward it to their runs), its session SIGKILL 30 s later,
    and the test fails."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def roll_train(*args: str, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """``roll-train args...`` in a subprocess (the real console entry point)."""
    return run([sys.executable, "-m", "roll.cli", *args], timeout=timeout, **extra_env)


def torchrun(*args: str, nproc: int = 2, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc args...`` on a free local port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *args]
    return run(cmd, timeout=timeout, **extra_env)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds passed (False)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def output_of(proc: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """The end of a process's stdout + stderr, for assertion messages."""
    return (proc.stdout[-tail:] + "\n--- stderr ---\n" + proc.stderr[-tail:])


def batch_of(rows: list[dict]) -> dict[str, list]:
    """Rows -> the columnar batch ``datasets.map(batched=True)`` passes (a missing key reads as None)."""
    keys = sorted({k for row in rows for k in row})
    return {k: [row.get(k) for row in rows] for k in keys}


def results(stdout: str, marker: str = "RESULT ") -> list[dict]:
    """Every ``RESULT {json}`` record the ranks printed, in order.

    Ranks share one stdout pipe, so two records can land on the same line; each JSON object is
    decoded from right after its marker, whatever follows it.
    """
    import json

    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in stdout.split(marker)[1:]]


def random_checkpoint(model_dir: str, seed: int = 0) -> tuple[dict, dict]:
    """A saved HF model's config.json and tensor *names*, every tensor replaced by fresh random values
    (HF init leaves biases at 0 and norms at 1, which would hide a wrong mapping)."""
    import json

    import torch
    from safetensors import safe_open

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        hf_config = json.load(fh)
    gen = torch.Generator().manual_seed(seed)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        sd = {name: torch.randn(f.get_slice(name).get_shape(), generator=gen) for name in f.keys()}
    return hf_config, sd
