"""A model that is not on this machine is refused before anything loads, saying how to get it.

Without the check, transformers answered a demo recipe run before its tiny model was built with "Repo id
must use alphanumeric chars", and a shipped recipe's Hub id with "We couldn't connect to
'https://huggingface.co'", although roll never downloads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from roll.errors import ConfigError, ModelError
from roll.preflight import check_model_exists
from tests.helpers import REPO, clean_env

HUB_ERRORS = ("Repo id", "huggingface.co", "Traceback", "couldn't connect")


@pytest.mark.parametrize("path, key, expected", [
    (".demo/tiny-qwen2", "model_name_or_path", "python scripts/make_tiny_model.py --out .demo/tiny-qwen2"),
    ("./.demo/tiny-qwen2", "model_name_or_path", "make_tiny_model.py --out ./.demo/tiny-qwen2"),
    ("outputs/demo/tiny_sft/standard", "model_name_or_path", "Run `make demo`"),
    ("Qwen/Qwen2.5-7B-Instruct", "model_name_or_path",
     "`huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir DIR`"),
    ("Qwen/Qwen2.5-7B-Instruct", "ref_model", "then set ref_model=DIR"),
    ("Qwen/Qwen2.5-7B", "--input", "then pass --input DIR"),
    ("/nowhere/models/qwen", "model_name_or_path", "does not exist. Point it at a local Hugging Face model"),
    ("tok/a/b", "tokenizer_name_or_path", "(the tokenizer files)"),
])
def test_message_says_how_to_get_the_model(path, key, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a clone where `make demo` already built .demo/ and outputs/ has them
    with pytest.raises(ModelError) as info:
        check_model_exists(path, key)
    message = str(info.value)
    assert message.startswith(f"{key}={path!r}") and expected in message, message


def test_existing_directory_passes_and_unset_is_a_config_error(tmp_path):
    check_model_exists(str(tmp_path))
    with pytest.raises(ConfigError, match="model_name_or_path is not set"):
        check_model_exists(None)


def _run(args: list[str], cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(PYTHONPATH=REPO, **env),
                          capture_output=True, text=True, timeout=180)


def test_every_command_refuses_a_missing_model_before_loading(tmp_path, tiny_model_dir):
    """A fresh clone: no .demo/ model (cwd is an empty directory; recipes and data by absolute path), and a
    user's shell with the Hub online: each command exits 2 with the message, never a Hub error."""
    recipe = os.path.join(REPO, "recipes", "demo", "tiny_sft.yaml")
    data = "dataset=" + os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json")
    pairs = "dataset=" + os.path.join(REPO, "recipes", "demo", "data", "arithmetic_dpo.json")
    zero3 = "deepspeed=" + os.path.join(REPO, "recipes", "deepspeed", "ds_z3.json")
    online = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    demo_fix = "python scripts/make_tiny_model.py --out .demo/tiny-qwen2"
    hub_fix = "huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir DIR"
    cases = [
        (["-m", "roll.cli", recipe, data], demo_fix),  # train
        (["-m", "roll.cli", recipe, data, "--dry-run"], demo_fix),
        (["-m", "roll.cli", recipe, data, "--use-mca", "--dry-run"], demo_fix),
        (["-m", "roll.parity.cli", recipe, data, "--steps", "2"], demo_fix),
        (["-m", "roll.cli", os.path.join(REPO, "recipes", "qwen_sft.yaml"), data, zero3, "nproc_per_node=1"],
         hub_fix),
        (["-m", "roll.cli", os.path.join(REPO, "recipes", "qwen_sft.yaml"), data, zero3, "--dry-run"], hub_fix),
        (["-m", "roll.cli", os.path.join(REPO, "recipes", "demo", "tiny_dpo.yaml"), pairs,
          f"model_name_or_path={tiny_model_dir}", "ref_model=Qwen/Qwen2.5-7B-Instruct"],
         "ref_model='Qwen/Qwen2.5-7B-Instruct' is not a directory on this machine"),
        (["-m", "roll.cli", recipe, data, f"model_name_or_path={tiny_model_dir}",
          "tokenizer_name_or_path=.demo/tiny-qwen2"], "tokenizer_name_or_path='.demo/tiny-qwen2' does not exist"),
        (["-m", "backends.mca.convert_cli", "hf2mca", "--input", "Qwen/Qwen2.5-7B-Instruct", "--output",
          "out", "--tp", "2"], hub_fix),
    ]
    for args, expected in cases:
        proc = _run(args, tmp_path, **online)
        shown = f"{' '.join(args[1:3])}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 2 and expected in proc.stderr, shown
        assert not any(text in proc.stderr for text in HUB_ERRORS), shown
        assert proc.stderr.count(expected) == 1, shown  # said once (roll-convert: not once per rank)
    assert os.listdir(tmp_path) == [], "a refused command wrote nothing"
