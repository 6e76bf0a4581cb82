"""roll-parity for real, as a user runs it: the tiny Qwen2 on both backends, 3 steps, CPU, gloo, fp32."""

from __future__ import annotations

import json
import sys

import pytest

from tests.bounds import PARITY_TOOL_TP1, PARITY_TOOL_TP2
from tests.helpers import run_stopping

pytestmark = [pytest.mark.distributed, pytest.mark.mca]


@pytest.fixture(autouse=True)
def _needs_megatron():
    pytest.importorskip("megatron.core")


def roll_parity(*args: str, timeout: float) -> tuple[int, dict, str]:
    """``roll-parity args... --json`` -> (exit code, its JSON, stderr). On timeout it gets SIGTERM first,
    which it forwards down to roll-train, torchrun and the ranks (they run in sessions of their own)."""
    proc = run_stopping([sys.executable, "-m", "roll.parity.cli", *args, "--json"], timeout)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def sft_recipe(model_dir: str, directory) -> str:
    path = directory / "sft.yaml"
    path.write_text(f"model_name_or_path: {model_dir}\nstage: sft\n"
                    "dataset: recipes/demo/data/arithmetic_sft.json\ncutoff_len: 64\n"
                    "per_device_train_batch_size: 4\nlearning_rate: 1.0e-3\nseed: 0\n")
    return str(path)


TP2_PADDED = ("nproc_per_node=2", "tensor_model_parallel_size=2", "make_vocab_size_divisible_by=384")
"""512-token vocabulary padded to 768 at TP2."""


@pytest.fixture
def recipe(tiny_model_factory, tmp_path) -> str:
    return sft_recipe(tiny_model_factory("qwen2"), tmp_path)


def test_tp1_on_one_process_matches_the_standard_backend(recipe):
    code, result, stderr = roll_parity(recipe, "--steps", "3", timeout=240)
    assert code == 0 and result["passed"], (result, stderr[-4000:])
    assert result["steps"] == [1, 2, 3] and result["max_rel_diff"] <= PARITY_TOOL_TP1.rel, result
    losses = result["losses"]["standard"]
    assert losses[-1] < losses[0], losses  # it trained
    assert result["runs"]["mca"]["description"].startswith("1 process, tp(1) * pp(1) * cp(1) * dp(1)")


def test_tp2_with_a_padded_vocabulary_matches_the_standard_backend(recipe, tmp_path):
    """512-token vocabulary padded to 768 at TP2: the padded logits must not enter the softmax."""
    out = tmp_path / "parity"
    code, result, stderr = roll_parity(recipe, "--steps", "3", "--output-dir", str(out), *TP2_PADDED, timeout=300)
    assert code == 0 and result["passed"], (result, stderr[-4000:])
    assert result["steps"] == [1, 2, 3] and result["max_rel_diff"] <= PARITY_TOOL_TP2.rel, result
    assert "2 processes, tp(2)" in result["runs"]["mca"]["description"]
    assert result["runs"]["standard"]["description"] == "1 process, no DeepSpeed, gradient_accumulation_steps 1"
    # --output-dir keeps both runs and their logs
    for name in ("standard/train_log.jsonl", "mca/train_log.jsonl", "standard.log", "mca.log"):
        assert (out / name).is_file(), name


def test_a_sweep_case_by_name_compares_eval_loss_and_the_exported_weights():
    """roll-parity --case: the case's tiny model built on the spot, its key set (mid-run eval every 3 steps, on
    start too), both models exported; an override on top of the case applies to both runs."""
    code, result, stderr = roll_parity("--case", "mid_run_eval", "--steps", "3", "learning_rate=2e-3", timeout=300)
    assert code == 0 and result["passed"], (result, stderr[-4000:])
    assert result["steps"] == [1, 2, 3] and result["eval"]["steps"] == [0, 3], result
    assert max(result["eval"]["rel_diff"]) <= 1e-6 and result["learning_rate_max_rel_diff"] <= 1e-6, result
    assert 0 < result["weights"]["rel_diff"] <= 1e-3 and result["weights"]["mismatched"] == [], result
    assert "learning_rate=2e-3" in result["runs"]["mca"]["command"]
