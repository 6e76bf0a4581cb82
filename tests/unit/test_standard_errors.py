"""Bad input for the standard backend fails before training, with a message that says what to change."""

from __future__ import annotations

import glob
import json
import os

import pytest

from backends.standard.backend import StandardBackend
from backends.standard.ds_config import check_combination, load_deepspeed_config
from roll.config.parser import resolve
from roll.errors import ConfigError, ModelError
from tests.helpers import REPO


def _config(**recipe):
    base = dict(stage="sft", output_dir="/tmp/roll-unused", report_to="none")
    return resolve({**base, **recipe}, {}, None)


def _write_json(path, content) -> str:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_missing_model_path_is_a_model_error(tmp_path):
    backend = StandardBackend(_config(model_name_or_path=str(tmp_path / "nope")))
    with pytest.raises(ModelError, match="does not exist"):
        backend.load_models("sft", tokenizer=None)


def test_directory_without_config_is_a_model_error(tmp_path):
    backend = StandardBackend(_config(model_name_or_path=str(tmp_path)))
    with pytest.raises(ModelError, match="no config.json"):
        backend.load_models("sft", tokenizer=None)


def test_non_causal_model_is_a_model_error(tmp_path):
    from transformers import ViTConfig

    vit = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    vit.save_pretrained(tmp_path)
    backend = StandardBackend(_config(model_name_or_path=str(tmp_path)))
    with pytest.raises(ModelError, match="not a causal language model"):
        backend.load_models("sft", tokenizer=None)


def test_missing_or_invalid_deepspeed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_deepspeed_config(str(tmp_path / "ds.json"))
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_deepspeed_config(_write_json(tmp_path / "bad.json", "{stage: 3"))
    with pytest.raises(ConfigError, match="stage must be 0, 1, 2 or 3"):
        load_deepspeed_config({"zero_optimization": {"stage": 4}})


def test_recipe_with_missing_deepspeed_file_fails_at_parse_time(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _config(deepspeed=str(tmp_path / "missing.json"))


@pytest.mark.parametrize("ds,training,message", [
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}, {},
     "stage3_gather_16bit_weights_on_model_save"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, {}, "offload_param needs"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, {},
     "offload_optimizer needs"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, {},
     "both true"),
    ({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4},
     {"per_device_train_batch_size": 2}, "per_device_train_batch_size=2"),
    ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "two"}, {},
     "gradient_accumulation_steps must be a number"),
])
def test_deepspeed_combinations_that_cannot_work(tmp_path, ds, training, message):
    config = _config(deepspeed=_write_json(tmp_path / "ds.json", ds), **training)
    with pytest.raises(ConfigError, match=message):
        check_combination(load_deepspeed_config(config.training.deepspeed), config.training)
    with pytest.raises(ConfigError, match=message):  # and the backend runs the check before any model loads
        StandardBackend(config).setup_distributed()


def test_shipped_deepspeed_files_pass_the_checks():
    """Every JSON in recipes/deepspeed (the set docs/standard.md lists) passes, with its stage and offload."""
    expected = {"ds_z0": (0, False), "ds_z2": (2, False), "ds_z3": (3, False), "ds_z3_offload": (3, True)}
    shipped = glob.glob(os.path.join(REPO, "recipes", "deepspeed", "*.json"))
    assert {os.path.basename(path)[:-len(".json")] for path in shipped} == set(expected)
    for path in shipped:
        ds = load_deepspeed_config(path)
        check_combination(ds, _config().training)
        stage, offload = expected[os.path.basename(path)[:-len(".json")]]
        assert (ds.zero_stage, ds.offload_optimizer, ds.offload_param) == (stage, offload, offload), path


def test_lora_target_that_matches_nothing_lists_the_modules(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from backends.standard.models import resolve_lora_targets

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"qkv_proj matches no module.*q_proj"):
        resolve_lora_targets(model, ["qkv_proj", "v_proj"])
    with pytest.raises(ConfigError, match="output head"):
        resolve_lora_targets(model, ["lm_head"])


def test_freeze_more_layers_than_the_model_has(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from backends.standard.models import apply_freeze

    with pytest.raises(ConfigError, match="only 2 layers"):
        apply_freeze(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 3)


def test_resume_without_a_checkpoint(tmp_path):
    from roll.checkpoints import resolve_resume, rotate

    with pytest.raises(ConfigError, match="holds no checkpoint"):
        resolve_resume("True", str(tmp_path))
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        resolve_resume(str(tmp_path / "checkpoint-9"), str(tmp_path))
    for name in ("checkpoint-3", "checkpoint-12", "checkpoint-20.tmp"):  # .tmp: an unfinished save
        (tmp_path / name).mkdir()
    assert resolve_resume("true", str(tmp_path)).endswith("checkpoint-12")  # by step, not by name
    assert resolve_resume("on", str(tmp_path)).endswith("checkpoint-12")  # the recipe's boolean words
    assert resolve_resume(None, str(tmp_path)) is None
    assert resolve_resume("off", str(tmp_path)) is None
    assert rotate(str(tmp_path), 1) == [str(tmp_path / "checkpoint-3")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12", "checkpoint-20.tmp"]
