"""LLaMA-Factory recipes run unchanged: its keys are read under roll's names, accepted without effect (one info
line) or refused naming what to use (roll/config/llamafactory.py); recipes written in its style
(examples/llamafactory/, our own files) get through --print-config and --dry-run; its DeepSpeed configs (``auto``
values) are filled by HF as they are; USE_MCA=1 and the Megatron fusion flags mean what they mean there."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os

import pytest
import yaml

from roll.config import llamafactory as lf
from roll.config.parser import FIELDS, parse_args
from roll.errors import ConfigError
from tests.helpers import REPO

EXAMPLES = os.path.join(REPO, "examples", "llamafactory")


def test_the_table_holds_only_keys_roll_does_not_have():
    for key, found in lf.KEYS.items():
        assert not any(__import__("fnmatch").fnmatchcase(field, key) for field in FIELDS), key  # roll's own: no row
        if isinstance(found, lf.Renamed):
            assert found.target in FIELDS, key
        else:
            assert bool(found.use) == (found.only is not None), key  # a refusal always names what to use


def test_renamed_keys_take_roll_names(recipe):
    _, config = parse_args([recipe(mask_history=True, neat_packing=True, disable_shuffling=True, flash_attn="fa2",
                                   evaluation_strategy="no", enable_liger_kernel=False,
                                   per_gpu_train_batch_size=3)])
    data, training = config.data, config.training
    assert (data.train_on_last_turn_only, data.packing, data.shuffle) == (True, True, False)
    assert config.model.attn_implementation == "flash_attention_2"
    assert training.per_device_train_batch_size == 3
    assert parse_args([recipe(stage="dpo", dpo_label_smoothing=0.1)])[1].finetuning.pref_label_smoothing == 0.1
    assert "train_on_last_turn_only" in config.explicit_keys
    _, config = parse_args([recipe(neat_packing=False, flash_attn="auto"), "--mask_history", "flash_attn=sdpa"])
    assert (config.data.packing, config.data.train_on_last_turn_only) == (False, True)  # false sets nothing
    assert config.model.attn_implementation == "sdpa"  # the command line wins, as for roll's keys
    with pytest.raises(ConfigError, match="mask_history .* and train_on_last_turn_only are the same key"):
        parse_args([recipe(mask_history=True, train_on_last_turn_only=False)])
    with pytest.raises(ConfigError, match="flash_attn='fa9' is not one of LLaMA-Factory's values"):
        parse_args([recipe(flash_attn="fa9")])


def _refused_value(only: tuple):
    sample = only[0]
    if isinstance(sample, bool):
        return not sample
    if isinstance(sample, (int, float)):
        return 7
    return "something" if sample is None or sample == {} else sample + "_other"


REFUSING = sorted((key, found) for key, found in lf.KEYS.items() if isinstance(found, lf.Inert)
                  and found.only is not None and "*" not in key)


@pytest.mark.parametrize("key, found", REFUSING, ids=[key for key, _ in REFUSING])
def test_values_roll_cannot_train_are_refused_naming_the_alternative(recipe, key, found):
    parse_args([recipe(**{key: found.only[0]})])  # the feature off: accepted
    value = _refused_value(found.only)
    with pytest.raises(ConfigError) as raised:
        parse_args([recipe(**{key: value})])
    assert str(raised.value) == (f"{key}={value!r} (LLaMA-Factory's key, in recipe {recipe()}) is not available in "
                                 f"roll: {found.use}.")


@contextlib.contextmanager
def _records(name: str):
    """The records logger ``name`` emits at INFO and above, counted where they are emitted: caplog's count also
    depends on where pytest attached its handlers (to roll's non-propagating loggers once setup_logging ran in
    this process, so a test that also turned propagation on saw every line twice)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_inert_keys_say_so_once_in_an_info_line(recipe, monkeypatch):
    with _records("roll.config.llamafactory") as seen:
        parse_args([recipe(plot_loss=True, video_max_pixels=65536, hf_hub_token="hf_secret_value")])
    lines = [m for m in seen if "LLaMA-Factory's" in m]
    assert len(lines) == 3 and any("plot_loss has no effect in roll (roll always writes loss.png" in m for m in lines)
    assert not any("hf_secret_value" in m for m in seen)  # values are never printed (tokens)


def test_use_mca_environment_variable_is_llamafactorys_switch(recipe, monkeypatch):
    monkeypatch.setenv("USE_MCA", "1")
    assert parse_args([recipe()])[1].training.use_mca is True
    assert parse_args([recipe(use_mca=False)])[1].training.use_mca is False  # the recipe wins
    monkeypatch.setenv("USE_MCA", "0")
    assert parse_args([recipe()])[1].training.use_mca is False


def test_fusion_flags_reach_megatron_only_with_transformer_engine(roll_warnings, monkeypatch):
    pytest.importorskip("megatron.core", reason="the mca backend needs megatron-core")
    from backends.mca.models.config import _fusions, parallel_overrides
    from roll.config.megatron import MegatronArguments

    asked = MegatronArguments(bias_activation_fusion=True, apply_rope_fusion=True)
    assert _fusions(asked, "transformer_engine") == {"bias_activation_fusion": True, "apply_rope_fusion": True}
    assert _fusions(MegatronArguments(), "transformer_engine") == {}  # not asked: Megatron's defaults stay
    with _records("backends.mca.models.config") as seen:
        overrides = parallel_overrides(asked)  # this machine: no Transformer Engine, the local layers
        parallel_overrides(asked)
    assert overrides["transformer_impl"] == "local" and not set(overrides) & {"bias_activation_fusion",
                                                                               "apply_rope_fusion"}
    assert sum("bias_activation_fusion, apply_rope_fusion: no effect here" in m for m in seen) == 1


RECIPES = {"qwen3_full_sft": ("sft", 14), "qwen3_lora_sft": ("sft", 14), "qwen3_lora_pretrain": ("pt", 29),
           "qwen3_lora_dpo": ("dpo", 6), "qwen3_lora_kto": ("kto", 6), "qwen3_lora_reward": ("rm", 6)}


@pytest.fixture
def in_examples(monkeypatch, tmp_path):
    """Run from examples/llamafactory, as a LLaMA-Factory user runs from its checkout (dataset_dir: data)."""
    import datasets

    monkeypatch.chdir(EXAMPLES)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path


@pytest.mark.parametrize("name", list(RECIPES))
def test_llamafactory_recipes_print_config_and_dry_run(name, in_examples, tiny_model_dir, capsys):
    from roll.cli import main as roll_train

    stage, samples = RECIPES[name]
    # only what is this machine's: the model (theirs is a Hub id) and where to write
    args = [f"{name}.yaml", f"model_name_or_path={tiny_model_dir}", f"output_dir={in_examples / 'out'}"]
    assert roll_train([*args, "--print-config"]) == 0, capsys.readouterr().err
    printed = yaml.safe_load(capsys.readouterr().out)
    with open(f"{name}.yaml", encoding="utf-8") as fh:
        written = yaml.safe_load(fh)
    assert printed["finetuning"]["stage"] == stage and printed["data"]["dataset"] == written["dataset"]
    assert printed["training"]["warmup_steps"] == written["warmup_ratio"] == 0.1
    assert roll_train([*args, "--dry-run", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["num_samples"] == samples


def test_the_megatron_recipe_prints_its_layout(in_examples, capsys):
    from roll.cli import main as roll_train

    args = ["qwen3_moe_full_megatron.yaml", "--use-mca", "nproc_per_node=8", f"output_dir={in_examples / 'out'}",
            "--print-config"]
    assert roll_train(args) == 0, capsys.readouterr().err
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["layout"]["pp"], printed["layout"]["ep"], printed["layout"]["dp"]) == (4, 2, 2)
    assert printed["megatron"]["bias_activation_fusion"] and printed["megatron"]["apply_rope_fusion"]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "deepspeed", "*.json"))),
                         ids=os.path.basename)
def test_llamafactory_deepspeed_configs_are_filled_by_hf_as_they_are(path, in_examples):
    """LLaMA-Factory's ds_z{0,2,3}(_offload)_config.json shape: roll's checks accept them and HF Trainer fills
    every "auto" (batch sizes, clipping, precision, ZeRO-3 buckets) from the recipe."""
    import torch

    from backends.standard.ds_config import check_combination, load_deepspeed_config
    from backends.standard.hf_args import build_hf_args

    _, config = parse_args(["qwen3_lora_sft.yaml", f"deepspeed={path}", f"output_dir={in_examples / 'out'}",
                            "model_name_or_path=m", "bf16=false", "per_device_train_batch_size=2",
                            "gradient_accumulation_steps=3", "max_grad_norm=0.5"])
    ds = load_deepspeed_config(config.training.deepspeed)
    check_combination(ds, config.training)
    hf_args = build_hf_args(config, ds)
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"hidden_size": 64})()
    hf_args.hf_deepspeed_config.trainer_config_finalize(hf_args, model, num_training_steps=10)
    filled = hf_args.hf_deepspeed_config.config

    def autos(node, where=""):
        return [f"{where}{k}" for k, v in node.items() if v == "auto"] + [
            a for k, v in node.items() if isinstance(v, dict) for a in autos(v, f"{where}{k}.")]

    assert autos(filled) == []
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"],
            filled["gradient_clipping"], filled["bf16"]["enabled"]) == (2, 3, 0.5, False)
