"""roll-parity's pure pieces on literal logs, its command line, and its exit codes (no training here:
tests/distributed/test_parity_tool.py runs it for real)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from roll.parity import cli as parity
from roll.parity.cli import parse_command_line
from roll.parity.report import compare, compare_evals, format_table, format_verdict, parse_log, to_json
from roll.parity.sweep import Pair, Verdict
from tests.helpers import run

STANDARD = {1: 6.28150845, 2: 5.99004555, 3: 5.89215565}


def test_within_tolerance_passes_and_the_table_shows_every_step():
    mca = {1: 6.28150857, 2: 5.99004579, 3: 5.89215542}
    result = compare(STANDARD, mca, steps=3)
    assert result.passed and result.failures() == []
    assert result.worst.step == 2 and result.max_rel_diff == pytest.approx(4.0e-8, rel=0.05)
    assert format_table(result).splitlines() == [
        "step |  standard loss |       mca loss | rel diff",
        "-----+----------------+----------------+----------",
        "   1 |     6.28150845 |     6.28150857 | 1.91e-08",
        "   2 |     5.99004555 |     5.99004579 | 4.01e-08",
        "   3 |     5.89215565 |     5.89215542 | 3.90e-08",
    ]
    assert format_verdict(result).splitlines() == [
        "max rel diff: 4.01e-08 (step 2)",
        "PASS: step 1 within 1e-06, every step within 0.0001",
    ]


def test_beyond_tolerance_fails_and_names_the_step():
    mca = {1: 6.28150845, 2: 5.99004555, 3: 5.89215565 * (1 + 2e-4)}
    result = compare(STANDARD, mca, steps=3)
    assert not result.passed
    assert result.failures() == ["step 3 rel diff 2.00e-04 > 0.0001"]
    assert format_table(result).splitlines()[-1].endswith("| 2.00e-04  (over 0.0001)")
    verdict = format_verdict(result)
    assert "max rel diff: 2.00e-04 (step 3)" in verdict
    assert verdict.splitlines()[-1] == ("FAIL (step 1 within 1e-06, every step within 0.0001): "
                                        "step 3 rel diff 2.00e-04 > 0.0001")


def test_the_first_step_is_held_to_the_tighter_tolerance():
    mca = {**STANDARD, 1: STANDARD[1] * (1 + 5e-6)}  # within 1e-4, beyond 1e-6
    assert compare(STANDARD, mca).failures() == ["step 1 rel diff 5.00e-06 > 1e-06"]
    assert compare(STANDARD, mca, first_step_tolerance=1e-5).passed


def test_a_missing_step_fails():
    result = compare(STANDARD, {1: STANDARD[1], 3: STANDARD[3]}, steps=4)
    assert not result.passed
    assert result.failures() == ["step 2 missing from the mca log", "step 4 missing from the standard and mca log"]
    rows = format_table(result).splitlines()
    assert rows[3] == "   2 |     5.99004555 |              - | -  (missing)"
    assert result.max_rel_diff == 0.0  # over the steps both logs have
    assert "no training step was logged" in format_verdict(compare({}, {}))


def test_a_nan_loss_fails_and_json_stays_strict():
    result = compare(STANDARD, {**STANDARD, 2: float("nan")})
    assert result.failures() == ["step 2 rel diff inf > 0.0001"]
    runs = (parity.Run("standard", "1 process", "r.yaml", {}), parity.Run("mca", "1 process", "r.yaml", {}))
    verdict = Verdict("", "", result, compare_evals({}, {}, 1e-4), None, 0.0, result.failures())
    payload = to_json([verdict], [Pair(*runs, "model", (1, 2, 3))])
    assert payload["passed"] is False and payload["failures"] == ["step 2 rel diff inf > 0.0001"]
    assert payload["losses"]["mca"][1] == "nan" and payload["rel_diff"][1] == "inf"
    json.loads(json.dumps(payload, allow_nan=False))


def test_parse_log_keeps_training_records():
    lines = [
        '{"step": 1, "loss": 6.5, "learning_rate": 0.001, "grad_norm": 3.0}\n',
        "\n",
        '{"step": 2, "loss": 6.0}\n',
        '{"step": 2, "eval_loss": 5.9}\n',
        '{"step": 2, "train_runtime": 3.2, "train_loss": 6.25}\n',
    ]
    assert parse_log(lines) == {1: 6.5, 2: 6.0}


def test_command_line_separates_parity_options_from_overrides():
    options = parse_command_line(["r.yaml", "--steps", "3", "--first-step-tolerance=1e-5", "--json",
                                  "learning_rate=1e-3", "--tensor-model-parallel-size", "2", "output_dir=/tmp/x"])
    assert (options.recipe, options.steps, options.first_step_tolerance, options.tolerance) == ("r.yaml", 3, 1e-5, 1e-4)
    assert options.json and options.output_dir == "/tmp/x"
    assert options.overrides == {"learning_rate": "1e-3", "tensor_model_parallel_size": "2"}


def test_the_standard_run_accumulates_over_the_mca_data_parallel_ranks(tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\nuse_mca: true\n"
                      "deepspeed: recipes/deepspeed/ds_z2.json\ngradient_accumulation_steps: 3\n")
    options = parse_command_line([str(recipe), "--steps", "4", "nproc_per_node=2"])
    std, mca, config = parity.resolve_runs(options, str(tmp_path / "out"))
    assert config.layout.dp == 2 and config.training.max_steps == 4 and config.training.logging_steps == 1
    assert mca.args[:2] == [str(recipe), "--use-mca"] and "nproc_per_node=2" in mca.args
    assert mca.output_dir == str(tmp_path / "out" / "mca")
    for arg in ("nproc_per_node=1", "gradient_accumulation_steps=6", "use_mca=false", "deepspeed=null",
                "max_steps=4", "save_strategy=no"):
        assert arg in std.args, (arg, std.args)
    assert std.description == "1 process, no DeepSpeed, gradient_accumulation_steps 6 (= 3 x dp 2)"


def test_save_models_exports_both_models_and_needs_an_output_dir(tiny_model_dir, tmp_path):
    with pytest.raises(parity.ConfigError, match="--save-models' needs --output-dir"):
        parse_command_line(["r.yaml", "--save-models"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\n")
    options = parse_command_line([str(recipe), "--steps", "2", "--save-models", "--output-dir", str(tmp_path)])
    std, mca, _ = parity.resolve_runs(options, str(tmp_path))
    assert "save_hf_model=true" in std.args and "save_hf_model=true" in mca.args
    options = parse_command_line([str(recipe), "--steps", "2"])
    std, mca, _ = parity.resolve_runs(options, str(tmp_path))
    assert "save_hf_model=false" in std.args and "save_hf_model=false" in mca.args


@pytest.mark.parametrize("content, argv, expected", [
    ("learnin_rate: 1.0e-3\n", [], "unknown key 'learnin_rate' (did you mean 'learning_rate'?)"),
    ("stage: sft\n", ["learnin_rate=1"], "unknown key 'learnin_rate' (did you mean 'learning_rate'?) in the command"),
    ("stage: sft\n", ["max_steps=3"], "'max_steps' is set by roll-parity on both runs (use --steps N)"),
    ("stage: sft\n", ["--steps", "0"], "'--steps' must be > 0"),
    ("stage: sft\n", ["--dry-run"], "'--dry-run' is a roll-train switch"),
    ("stage: sft\n", ["nproc_per_node=3", "tensor_model_parallel_size=2"], "dp(?) != world_size(3)"),
])
def test_user_mistakes_exit_2_without_traceback(tmp_path, content, argv, expected):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content)
    out, err = [], []
    assert parity.main([str(recipe), *argv], out=out.append, err=err.append) == 2
    assert out == [] and len(err) == 1 and err[0].startswith("roll-parity: error: "), err
    assert expected in err[0]


def test_console_script_bad_key_exits_2_naming_the_closest_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("stage: sft\nlearnin_rate: 1.0e-3\n")
    script = os.path.join(os.path.dirname(sys.executable), "roll-parity")
    proc = run([script, str(recipe), "--steps", "2"], timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "did you mean 'learning_rate'?" in proc.stderr and "Traceback" not in proc.stderr
    assert run([script, "--help"], timeout=60).stdout.startswith("usage: roll-parity RECIPE.yaml")


def test_a_failed_run_exits_1_with_its_command_and_the_end_of_its_log(tiny_model_dir, tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\n")
    calls = []

    def fake_training(run_, log_path):
        calls.append(run_.backend)
        with open(log_path, "w") as fh:
            fh.write("".join(f"line {i}\n" for i in range(100)) + "progress 1/3\rprogress 2/3\n")
        return 0 if run_.backend == "standard" else 1

    monkeypatch.setattr(parity, "run_training", fake_training)
    out, err = [], []
    code = parity.main([str(recipe), "--output-dir", str(tmp_path / "o"), "--json"], out=out.append, err=err.append)
    assert code == 1 and calls == ["standard", "mca"]
    message = "".join(err)
    assert "the mca run failed (exit 1): roll-train " + str(recipe) + " --use-mca" in message
    assert "line 71\n" in message and "line 70\n" not in message and "progress 2/3\n" in message
    assert json.loads(out[0])["passed"] is False and os.path.isfile(tmp_path / "o" / "mca.log")
