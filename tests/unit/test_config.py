"""Recipe parsing, precedence, type coercion and validation errors (no model or data is loaded)."""

from __future__ import annotations

import logging
import os

import pytest
import yaml

from roll.config import ParallelLayout, parse_args
from roll.config.parser import load_recipe, split_command_line
from roll.errors import ConfigError, ModelError
from tests.helpers import roll_train


def test_precedence_defaults_recipe_command_line(recipe):
    path = recipe(learning_rate=1.0e-4, cutoff_len=256, stage="sft")
    _, config = parse_args([path, "learning_rate=3e-5", "--stage", "pt"])
    assert config.training.learning_rate == 3e-5  # command line beats recipe ('3e-5' is a YAML string: coerced)
    assert config.finetuning.stage == "pt"
    assert config.data.cutoff_len == 256  # recipe beats default
    assert config.training.per_device_train_batch_size == 8  # HF default kept
    assert config.explicit_keys == {"learning_rate", "cutoff_len", "stage"}


def test_bool_flags_and_dashes(recipe):
    _, config = parse_args([recipe(stage="sft"), "--use-mca", "--packing", "--bf16", "false"])
    assert config.training.use_mca is True and config.data.packing is True and config.training.bf16 is False
    assert config.backend_name == "mca"
    # every spelling the value coercion accepts is also taken as the flag's value, not as a recipe path
    for word, expected in (("off", False), ("on", True), ("no", False), ("1", True)):
        _, config = parse_args([recipe(stage="sft"), "--packing", word])
        assert config.data.packing is expected, word


def test_yaml_booleans_for_text_keys(recipe):
    _, config = parse_args([recipe(stage="sft"), "save_strategy=no"])
    assert config.training.save_strategy == "no"  # not the string 'False'
    with pytest.raises(ConfigError, match='quotes'):
        parse_args([recipe(save_strategy=False)])  # `save_strategy: no` unquoted in a recipe


def test_optional_and_literal_values(recipe):
    _, config = parse_args([recipe(recompute_granularity="full"), "virtual_pipeline_model_parallel_size=null",
                            "report_to=none", "--use-mca"])
    assert config.megatron.recompute_granularity == "full"
    # Megatron needs a method and a layer count with full recompute: every layer, unless the recipe says otherwise
    assert (config.megatron.recompute_method, config.megatron.recompute_num_layers) == ("uniform", 1)
    assert config.megatron.virtual_pipeline_model_parallel_size is None
    assert config.training.report_to == "none"  # a str-typed field keeps 'none' as text


@pytest.mark.parametrize("argv, fragments", [
    (["learnin_rate=1"], ["'learnin_rate'", "did you mean 'learning_rate'", "command line"]),
    (["--tensor-model-parallel-sise", "2"], ["tensor_model_parallel_sise", "tensor_model_parallel_size"]),
    (["stage=sfx"], ["'stage'", "'sfx'", "pt, sft, dpo, kto", "did you mean 'sft'"]),
    (["learning_rate=fast"], ["'learning_rate'", "'fast'", "number"]),
    (["cutoff_len=1.5"], ["'cutoff_len'", "integer"]),
    (["packing=maybe"], ["'packing'", "true or false"]),
    (["cutoff_len=1"], ["cutoff_len must be at least 2"]),
    (["bf16=true", "fp16=true"], ["bf16 and fp16"]),
    (["lora_rank=0"], ["lora_rank"]),
    (["--use-mca", "tensor_model_parallel_size=0"], ["tensor_model_parallel_size must be >= 1"]),
    (["make_vocab_size_divisible_by=0"], ["make_vocab_size_divisible_by must be >= 1"]),
    (["overlap_param_gather=true"], ["overlap_param_gather=true needs use_distributed_optimizer=true"]),
    (["recompute_method=block"], ["recompute_method only apply with recompute_granularity: full"]),
    (["recompute_granularity=selective", "recompute_num_layers=2"], ["recompute_num_layers only applies"]),
    (["stage=dpo", "packing=true"], ["packing is not supported for stage dpo"]),
    (["stage=pt", "packing=true", "packing_algorithm=llamafactory"], ["LLaMA-Factory's pt packing", "packing: false"]),
    (["packing_algorithm=greedy"], ["'packing_algorithm'", "llamafactory"]),
    (["stage=dpo", "pref_ftx=-0.1"], ["pref_ftx must be a finite number >= 0, got -0.1"]),
    (["pref_ftx=0.5"], ["pref_ftx=0.5 only applies to stage: dpo", "stage sft"]),
    (["use_rslora=true"], ["use_rslora only applies to finetuning_type: lora", "finetuning_type is full"]),
    (["moe_aux_loss_coef=0.01", "moe_aux_loss_coeff=0.02"], ["moe_aux_loss_coef=0.01 and moe_aux_loss_coeff=0.02",
                                                            "give one of them"]),
    (["moe_aux_loss_coef=-1"], ["moe_aux_loss_coeff must be a finite number >= 0, got -1.0"]),
    (["moe_z_loss_coeff=-0.1"], ["moe_z_loss_coeff must be a finite number >= 0, got -0.1"]),
    (["moe_expert_capacity_factor=1.25"], ["moe_expert_capacity_factor=1.25", "drop-less"]),
    (["--use-mca", "moe_expert_capacity_factor=1.25"], ["moe_expert_capacity_factor=1.25", "mca backend",
                                                        "drop-less"]),
    (["deepspeed=/no/such/ds.json"], ["/no/such/ds.json", "does not exist"]),
    (["--use-mca", "finetuning_type=freeze"], ["freeze", "mca backend"]),
    (["--max_steps"], ["--max_steps", "needs a value"]),
    (["--use-mca", "lr_scheduler_type=reduce_lr_on_plateau"], ["'reduce_lr_on_plateau'", "mca backend",
                                                               "constant_with_warmup", "warmup_stable_decay"]),
    (["--use-mca", "lr_scheduler_type=cosine_with_min_lr"], ["lr_scheduler_kwargs", "min_lr_rate"]),
    (["--use-mca", "save_strategy=best"], ["save_strategy 'best'", "steps, epoch or no"]),
    (["--use-mca", "nproc_per_node=2", "pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2"],
     ["gradient_accumulation_steps(1) must be a multiple of pipeline_model_parallel_size(2)",
      "Nearest valid gradient_accumulation_steps: 2 "]),
    (["--use-mca", "nproc_per_node=2", "pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2",
      "gradient_accumulation_steps=3"], ["remainder", "Nearest valid gradient_accumulation_steps: 2 or 4 "]),
])
def test_bad_values_name_the_key(recipe, argv, fragments):
    with pytest.raises(ConfigError) as info:
        parse_args([recipe(stage="sft"), *argv])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_unknown_recipe_key_names_file_and_closest(recipe):
    path = recipe(learning_rat=1.0e-5)
    with pytest.raises(ConfigError) as info:
        parse_args([path])
    message = str(info.value)
    assert "'learning_rat'" in message and "'learning_rate'" in message and path in message


def test_invalid_deepspeed_json(tmp_path, recipe):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_args([recipe(deepspeed=str(bad))])


def test_recipe_must_be_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_recipe(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(str(tmp_path / "missing.yaml"))


def test_split_command_line_switches():
    options, overrides = split_command_line(["r.yaml", "--print-config", "--dry-run", "--json", "a=1", "--b", "2"])
    assert options.recipe == "r.yaml" and options.print_config and options.dry_run and options.json
    assert overrides == {"a": "1", "b": "2"}
    with pytest.raises(ConfigError, match="two recipe files"):
        split_command_line(["a.yaml", "b.yaml"])


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(world_size=6, tp=2, pp=2), "tp(2) * pp(2) * cp(1) * dp(?) != world_size(6)"),
    (dict(world_size=8, tp=2, ep=8), "etp(2) * ep(8) = 16 does not divide tp(2) * cp(1) * dp(4) = 8"),
    (dict(world_size=4, vpp=2), "needs pipeline_model_parallel_size > 1"),
])
def test_layout_errors_show_the_product(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        ParallelLayout(**kwargs)
    assert fragment in str(info.value)


def test_layout_derives_dp_and_checks_layers():
    layout = ParallelLayout(world_size=8, tp=2, pp=2, vpp=2, ep=2)
    assert layout.dp == 2 and layout.expert_tp == 2
    layout.check_num_layers(8)
    with pytest.raises(ConfigError, match=r"num_layers\(6\) is not divisible by pp\(2\) \* vpp\(2\) = 4"):
        layout.check_num_layers(6)


def test_layout_applies_the_sequence_parallel_rule():
    assert ParallelLayout(world_size=4, tp=2, ep=2).sequence_parallel is True  # forced on: TP>1 and EP>1
    assert ParallelLayout(world_size=2, tp=2, sequence_parallel=True).sequence_parallel is True
    assert ParallelLayout(world_size=2, tp=2).sequence_parallel is False
    assert ParallelLayout(world_size=2, ep=2, sequence_parallel=True).sequence_parallel is False  # TP1: off
    assert ParallelLayout(world_size=2, sequence_parallel=True) == ParallelLayout(world_size=2)


def test_megatron_arguments_check_choices_set_in_code():
    from roll.config import MegatronArguments

    with pytest.raises(ConfigError, match="moe_token_dispatcher_type must be one of allgather, alltoall; got 'a2a'"):
        MegatronArguments(moe_token_dispatcher_type="a2a")
    with pytest.raises(ConfigError, match="recompute_granularity must be one of full, selective; got 'all'"):
        MegatronArguments(recompute_granularity="all")
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size must be >= 1"):
        MegatronArguments(virtual_pipeline_model_parallel_size=0)
    args = MegatronArguments(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    layout = args.build_layout(world_size=4)
    assert layout.sequence_parallel and args.sequence_parallel  # written back: model config and policy agree


def test_mca_cross_field_rules(recipe, tiny_model_dir):
    # SP is forced on with TP>1 and EP>1; the layer count comes from the local model's config.json.
    _, config = parse_args([recipe(model_name_or_path=tiny_model_dir), "--use-mca", "nproc_per_node=4",
                            "tensor_model_parallel_size=2", "expert_model_parallel_size=2"])
    assert config.megatron.sequence_parallel is True and config.layout.sequence_parallel is True
    assert config.layout.dp == 2 and (config.layout.tp, config.layout.ep) == (2, 2)
    # ... and turned off at TP1 (Megatron refuses it there), in the group and the layout alike.
    _, config = parse_args([recipe(model_name_or_path=tiny_model_dir), "--use-mca", "sequence_parallel=true"])
    assert config.megatron.sequence_parallel is False and config.layout.sequence_parallel is False
    with pytest.raises(ConfigError, match=r"num_layers\(2\) is not divisible by pp\(2\) \* vpp\(2\)"):
        parse_args([recipe(model_name_or_path=tiny_model_dir), "--use-mca", "nproc_per_node=2",
                    "pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2"])


def test_moe_model_at_tp2_gets_sequence_parallel(recipe, tiny_model_factory, roll_warnings):
    # Megatron-Core's MoE layer raises at its first training forward under TP>1 without SP (a traceback per
    # rank): the layout turns SP on for a model with experts, whatever each family calls them, and says why
    roll_warnings.set_level(logging.INFO, logger="roll")
    for kind in ("mixtral", "deepseek_v3"):  # num_local_experts, n_routed_experts
        _, config = parse_args([recipe(model_name_or_path=tiny_model_factory(kind)), "--use-mca",
                                "nproc_per_node=2", "tensor_model_parallel_size=2"])
        assert config.megatron.sequence_parallel is True and config.layout.sequence_parallel is True
    assert "sequence_parallel turned on: Megatron-Core requires it with TP>1 and an MoE model" in roll_warnings.text
    assert ParallelLayout(world_size=2, tp=2, moe=True).sequence_parallel is True
    assert ParallelLayout(world_size=2, moe=True).sequence_parallel is False  # TP1: off


def test_unreadable_model_config_is_a_model_error(recipe, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"config\.json \(model_name_or_path\) is not valid JSON"):
        parse_args([recipe(model_name_or_path=str(tmp_path)), "--use-mca"])


def test_standard_backend_ignores_mca_knobs_with_warning(recipe, roll_warnings):
    _, config = parse_args([recipe(tensor_model_parallel_size=2, sequence_parallel=True)])
    assert config.layout is None
    expected = "ignoring Megatron-only settings tensor_model_parallel_size=2, sequence_parallel=True"
    assert expected in roll_warnings.text


def test_moe_aux_loss_coefficient_in_either_spelling_applies_on_both_backends(recipe, roll_warnings):
    """LLaMA-Factory's moe_aux_loss_coef is moe_aux_loss_coeff; the standard backend honours it (no warning)."""
    for argv in ([], ["--use-mca"]):
        _, config = parse_args([recipe(moe_aux_loss_coef=0.05), *argv])
        assert (config.megatron.moe_aux_loss_coeff, config.megatron.moe_aux_loss_coef) == (0.05, None)
    assert "moe_aux_loss" not in roll_warnings.text
    _, config = parse_args([recipe(moe_z_loss_coeff=0.01)])  # the router z-loss: both backends too
    assert config.megatron.moe_z_loss_coeff == 0.01 and "moe_z_loss" not in roll_warnings.text


SHIPPED = ("qwen_sft", "qwen_pt", "qwen_dpo", "qwen_kto", "qwen_lora_sft", "qwen3_moe_sft", "llama3_sft",
           "qwen_rm", "qwen2_5_vl_sft")
DEMO = ("quick_sft", "tiny_pt", "tiny_sft", "tiny_dpo", "tiny_kto", "tiny_lora", "tiny_rm")


def test_every_shipped_recipe_parses(monkeypatch):
    """Each recipe resolves on both backends at its own nproc_per_node * nnodes (a model dir that does not
    exist yet still parses), names the hardware it was sized for, and every repo file it names exists."""
    import glob

    from roll.launch import needs_launch

    for var in ("WORLD_SIZE", "LOCAL_RANK", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    recipes = sorted(glob.glob("recipes/**/*.yaml", recursive=True))
    for name in SHIPPED:
        assert f"recipes/{name}.yaml" in recipes
    for name in DEMO:
        assert f"recipes/demo/{name}.yaml" in recipes
    from backends.mca.backend import McaBackend
    from roll.data.vision import is_vl_model

    for path in recipes:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        raw = yaml.safe_load(text)
        assert ("x H100" in text) or ("CPU" in text), f"{path} does not say what hardware it was sized for"
        _, config = parse_args([path])
        t = config.training
        assert t.nproc_per_node == raw.get("nproc_per_node", 1) and t.nnodes == raw.get("nnodes", 1), path
        assert config.finetuning.stage in McaBackend.supported_stages, path
        assert config.finetuning.finetuning_type in McaBackend.supported_finetuning_types, path
        assert needs_launch(config) == (t.nproc_per_node * t.nnodes > 1), path
        for key in ("deepspeed", "dataset", "eval_dataset"):
            value = raw.get(key)
            if isinstance(value, str) and value.startswith("recipes/"):
                assert os.path.exists(value), f"{path}: {key} {value!r} is not in the repo"
        if is_vl_model(config.model.model_name_or_path):  # the mca backend refuses VL models for now (docs/vl.md)
            continue
        _, mca = parse_args([path, "--use-mca"])
        assert mca.layout.world_size == t.nproc_per_node * t.nnodes, path
        proc = roll_train(path, "--use-mca", "--print-config", timeout=120) if path == "recipes/qwen3_moe_sft.yaml" else None
        if proc is not None:  # the real entry point too, once (each call costs an interpreter start)
            assert proc.returncode == 0, proc.stderr
            assert yaml.safe_load(proc.stdout)["megatron"]["expert_model_parallel_size"] == 8


def test_interleaved_pipeline_micro_batch_rule():
    """Megatron's interleaved schedule: M micro-batches in groups of pp, no remainder (M a multiple of pp)."""
    layout = ParallelLayout(world_size=4, pp=2, vpp=2)
    assert [layout.micro_batches_at_least(m) for m in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    layout.check_micro_batches(4)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps\(5\).*Nearest valid "
                                          r"gradient_accumulation_steps: 4 or 6 "):
        layout.check_micro_batches(5)
    plain = ParallelLayout(world_size=4, pp=2)  # 1F1B without VPP runs any count
    assert plain.micro_batches_at_least(3) == 3
    plain.check_micro_batches(3)
