"""Two `roll-train` invocations on this machine as node 0 and node 1 (nnodes=2, one process each, torchrun's
static rendezvous on 127.0.0.1) form one 2-rank job whose per-step losses equal a single-node 2-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roll.launch import free_port
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.distributed

TIMEOUT = 120


def _recipe(tmp_path, model_dir) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: {model_dir}\nstage: sft\n"
                    f"dataset: {os.path.join(REPO, 'recipes', 'demo', 'data', 'arithmetic_sft.json')}\n"
                    "cutoff_len: 64\nper_device_train_batch_size: 4\nmax_steps: 3\nlogging_steps: 1\n"
                    "learning_rate: 1.0e-3\nsave_strategy: 'no'\nsave_hf_model: false\nreport_to: none\n"
                    "disable_tqdm: true\n")
    return str(path)


def _losses(output_dir) -> list[float]:
    with open(os.path.join(output_dir, "train_log.jsonl"), encoding="utf-8") as fh:
        return [entry["loss"] for entry in map(json.loads, fh) if "loss" in entry]


def _start(*args: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "roll.cli", *args], cwd=REPO, env=clean_env(),
                            stdout=log, stderr=subprocess.STDOUT)


def _wait_all(procs: list[subprocess.Popen], logs: list) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for proc, log in zip(procs, logs):
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]


def test_two_nodes_on_loopback_equal_one_node_with_two_processes(tiny_model_dir, tmp_path):
    recipe = _recipe(tmp_path, tiny_model_dir)
    port = str(free_port())
    logs = [open(tmp_path / f"node{rank}.log", "w+", encoding="utf-8") for rank in range(2)]
    # each "node" has its own output_dir, as on nodes without a shared filesystem; global rank 0 writes the log
    nodes = [_start(recipe, f"output_dir={tmp_path / f'node{rank}'}", "nnodes=2", f"node_rank={rank}",
                    "master_addr=127.0.0.1", f"master_port={port}", log=logs[rank]) for rank in range(2)]
    _wait_all(nodes, logs)
    assert "--nnodes 2 --node_rank 1" in open(tmp_path / "node1.log", encoding="utf-8").read()
    assert not os.path.exists(tmp_path / "node1" / "train_log.jsonl")  # node 1 holds rank 1 only

    with open(tmp_path / "single.log", "w+", encoding="utf-8") as log:
        _wait_all([_start(recipe, f"output_dir={tmp_path / 'single'}", "nproc_per_node=2", log=log)], [log])
    two_nodes, one_node = _losses(tmp_path / "node0"), _losses(tmp_path / "single")
    assert len(one_node) == 3
    assert two_nodes == pytest.approx(one_node, rel=1e-6)
