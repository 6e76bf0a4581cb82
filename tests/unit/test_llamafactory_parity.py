"""scripts/llamafactory_parity.py's pure pieces on synthetic logs: LLaMA-Factory's trainer_log.jsonl and roll's
train_log.jsonl parsed, compared, tabled and judged; the configs each side gets; the exit without
LLaMA-Factory; the worker protocol of scripts/compare_llamafactory_*.py. Nothing here runs LLaMA-Factory (not
installed in CI); docs/llamafactory-parity.md has a real run.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from roll.errors import ConfigError
from roll.parity import llamafactory as lfp
from roll.parity.report import parse_log

# Written as LLaMA-Factory 0.9.5 writes them (llamafactory/train/callbacks.py LogCallback): a closing record
# without a loss, and fields roll does not have.
LF_LINES = [
    '{"current_steps": 1, "total_steps": 3, "loss": 12.44967461, "lr": 0.001, "epoch": 0.04, "percentage": 33.33, '
    '"elapsed_time": "0:00:00", "remaining_time": "0:00:00"}',
    '{"current_steps": 2, "total_steps": 3, "loss": 11.41887379, "lr": 0.001, "epoch": 0.08, "percentage": 66.67}',
    '{"current_steps": 3, "total_steps": 3, "loss": 10.8318119, "lr": 0.001, "epoch": 0.12, "percentage": 100.0}',
    '{"current_steps": 3, "total_steps": 3, "epoch": 0.12, "percentage": 100.0, "elapsed_time": "0:00:01"}',
]


def roll_lines(losses: dict[int, float]) -> list[str]:
    """roll's train_log.jsonl: one record per step and the closing summary (which has no loss)."""
    lines = [json.dumps({"step": s, "loss": v, "grad_norm": 1.0, "learning_rate": 0.001}) for s, v in losses.items()]
    return lines + [json.dumps({"step": max(losses), "train_runtime": 0.1, "train_loss": 11.0})]


def test_parse_llamafactory_log_keeps_the_losses_by_step():
    assert lfp.parse_llamafactory_log(LF_LINES) == {1: 12.44967461, 2: 11.41887379, 3: 10.8318119}
    again = '{"current_steps": 2, "loss": 9.5}'  # a step logged twice: the last wins, as in roll's parser
    assert lfp.parse_llamafactory_log([*LF_LINES, again, ""])[2] == 9.5


def test_equal_logs_pass_and_the_table_names_both_sides():
    reference = lfp.parse_llamafactory_log(LF_LINES)
    near = {s: v * (1 + 3e-6) for s, v in reference.items()}  # 3e-6: within both bars
    comparisons = lfp.compare_sides(reference, {"standard": parse_log(roll_lines(near)),
                                                "mca": parse_log(roll_lines(near))}, steps=3)
    text = lfp.format_report(comparisons)
    assert all(c.passed for c in comparisons.values())
    assert text.splitlines()[:3] == [
        "-- LLaMA-Factory vs roll standard --",
        "step | LLaMA-Factory loss | roll standard loss | rel diff",
        "-----+--------------------+--------------------+----------"]
    assert "   1 |        12.44967461 |        12.44971196 | 3.00e-06" in text
    assert text.splitlines()[-1] == "PASS: roll standard and roll mca train as LLaMA-Factory does"


def test_a_step_one_gap_over_1e_5_and_a_missing_step_fail():
    reference = lfp.parse_llamafactory_log(LF_LINES)
    # issue 30's newline gap: roll drops the trained "\n" after <|im_end|>, 1.48e-3 at step 1 (measured)
    standard = {1: 12.46804772, 2: 11.41887379, 3: 10.8318119}
    mca = {1: reference[1] * (1 + 2e-5), 2: reference[2]}  # over the step-1 bar (1e-5), under 1e-4; step 3 lost
    comparisons = lfp.compare_sides(reference, {"standard": standard, "mca": mca}, steps=3)
    assert comparisons["standard"].failures() == ["step 1 rel diff 1.48e-03 > 1e-05"]
    assert comparisons["mca"].failures() == ["step 1 rel diff 2.00e-05 > 1e-05",
                                             "step 3 missing from the roll mca log"]
    text = lfp.format_report(comparisons)
    assert "   1 |        12.44967461 |        12.46804772 | 1.48e-03  (over 1e-05)" in text
    assert text.splitlines()[-1] == "FAIL: roll standard, roll mca beyond tolerance"
    loose = lfp.compare_sides(reference, {"standard": standard}, steps=3, tolerance=1e-2, first_step_tolerance=1e-2)
    assert loose["standard"].passed


def test_llamafactory_config_registers_the_data_file_and_sets_the_tool_keys(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a b c"}\n')
    options = lfp.Options(recipe="r.yaml", steps=3, sequential=True, overrides={"learning_rate": "1.0e-3"},
                          llamafactory_keys={"default_system": "You are a helpful assistant."})
    recipe = {"stage": "pt", "dataset": str(data), "shuffle": True, "cutoff_len": 64}
    config = lfp.llamafactory_config(recipe, options, str(tmp_path / "lf"), str(tmp_path / "data"))
    info = json.loads((tmp_path / "data" / "dataset_info.json").read_text())
    assert info == {"roll_dataset": {"file_name": str(data), "columns": {"prompt": "text"}}}
    assert config["dataset"] == "roll_dataset" and config["dataset_dir"] == str(tmp_path / "data")
    assert "shuffle" not in config and config["disable_shuffling"] is True
    assert config["learning_rate"] == 1.0e-3 and config["default_system"] == "You are a helpful assistant."
    assert {k: config[k] for k in ("max_steps", "logging_steps", "save_strategy", "do_train", "output_dir")} == {
        "max_steps": 3, "logging_steps": 1, "save_strategy": "no", "do_train": True, "output_dir": str(tmp_path / "lf")}
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}]))
    sft = lfp.llamafactory_config({"stage": "sft", "dataset": str(chat)}, options, "o", str(tmp_path / "d2"))
    entry = json.loads((tmp_path / "d2" / "dataset_info.json").read_text())[sft["dataset"]]
    assert entry["formatting"] == "sharegpt" and entry["tags"]["role_tag"] == "role"


def test_command_line_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"stage": "sft"}))
    options = lfp.parse_command_line([str(recipe), "cutoff_len=32", "--steps", "4", "--sequential",
                                      "--lf", "default_system=x", "--roll", "packing=false"])
    assert (options.steps, options.overrides, options.llamafactory_keys, options.roll_keys) == (
        4, {"cutoff_len": "32"}, {"default_system": "x"}, {"packing": "false"})
    keys = lfp.roll_overrides(options, "out/standard")
    assert keys["shuffle"] == "false" and keys["max_steps"] == "4" and keys["packing"] == "false"
    assert "default_system" not in keys and keys["output_dir"] == "out/standard"
    with pytest.raises(ConfigError, match="set by the tool"):
        lfp.parse_command_line([str(recipe), "max_steps=9"])
    with pytest.raises(ConfigError, match="no recipe"):
        lfp.parse_command_line([str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="standard and/or mca"):
        lfp.parse_command_line([str(recipe), "--backends", "megatron"])


def test_without_llamafactory_it_says_how_to_get_it_and_exits_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"stage": "sft"}))
    errors: list[str] = []
    code = lfp.main([str(recipe), "--llamafactory-cli", str(tmp_path / "no-such-cli")], out=errors.append,
                    err=errors.append)
    assert code == 2
    assert "bash scripts/llamafactory_venv.sh lf" in "".join(errors)


def test_a_case_by_name_runs_its_example_from_the_checkout_with_this_machines_values(tmp_path, monkeypatch):
    """--case NAME: the example's path in the LLaMA-Factory checkout, the machine overrides (the tiny model as
    an absolute path), the case's bars and sides; the command line's keys win; a missing checkout, model or
    case is named."""
    from roll.parity.llamafactory_cases import CASES

    checkout = tmp_path / "LLaMA-Factory"
    (checkout / "examples" / "train_lora").mkdir(parents=True)
    (checkout / "examples" / "train_lora" / "qwen3_lora_kto.yaml").write_text("stage: kto\n")
    model = tmp_path / "roll" / ".demo" / "tiny-qwen2"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "roll")
    monkeypatch.delenv("LLAMAFACTORY_DIR", raising=False)
    options = lfp.parse_command_line(["--case", "lora_kto", "--llamafactory-dir", str(checkout), "cutoff_len=512",
                                      "--roll", "seed=3"])
    assert options.recipe == str(checkout / "examples" / "train_lora" / "qwen3_lora_kto.yaml")
    assert options.overrides == {"model_name_or_path": str(model), "bf16": "false", "preprocessing_num_workers": "1",
                                 "dataloader_num_workers": "0", "cutoff_len": "512"}
    assert (options.steps, options.tolerance, options.first_step_tolerance, options.backends) == (
        3, 1e-3, 1e-3, ("standard", "mca"))
    assert options.roll_keys == {"seed": "3"} and options.llamafactory_dir == str(checkout)
    assert CASES["packed_sft"].roll == ("packing_algorithm=llamafactory",)
    with pytest.raises(ConfigError, match="give --llamafactory-dir"):
        lfp.parse_command_line(["--case", "lora_kto"])
    with pytest.raises(ConfigError, match="no case 'kto'; the cases: full_sft, lora_sft"):
        lfp.parse_command_line(["--case", "kto", "--llamafactory-dir", str(checkout)])
    (checkout / "examples" / "megatron").mkdir()
    (checkout / "examples" / "megatron" / "qwen3_moe_full.yaml").write_text("stage: sft\n")
    with pytest.raises(ConfigError, match="--kind qwen3_moe --num-layers 4"):
        lfp.parse_command_line(["--case", "megatron_qwen3_moe", "--llamafactory-dir", str(checkout)])
    text: list[str] = []
    assert lfp.main(["--list-cases"], out=text.append) == 0
    assert [line.split()[0] for line in "".join(text).splitlines()] == list(CASES)


def test_the_report_holds_roll_standard_against_roll_mca_at_the_examples_bar():
    reference = lfp.parse_llamafactory_log(LF_LINES)
    mca = {s: v * (1 + 2e-3) for s, v in reference.items()}  # 2e-3: over the backends' 1e-3
    comparisons = lfp.compare_sides(reference, {"standard": reference, "mca": mca}, steps=3, tolerance=1e-2,
                                    first_step_tolerance=1e-2)
    between = lfp.compare(reference, mca, steps=3, tolerance=lfp.BACKENDS_TOLERANCE,
                          first_step_tolerance=lfp.BACKENDS_TOLERANCE, names=("roll standard", "roll mca"))
    text = lfp.format_report(comparisons, between)
    assert "-- roll standard vs roll mca --\nstep | roll standard loss |      roll mca loss | rel diff" in text
    assert "   1 |        12.44967461 |        12.47457396 | 2.00e-03  (over 0.001)" in text


def test_a_comparison_scripts_worker_reads_its_spec_without_rolls_pythonpath(tmp_path, monkeypatch):
    """roll.parity.llamafactory_worker (scripts/compare_llamafactory_*.py): this interpreter stands in for
    LLaMA-Factory's; the worker gets the spec with its output paths, none of roll's PYTHONPATH, and a failure
    comes back with the worker's stderr."""
    from roll.parity.llamafactory_worker import WorkerFailed, missing_python, run_worker

    script = tmp_path / "compare.py"
    script.write_text(
        "import json, os, sys\n"
        "flag, path = sys.argv[1:]\n"
        "spec = json.load(open(path))\n"
        "if spec['fail']:\n"
        "    sys.exit('no such template')\n"
        "json.dump({'flag': flag, 'spec': spec, 'pythonpath': os.environ.get('PYTHONPATH')},"
        " open(spec['out_json'], 'w'))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "roll"))
    got = run_worker(sys.executable, str(script), {"fail": False, "template": "qwen"}, str(tmp_path))
    assert got == {"flag": "--lf-worker", "pythonpath": None, "spec": {
        "fail": False, "template": "qwen", "out": str(tmp_path / "out"), "out_json": str(tmp_path / "lf.json")}}
    with pytest.raises(WorkerFailed) as failed:
        run_worker(sys.executable, str(script), {"fail": True}, str(tmp_path))
    assert failed.value.code == 1 and failed.value.stderr == "no such template"
    assert missing_python(sys.executable) is None
    assert lfp.INSTALL in missing_python(str(tmp_path / "lf" / "bin" / "python"))
