"""scripts/side_by_side_llamafactory.py (roll against LLaMA-Factory, whole command to whole command): its pure
pieces on literal inputs, the roll recipe it writes validated by roll's own parser, and the skip without
LLaMA-Factory (the timings themselves are a benchmark, in docs/performance.md, not a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roll.bench import side_by_side as sbs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_both_tools_get_the_same_settings(tmp_path):
    settings = sbs.Settings(steps=7, batch_size=3, cutoff_len=128, learning_rate=2e-4)
    lf = sbs.llamafactory_config("m", str(tmp_path), "out", settings)
    roll = sbs.roll_recipe("m", "d.jsonl", "out", settings)
    shared = {"model_name_or_path": "m", "stage": "sft", "finetuning_type": "full", "cutoff_len": 128,
              "per_device_train_batch_size": 3, "gradient_accumulation_steps": 1, "learning_rate": 2e-4,
              "lr_scheduler_type": "constant", "max_steps": 7, "bf16": False, "save_strategy": "no",
              "output_dir": "out", "seed": 0}
    for config in (lf, roll):
        assert {key: config[key] for key in shared} == shared
    assert (lf["template"], lf["default_system"]) == (roll["template"], roll["default_system"]) == ("qwen",
                                                                                                 sbs.SYSTEM)


def test_the_roll_recipe_is_valid_for_both_backends(tmp_path):
    """Every key of the roll recipe is one roll-train knows, and the mca backend accepts it (a typo in a key,
    or one the mca backend refuses, fails here rather than in the benchmark's third minute)."""
    from roll.config.parser import parse_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(sbs.roll_recipe("m", "d.jsonl", str(tmp_path / "out"),
                                                                sbs.Settings())))
    for extra in ([], ["--use-mca"]):
        _, config = parse_args([str(recipe), *extra])
        assert config.training.max_steps == 12 and config.data.template == "qwen"


def test_rounds_rotate_and_ratios_are_llamafactory_over_roll():
    assert [sbs.round_order(i) for i in range(4)] == [
        ("llamafactory", "standard", "mca"), ("standard", "mca", "llamafactory"),
        ("mca", "llamafactory", "standard"), ("llamafactory", "standard", "mca")]
    walls = {("llamafactory", 0): 30.0, ("standard", 0): 30.0, ("mca", 0): 25.0,
             ("llamafactory", 1): 40.0, ("standard", 1): 50.0, ("mca", 1): 40.0}
    results = [sbs.RunResult(tool, i, "ok", wall_s=wall, first_step_s=10.0, last_step_s=wall - 2.0)
               for (tool, i), wall in walls.items()]
    results.append(sbs.RunResult("mca", 2, "failed (exit 1)", wall_s=5.0))
    summary = sbs.ratios(results)
    assert summary["standard"]["ratio_per_round"] == [1.0, 0.8] and summary["standard"]["ratio"] == 0.9
    assert summary["mca"]["ratio_per_round"] == [1.2, 1.0] and summary["mca"]["runs"] == 2
    assert summary["llamafactory"]["ratio"] == 1.0
    assert summary["mca"]["after_s"] == 2.0 and summary["mca"]["loop_s"] == pytest.approx(20.5)
    text = sbs.markdown(results, summary, {"date": "d", "command": "c", "commit": "x", "machine": "m",
                                           "llamafactory_version": "0.9.5", "load_start": [1], "load_end": [2],
                                           "settings": "s"})
    assert "| roll mca | 2 | 32.5 | 10.0 | 20.5 | 2.0 | 1.20, 1.00 | 1.10 |" in text
    assert "| 3 | roll mca | failed (exit 1) |" in text


def test_skips_with_a_message_without_llamafactory(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "scripts", "side_by_side_llamafactory.py"),
           "--llamafactory-cli", str(tmp_path / "no-such-cli"), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("skipped: LLaMA-Factory is not installed") and "--llamafactory-cli" in proc.stdout
    assert not (tmp_path / "work").exists()
