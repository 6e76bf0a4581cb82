"""Two `roll-train` invocations on this machine as node 0 and node 1 (nnodes=2, one process each, master
127.0.0.1) form one 2-rank job whose per-step losses equal a single-node 2-process run: through torchrun's
static rendezvous, and with a DeepSpeed config (ZeRO-2) through the deepspeed launcher's per-node mode
(--hostfile --no_ssh --node_rank)."""

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
DEEPSPEED_TIMEOUT = 420
"""The first DeepSpeed run in a fresh TORCH_EXTENSIONS_DIR JIT-builds its CPU comm op: 91 s measured on the
2 shared cores (about 1 s once cached), on top of the run itself."""


def _recipe(tmp_path, model_dir, deepspeed: str | None) -> str:
    path = tmp_path / "recipe.yaml"
    text = (f"model_name_or_path: {model_dir}\nstage: sft\n"
            f"dataset: {os.path.join(REPO, 'recipes', 'demo', 'data', 'arithmetic_sft.json')}\n"
            "cutoff_len: 64\nper_device_train_batch_size: 4\nmax_steps: 3\nlogging_steps: 1\n"
            "learning_rate: 1.0e-3\nsave_strategy: 'no'\nsave_hf_model: false\nreport_to: none\n"
            "disable_tqdm: true\n")
    if deepspeed:
        text += f"deepspeed: {os.path.join(REPO, 'recipes', 'deepspeed', deepspeed)}\n"
    path.write_text(text)
    return str(path)


def _losses(output_dir) -> list[float]:
    with open(os.path.join(output_dir, "train_log.jsonl"), encoding="utf-8") as fh:
        return [entry["loss"] for entry in map(json.loads, fh) if "loss" in entry]


def _start(*args: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "roll.cli", *args], cwd=REPO, env=clean_env(),
                            stdout=log, stderr=subprocess.STDOUT)


def _wait_all(procs: list[subprocess.Popen], logs: list, timeout: float) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for proc, log in zip(procs, logs):
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]


@pytest.mark.parametrize("deepspeed, node1_flags", [(None, "--nnodes 2 --node_rank 1"),
                                                    ("ds_z2.json", "--no_ssh --node_rank 1")],
                         ids=["torchrun", "deepspeed-zero2"])
def test_two_nodes_on_loopback_equal_one_node_with_two_processes(tiny_model_dir, tmp_path, deepspeed,
                                                                 node1_flags):
    recipe = _recipe(tmp_path, tiny_model_dir, deepspeed)
    timeout = DEEPSPEED_TIMEOUT if deepspeed else TIMEOUT
    # the single-node run first: with DeepSpeed it pays any JIT build alone, not while a peer node waits
    with open(tmp_path / "single.log", "w+", encoding="utf-8") as log:
        single = _start(recipe, f"output_dir={tmp_path / 'single'}", "nproc_per_node=2", log=log)
        _wait_all([single], [log], timeout)

    port = str(free_port())
    logs = [open(tmp_path / f"node{rank}.log", "w+", encoding="utf-8") for rank in range(2)]
    # each "node" has its own output_dir, as on nodes without a shared filesystem; global rank 0 logs
    nodes = [_start(recipe, f"output_dir={tmp_path / f'node{rank}'}", "nnodes=2", f"node_rank={rank}",
                    "master_addr=127.0.0.1", f"master_port={port}", log=logs[rank]) for rank in range(2)]
    _wait_all(nodes, logs, timeout)
    node0_log, node1_log = (open(tmp_path / f"node{rank}.log", encoding="utf-8").read() for rank in range(2))
    assert node1_flags in node1_log
    assert "data-parallel size 2" in node0_log  # one 2-rank job, not two 1-rank jobs
    assert not os.path.exists(tmp_path / "node1" / "train_log.jsonl")  # node 1 holds rank 1 only

    two_nodes, one_node = _losses(tmp_path / "node0"), _losses(tmp_path / "single")
    assert len(one_node) == 3
    assert two_nodes == pytest.approx(one_node, rel=1e-6)
