"""Outputs that cannot mislead (roll.outputs): where a run may write, whose files an output_dir holds, and no
weight files of an earlier save left beside an export's own."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from roll.errors import ConfigError
from roll.outputs import (MARKER, check_contents, check_location, check_no_linked_checkpoints,
                          output_dir_value, remove_stale_weights, write_marker)
from tests.helpers import output_of, roll_train

IDENTITY = {"stage": "sft", "finetuning_type": "full", "model_name_or_path": "/models/a"}


def test_output_dir_value_expands_home_and_refuses_nothing():
    assert output_dir_value("~/runs/a") == os.path.join(os.path.expanduser("~"), "runs", "a")
    for empty in ("", "  ", None, "None", "null"):
        with pytest.raises(ConfigError, match="empty or null"):
            output_dir_value(empty)


@pytest.mark.parametrize("place", ["/", "/etc", "/usr/lib/x", "/proc/self", "/tmp", "~"])
def test_system_places_and_home_are_refused(place):
    with pytest.raises(ConfigError, match="system directory|home directory"):
        check_location(os.path.expanduser(place), model_dirs=[], data_paths=[])


def test_a_link_to_a_system_directory_is_refused(tmp_path):
    (tmp_path / "out").symlink_to("/etc")
    with pytest.raises(ConfigError, match=r"system directory \(/etc\)"):
        check_location(str(tmp_path / "out"), model_dirs=[], data_paths=[])
    check_location(str(tmp_path / "fine"), model_dirs=[str(tmp_path / "model")], data_paths=[])


def test_contents_same_recipe_logs_only_or_foreign(tmp_path):
    out = str(tmp_path / "out")
    check_contents(out, IDENTITY)  # not there yet
    os.makedirs(out)
    (tmp_path / "out" / "train_log.jsonl").write_text("{}\n")
    (tmp_path / "out" / ".roll.lock").write_text("")
    check_contents(out, IDENTITY)  # roll's own logs and bookkeeping alone (an older roll wrote no marker)
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no roll run wrote it \(tokenizer.json\)"):
        check_contents(out, IDENTITY)
    write_marker(out, IDENTITY)
    check_contents(out, IDENTITY)  # a run of this recipe: its files are this recipe's
    with pytest.raises(ConfigError, match="model_name_or_path '/models/a' there, '/models/b' here"):
        check_contents(out, {**IDENTITY, "model_name_or_path": "/models/b"})
    assert json.loads((tmp_path / "out" / MARKER).read_text())["identity"] == IDENTITY


def test_linked_checkpoints_are_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint-1").mkdir()
    check_no_linked_checkpoints(str(tmp_path / "out"))
    (tmp_path / "out" / "checkpoint-2.tmp").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="checkpoint-2.tmp is a symbolic link"):
        check_no_linked_checkpoints(str(tmp_path / "out"))


def test_remove_stale_weights_keeps_what_the_export_wrote(tmp_path):
    names = ["model.safetensors", "model-00001-of-00003.safetensors", "model-00001-of-00001.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin", "adapter_config.json", "config.json",
             "tokenizer.json", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("x")
    keep = {"model-00001-of-00001.safetensors", "model.safetensors.index.json"}
    removed = remove_stale_weights(str(tmp_path), keep)
    assert removed == ["adapter_config.json", "model-00001-of-00003.safetensors", "model.safetensors",
                       "pytorch_model.bin"]
    assert sorted(os.listdir(tmp_path)) == sorted([*keep, "config.json", "tokenizer.json", "notes.txt"])


SFT_ROWS = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
            for a in range(4) for b in range(4)]


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _file_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """The tensors in the export's own files, read with safetensors (not through from_pretrained)."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "model.safetensors.index.json"), encoding="utf-8") as fh:
        files = sorted(set(json.load(fh)["weight_map"].values()))
    return {name: t for f in files for name, t in load_file(os.path.join(model_dir, f)).items()}


def test_exports_replace_the_weights_of_another_layout(tiny_model_dir, tmp_path):
    """overwrite_output_dir into a folder holding model.safetensors: the mca export (shards + index) removes
    it, so from_pretrained loads the new weights; a standard export then removes the mca shards and index."""
    data = tmp_path / "sft.json"
    data.write_text(json.dumps(SFT_ROWS))
    out = str(tmp_path / "out")
    shutil.copytree(tiny_model_dir, out)  # an earlier model in the layout the standard backend writes
    old = _weights(out)
    base = [f"model_name_or_path={tiny_model_dir}", "stage=sft", f"dataset={data}", f"output_dir={out}",
            "max_steps=2", "learning_rate=1e-2", "cutoff_len=64", "per_device_train_batch_size=2",
            "report_to=none", "save_strategy=no", "overwrite_output_dir=true"]
    proc = roll_train(*base, "--use-mca", timeout=300)
    assert proc.returncode == 0, output_of(proc)
    assert not os.path.exists(os.path.join(out, "model.safetensors")), os.listdir(out)
    loaded, written = _weights(out), _file_tensors(out)
    assert any(not torch.equal(loaded[name], old[name]) for name in old)  # it trained: weights moved
    for name, tensor in written.items():
        assert torch.equal(loaded[name], tensor.float()), name

    proc = roll_train(*base, timeout=300)
    assert proc.returncode == 0, output_of(proc)
    left = [name for name in os.listdir(out) if name.startswith("model")]
    assert left == ["model.safetensors"], left
