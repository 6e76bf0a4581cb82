"""DPO on Megatron: the standard backend's (TRL's) losses and metrics on every layout, a frozen reference
under pipeline parallelism, log-probs from vocab-parallel logits. Real runs on tiny models, CPU, gloo."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import pytest

from tests.bounds import (BACKEND_DPO, BACKEND_DPO_REWARDS, DPO_LAYOUT, DPO_LAYOUT_REWARDS, Bound, Comparison,
                          assert_within)
from tests.distributed.test_mca_train import WORKERS, StandardRuns, standard_log, train_runs
from tests.helpers import output_of, results, roll_train, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.mca]
DPO = dict(stage="dpo", dataset="recipes/demo/data/arithmetic_dpo.json", cutoff_len=64, pref_beta=0.1,
           learning_rate=1e-3, per_device_train_batch_size=4, max_steps=5, logging_steps=1, save_strategy="no",
           save_hf_model=False, report_to="none", seed=0)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(autouse=True)
def _needs_megatron():
    pytest.importorskip("megatron.core")


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def metric_comparisons(label: str, log: list[dict], reference: list[dict], bounds: tuple[Bound, Bound]
                       ) -> list[Comparison]:
    """The loss and every DPO metric, step by step: the loss and log-probs relative (``bounds[0]``), the
    rewards, which start at 0, absolute (``bounds[1]``)."""
    return [Comparison(f"{label} {name}", [entry[name] for entry in log], [entry[name] for entry in reference],
                       bounds[name in REWARDS], scale=1.0 if name in REWARDS else 0.0) for name in ("loss", *METRICS)]


@dataclass(frozen=True)
class PreferenceRuns:
    """A preference test's runs over the DPO base (a 4-layer Qwen2): {name: overrides} on the standard backend
    (one process, the whole global batch of 8) and ``train_runs``' Megatron runs (2 processes, TP1 x DP2 unless
    they say otherwise)."""

    standard: dict[str, dict]
    mca: list[dict]


def preference_runs(make_model, root, tests: list[PreferenceRuns]) -> list[tuple[dict, dict]]:
    """The runs of several ``tests`` together: every standard run in one process, every Megatron run in one
    2-process torchrun job (one launch each, not one per test); each test's ({name: standard log},
    {name: Megatron run})."""
    base = {**DPO, "model_name_or_path": make_model("qwen2", num_layers=4), "output_dir": str(root / "out")}
    standard = StandardRuns(root, {f"std_{name}": {**base, "per_device_train_batch_size": 8, **keys}
                                   for test in tests for name, keys in test.standard.items()}).logs()
    result = train_runs(root, base, [run for test in tests for run in test.mca])
    return [({name: standard[f"std_{name}"] for name in test.standard},
             {run["name"]: result[run["name"]] for run in test.mca}) for test in tests]


def dpo_specs(make_model) -> PreferenceRuns:
    """The standard backend (TRL; sigmoid, ipo, label smoothing) and Megatron at TP1 x DP2 (the same three
    losses), TP2 with a padded vocabulary, PP2, PP2 x VPP2, CP2, the distributed optimizer and MoE EP1 / EP2."""
    moe = make_model("qwen3_moe")
    variants = {"ipo": {"pref_loss": "ipo"}, "smoothed": {"pref_label_smoothing": 0.2}}
    gas2 = {"gradient_accumulation_steps": 2}
    return PreferenceRuns({"tp1_dp2": {}, **variants}, [
        {"name": "tp1_dp2"},
        *({"name": name, "overrides": keys} for name, keys in variants.items()),
        {"name": "distributed_optimizer", "overrides": {"use_distributed_optimizer": True}},
        {"name": "tp2_padded", "overrides": {**gas2, "tensor_model_parallel_size": 2,
                                             "make_vocab_size_divisible_by": 384}},
        {"name": "pp2", "overrides": {**gas2, "pipeline_model_parallel_size": 2}},
        {"name": "pp2_vpp2", "overrides": {**gas2, "pipeline_model_parallel_size": 2,
                                           "virtual_pipeline_model_parallel_size": 2}},
        {"name": "cp2", "overrides": {**gas2, "context_parallel_size": 2}},
        {"name": "moe_ep1", "overrides": {"model_name_or_path": moe}},
        {"name": "moe_ep2", "overrides": {"model_name_or_path": moe, "expert_model_parallel_size": 2}},
    ])


def dpo_runs(make_model, root) -> tuple[dict, dict]:
    """``dpo_specs``' runs alone: ({name: standard log}, {name: Megatron run})."""
    return preference_runs(make_model, root, [dpo_specs(make_model)])[0]


BACKEND, LAYOUT = (BACKEND_DPO, BACKEND_DPO_REWARDS), (DPO_LAYOUT, DPO_LAYOUT_REWARDS)


def dpo_comparisons(standard: dict, result: dict) -> list[Comparison]:
    reference = result["tp1_dp2"]["log"]
    comparisons = [*metric_comparisons("tp2_padded vs standard", result["tp2_padded"]["log"], standard["tp1_dp2"],
                                       BACKEND)]
    for name, log in standard.items():  # TRL's sigmoid, ipo, conservative DPO (sigmoid + label smoothing)
        comparisons += metric_comparisons(f"{name} vs standard", result[name]["log"], log, BACKEND)
    for name in ("distributed_optimizer", "tp2_padded", "pp2", "pp2_vpp2", "cp2"):
        comparisons += metric_comparisons(name, result[name]["log"], reference, LAYOUT)
    return comparisons + metric_comparisons("moe_ep2", result["moe_ep2"]["log"], result["moe_ep1"]["log"], LAYOUT)


def test_dpo_layouts_and_backend_parity(preference_runs_of_the_session):
    """The standard backend (TRL) and Megatron at TP1 and at TP2 with a padded vocabulary: step 1 is ln 2,
    every logged metric of 5 steps within the measured backend gap (tests/bounds.py), also for ipo and for
    sigmoid with label smoothing. TP2, PP2, PP2 x VPP2, DP2 with the distributed optimizer, CP2, and MoE EP2
    equal TP1 x DP2 within the measured layout gap at every step."""
    standard, result = preference_runs_of_the_session["dpo"]
    reference = result["tp1_dp2"]["log"]
    assert reference[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert_within(dpo_comparisons(standard, result))
    for name in ("ipo", "smoothed"):
        differences = [abs(a["loss"] - b["loss"]) for a, b in zip(result[name]["log"][1:], reference[1:])]
        assert max(differences) > 1e-5, name  # really another loss than plain sigmoid


def test_reference_stays_frozen_and_log_probs_match_hf(tiny_model_dir, tmp_path):
    """At TP2 with a 512 -> 768 padded vocabulary: vocab-parallel log-probs equal HF's log_softmax within
    1e-5; after three DPO steps the reference weights are bit-identical and the policy's moved."""
    proc = torchrun(os.path.join(WORKERS, "dpo_checks.py"), tiny_model_dir, str(tmp_path / "out"),
                    "tensor_model_parallel_size=2", "make_vocab_size_divisible_by=384", nproc=2, timeout=300)
    assert proc.returncode == 0, output_of(proc)
    result = results(proc.stdout)[0]
    assert result["padded_vocab"] == 768
    assert result["log_prob_error"] < 1e-5, result
    assert result["ref_unchanged"] and result["policy_changed"], result
    assert result["losses"][0] == pytest.approx(math.log(2), abs=1e-7)


def test_tiny_dpo_recipe_at_pp2_from_the_command_line(tiny_model_factory, tmp_path):
    """The demo DPO recipe with --use-mca at PP2 (the reference runs through the pipeline too) trains and
    exports an HF model; ref_free trains as well."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen2", tokenizer="qwen")
    out = tmp_path / "out"
    proc = roll_train("recipes/demo/tiny_dpo.yaml", "--use-mca", "nproc_per_node=2", "pipeline_model_parallel_size=2",
                      f"model_name_or_path={model_dir}", f"output_dir={out}", "max_steps=10", timeout=600)
    assert proc.returncode == 0, output_of(proc)
    with open(out / "train_log.jsonl", encoding="utf-8") as fh:
        log = [json.loads(line) for line in fh]
    assert log[0]["loss"] > log[-1]["loss"] and set(METRICS) <= set(log[0]), log
    exported = AutoModelForCausalLM.from_pretrained(out).config.vocab_size
    assert exported == AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size > 150_000
    free = roll_train("recipes/demo/tiny_dpo.yaml", "--use-mca", "ref_free=true", f"model_name_or_path={model_dir}",
                      f"output_dir={tmp_path / 'free'}", "max_steps=2", "save_hf_model=false", timeout=300)
    assert free.returncode == 0, output_of(free)


def test_dpo_on_one_process_matches_trl_every_step(tiny_model_dir, tmp_path):
    """One process each, 3 steps at lr 1e-2: the loss equals the standard backend's (TRL's) within 1e-5 at every
    step (measured: 1.2e-6), and from step 2 on it is off ln 2 by more than 1e-3: a reference whose log-probs
    come from the policy (loss stuck at ln 2, within 1e-7) cannot pass. (The rewards are differences of log-prob sums near
    60, whose fp32 noise is about 3e-5 absolute: they are compared in test_dpo_layouts_and_backend_parity.)"""
    base = {**DPO, "model_name_or_path": tiny_model_dir, "learning_rate": 1e-2, "max_steps": 3,
            "output_dir": str(tmp_path / "mca")}
    standard = [entry["loss"] for entry in standard_log(tmp_path, base, "std")]
    losses = train_runs(tmp_path, base, [{"name": "mca"}], nproc=1)["mca"]["losses"]
    assert len(losses) == len(standard) == 3, (losses, standard)
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, standard)), (losses, standard)
    assert min(abs(loss - math.log(2)) for loss in standard[1:]) > 1e-3, standard  # 4.3e-3 at step 3 (HF order)
