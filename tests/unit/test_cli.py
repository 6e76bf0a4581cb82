"""The roll-train console entry point: help, print-config, clean errors, launch commands."""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from roll import launch
from roll.config import parse_args
from roll.errors import ConfigError
from tests.helpers import roll_train, run


def test_help_lists_fields_with_docs():
    proc = roll_train("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for text in ("--learning_rate", "The initial learning rate", "--tensor_model_parallel_size",
                 "[mca] Tensor parallel size", "--stage", "one of pt, sft, dpo, kto", "--cutoff_len",
                 "megatron arguments (MegatronArguments):", "--make_vocab_size_divisible_by"):
        assert text in proc.stdout
    # the Megatron keys are listed in their own group, after the training group
    assert proc.stdout.index("training arguments") < proc.stdout.index("megatron arguments") \
        < proc.stdout.index("--tensor_model_parallel_size")


def test_console_script_installed():
    script = os.path.join(os.path.dirname(sys.executable), "roll-train")
    proc = run([script, "--version"], timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("roll-train "), proc.stderr


def test_print_config_shows_overrides():
    proc = roll_train("recipes/qwen_sft.yaml", "--use-mca", "tensor_model_parallel_size=4", "--print-config",
                      timeout=120)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["training"]["use_mca"] is True
    assert resolved["megatron"]["tensor_model_parallel_size"] == 4
    assert "tensor_model_parallel_size" not in resolved["training"]
    assert resolved["model"]["model_name_or_path"] == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("content, argv, expected", [
    ("learning_rat: 1.0e-5\n", [], ["learning_rat", "learning_rate"]),
    ("stage: sfx\n", [], ["sfx", "sft"]),
    ("stage: sft\n", ["learnin_rate=1"], ["learnin_rate", "learning_rate", "command line"]),
    ("stage: SFT\n", [], ["'SFT' is not one of pt, sft, dpo", "(did you mean 'sft'?)"]),
])
def test_user_mistakes_exit_nonzero_without_traceback(tmp_path, content, argv, expected):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content)
    proc = roll_train(str(recipe), *argv, "--print-config", timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    for fragment in expected:
        assert fragment in proc.stderr


def test_launch_command_uses_torchrun_or_deepspeed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stage: sft\nnproc_per_node: 2\n")
    _, config = parse_args([str(recipe)])
    assert launch.needs_launch(config)
    cmd = launch.launch_command(config, [str(recipe)])
    assert cmd[1:3] == ["-m", "roll.torchrun"] and "--nproc_per_node" in cmd
    assert cmd[-3:] == ["-m", "roll.cli", str(recipe)]

    _, config = parse_args([str(recipe), "deepspeed=recipes/deepspeed/ds_z2.json"])
    cmd = launch.launch_command(config, [str(recipe)])
    assert "deepspeed.launcher.runner" in cmd and "--no_local_rank" in cmd
    assert cmd[cmd.index("--num_gpus") + 1] == "2"


def test_ranks_share_the_cpu_cores_and_use_one_thread_on_gpus(monkeypatch):
    """Without OMP_NUM_THREADS, each rank of a CPU launch gets its share of the usable cores (never more
    threads than cores: oversubscribed GEMM threads wait for each other); GPU ranks get torchrun's 1."""
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [launch.rank_threads(n, accelerator=False) for n in (1, 2, 3, 4, 32)] == [16, 8, 5, 4, 1]
    assert launch.rank_threads(2, accelerator=True) == 1
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert launch.rank_threads(2, accelerator=False) == 1


def test_no_relaunch_inside_a_launcher(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("nproc_per_node: 2\n")
    _, config = parse_args([str(recipe)])
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not launch.needs_launch(config)


def test_multinode_launch_command_and_env_fallbacks(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stage: sft\nnproc_per_node: 2\nnnodes: 2\n")
    _, config = parse_args([str(recipe), "node_rank=1", "master_addr=10.0.0.1"])
    cmd = launch.launch_command(config, [str(recipe)])
    assert cmd[1:3] == ["-m", "roll.torchrun"]
    for flag, value in (("--nnodes", "2"), ("--node_rank", "1"), ("--master_addr", "10.0.0.1"),
                        ("--master_port", "29500"), ("--nproc_per_node", "2")):
        assert cmd[cmd.index(flag) + 1] == value
    assert config.megatron.build_layout(config.training.world_size_from_launch).dp == 4

    # NODE_RANK / MASTER_ADDR / MASTER_PORT / NNODES are fallbacks; the recipe and command line win
    for var, value in (("NNODES", "3"), ("NODE_RANK", "1"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "6000")):
        monkeypatch.setenv(var, value)
    _, config = parse_args([str(recipe), "master_port=7000"])
    t = config.training
    assert (t.nnodes, t.node_rank, t.master_addr, t.master_port) == (2, 1, "node0", 7000)
    with pytest.raises(ConfigError, match="node_rank"):  # node_rank=2 does not fit nnodes=2
        parse_args([str(recipe), "node_rank=2"])
    monkeypatch.delenv("NODE_RANK")
    _, config = parse_args([str(recipe)])
    with pytest.raises(ConfigError, match=r"node_rank \(or env NODE_RANK\)"):
        launch.launch_command(config, [str(recipe)])
    # a DeepSpeed config: the deepspeed launcher's per-node mode over a hostfile of nnodes hosts (port from env)
    _, config = parse_args([str(recipe), "node_rank=1", "deepspeed=recipes/deepspeed/ds_z2.json"])
    cmd = launch.launch_command(config, [str(recipe)])
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"] and "--no_ssh" in cmd
    for flag, value in (("--node_rank", "1"), ("--master_addr", "node0"), ("--master_port", "6000"),
                        ("--num_gpus", "2")):
        assert cmd[cmd.index(flag) + 1] == value
    with open(cmd[cmd.index("--hostfile") + 1], encoding="utf-8") as fh:
        assert fh.read() == "node0 slots=2\nnode1 slots=2\n"


@pytest.mark.parametrize("override, key", [("master_port=70000", "master_port"), ("master_port=0", "master_port"),
                                           ("node_rank=-1", "node_rank"), ("master_addr=' '", "master_addr")])
def test_launch_keys_are_validated(override, key):
    with pytest.raises(ConfigError, match=key):
        parse_args(["nnodes=2", override])


def test_a_mistyped_recipe_path_names_the_closest_recipe():
    with pytest.raises(ConfigError, match=r"'recipes/qwen_sf.yaml' does not exist \(did you mean "
                                          r"'recipes/qwen_sft.yaml'\?\)"):
        parse_args(["recipes/qwen_sf.yaml"])


def test_bare_roll_train_prints_usage(capsys):
    from roll.cli import main

    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: roll-train") and "model_name_or_path" not in err
    assert "roll-train recipes/demo/tiny_sft.yaml" in err


def test_print_config_with_mca_shows_the_resolved_layout(capsys):
    from roll.cli import main

    assert main(["recipes/qwen_sft.yaml", "--use-mca", "--print-config", "context_parallel_size=2"]) == 0
    layout = yaml.safe_load(capsys.readouterr().out)["layout"]
    # qwen_sft: nproc_per_node 8, TP2 with sequence parallelism; CP2 leaves DP 2
    assert layout == {"world_size": 8, "tp": 2, "pp": 1, "vpp": 1, "cp": 2, "dp": 2, "ep": 1, "etp": 2,
                      "sequence_parallel": True}
    assert main(["recipes/qwen_sft.yaml", "--print-config"]) == 0
    assert "layout" not in yaml.safe_load(capsys.readouterr().out)  # the standard backend has none


def test_help_states_what_dtype_auto_does():
    from roll.cli import format_help

    text = " ".join(format_help().split())
    assert "'auto' loads float32 (fp32 master weights" in text and "The mca backend refuses bfloat16/float16" in text
