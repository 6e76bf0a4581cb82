"""Stage rm on Megatron: the standard backend's (TRL's) loss and metrics on every layout, the 1-wide score head
under TP / SP / PP / VPP / CP, and an export transformers loads and that scores as the trained model does. Real
runs on tiny models, CPU, gloo, fp32, in one torchrun job."""

from __future__ import annotations

import json
import math

import pytest

from tests.bounds import (BACKEND_RM, BACKEND_RM_REWARDS, RM_EXPORT, RM_LAYOUT, RM_LAYOUT_REWARDS, Comparison,
                          assert_within)
from tests.distributed.test_mca_train import train_runs
from tests.helpers import output_of, roll_train

pytestmark = [pytest.mark.distributed, pytest.mark.mca]
RM = dict(stage="rm", dataset="recipes/demo/data/arithmetic_rm.json", val_size=16, cutoff_len=64,
          learning_rate=5e-3, per_device_train_batch_size=4, max_steps=5, logging_steps=1, save_strategy="no",
          save_hf_model=False, report_to="none", seed=0)
METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")
ABSOLUTE = ("margin", "rewards/chosen", "rewards/rejected", "accuracy")
"""Metrics that start at 0 (a zero head): compared absolutely, on the scale of 1."""


@pytest.fixture(autouse=True)
def _needs_megatron():
    pytest.importorskip("megatron.core")


def comparisons(label: str, log: list[dict], reference: list[dict], bounds) -> list[Comparison]:
    """The loss (relative, ``bounds[0]``) and every rm metric (absolute, ``bounds[1]``), step by step."""
    return [Comparison(f"{label} {name}", [e[name] for e in log], [e[name] for e in reference],
                       bounds[name in ABSOLUTE], scale=1.0 if name in ABSOLUTE else 0.0)
            for name in ("loss", *METRICS)]


def eval_comparison(label: str, run: dict, reference: dict, bounds) -> list[Comparison]:
    return [Comparison(f"{label} eval_{name}", [run["eval"][f"eval_{name}"]], [reference["eval"][f"eval_{name}"]],
                       bounds[name in ABSOLUTE], scale=1.0 if name in ABSOLUTE else 0.0)
            for name in ("loss", *METRICS)]


LAYOUTS = ("tp2_sp", "pp2", "pp2_vpp2", "cp2")


def standard_run(tmp_path, base: dict, **overrides) -> dict:
    """The standard backend (one process) on the same recipe: {"log": training records, "eval": the final eval}."""
    out = tmp_path / "std"
    recipe = tmp_path / "std.yaml"
    recipe.write_text(json.dumps({**base, **overrides, "output_dir": str(out)}))  # JSON is YAML
    proc = roll_train(str(recipe), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    with open(out / "train_log.jsonl", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    evals = [r for r in records if "eval_loss" in r]
    return {"log": [r for r in records if "loss" in r], "eval": evals[-1] if evals else {}}


def rm_runs(make_model, tmp_path) -> tuple[dict, dict]:
    """The standard backend (TRL's RewardTrainer, one process) and, in one 2-process torchrun job, Megatron at
    TP1 x DP2, TP2 + SP (exported), PP2, PP2 x VPP2, CP2 and LoRA at TP2 + SP (exported; and the same run
    saved at step 3 and resumed from its adapter-only checkpoint)."""
    model = make_model("qwen2", num_layers=4)  # tied embeddings: a reward model is built untied
    base = {**RM, "model_name_or_path": model, "output_dir": str(tmp_path / "out")}
    standard = standard_run(tmp_path, base, per_device_train_batch_size=8)
    gas2 = {"gradient_accumulation_steps": 2}
    tp2 = {**gas2, "tensor_model_parallel_size": 2, "sequence_parallel": True}
    export = {"save_hf_model": True}
    lora = {**tp2, "finetuning_type": "lora", "lora_target": "all", "learning_rate": 1e-2,
            "lr_scheduler_type": "constant", "save_async": False}  # constant: a run to step 3 is the full run's start
    result = train_runs(tmp_path, base, [
        {"name": "tp1_dp2"},
        {"name": "tp2_sp", "overrides": {**tp2, **export, "output_dir": str(tmp_path / "tp2")}, "export": True},
        {"name": "pp2", "overrides": {**gas2, "pipeline_model_parallel_size": 2}},
        {"name": "pp2_vpp2", "overrides": {**gas2, "pipeline_model_parallel_size": 2,
                                           "virtual_pipeline_model_parallel_size": 2}},
        {"name": "cp2", "overrides": {**gas2, "context_parallel_size": 2}},
        {"name": "tp2_lora", "overrides": {**lora, **export, "output_dir": str(tmp_path / "lora")}, "export": True},
        {"name": "tp2_lora_to_step3", "overrides": {**lora, "max_steps": 3, "save_strategy": "steps", "save_steps": 3,
                                                    "output_dir": str(tmp_path / "resumed")}},
        {"name": "tp2_lora_resumed", "overrides": {**lora, "resume_from_checkpoint": True,
                                                   "output_dir": str(tmp_path / "resumed")}},
    ], worker="reward_checks.py")
    return standard, result


def rm_comparisons(standard: dict, result: dict) -> list[Comparison]:
    """Every metric step by step and at the end-of-run eval: TP1 x DP2 vs the standard backend, the other
    layouts vs TP1 x DP2; and each export's rewards of the held-out rows vs the trained model's, as a gap
    relative to the largest reward (``[1 + gap / scale]`` vs ``[1]``)."""
    reference, backend, layout = result["tp1_dp2"], (BACKEND_RM, BACKEND_RM_REWARDS), (RM_LAYOUT, RM_LAYOUT_REWARDS)
    checks = comparisons("tp1_dp2 vs standard", reference["log"], standard["log"], backend)
    checks += eval_comparison("tp1_dp2 vs standard", reference, standard, backend)
    for name in LAYOUTS:
        checks += comparisons(name, result[name]["log"], reference["log"], layout)
        checks += eval_comparison(name, result[name], reference, layout)
    for name in ("tp2_sp", "tp2_lora"):
        mca, hf = result[name]["mca_rewards"], result[name]["hf_rewards"]
        gap = max(abs(a - b) for a, b in zip(mca, hf)) / max(abs(v) for v in hf)
        checks.append(Comparison(f"{name} export vs trained", [1.0 + gap], [1.0], RM_EXPORT))
    return checks


def test_rm_layouts_backend_parity_and_export(tiny_model_factory, tmp_path):
    """Step 1 is ln 2 on both backends (the zero head); every logged metric of 5 steps and of the end-of-run
    eval on 16 held-out pairs equals the standard backend's (TRL) within the measured backend gap, and TP2 + SP,
    PP2, PP2 x VPP2 and CP2 equal TP1 x DP2 within the measured layout gap. The TP2 exports (full: a
    Qwen2ForSequenceClassification; LoRA: a SEQ_CLS adapter holding the head) load in transformers and score
    the held-out pairs as the trained Megatron model does (tests/bounds.py RM_EXPORT). The LoRA run resumed from
    its step-3 checkpoint (adapters and the fully trained head) repeats the uninterrupted run exactly."""
    standard, result = rm_runs(tiny_model_factory, tmp_path)
    reference = result["tp1_dp2"]
    assert reference["log"][0]["loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert standard["log"][0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert all(reference["log"][0][name] == 0 for name in METRICS), reference["log"][0]
    # it trains (5.9e-4 off ln 2 at most with the HF Trainer's order; a frozen head stays at ln 2 exactly)
    assert max(abs(e["loss"] - math.log(2)) for e in reference["log"][1:]) > 1e-4, reference["log"]
    for name in ("tp2_sp", "tp2_lora"):
        run = result[name]
        assert len(run["mca_rewards"]) == len(run["hf_rewards"]) == 32, run  # 16 held-out pairs
        assert len(set(run["mca_rewards"])) == 32, run  # a trained head: no two rows alike
        assert run["config"]["num_labels"] == 1 and run["config"]["pad_token_id"] is not None, run["config"]
    resumed = result["tp2_lora_to_step3"]["log"] + result["tp2_lora_resumed"]["log"]
    assert [e["loss"] for e in resumed] == [e["loss"] for e in result["tp2_lora"]["log"]]  # the head in the checkpoint
    assert result["tp2_sp"]["config"]["architectures"] == ["Qwen2ForSequenceClassification"]
    assert result["tp2_lora"]["config"]["task_type"] == "SEQ_CLS"
    assert "score" in result["tp2_lora"]["config"]["modules_to_save"]
    assert_within(rm_comparisons(standard, result))
