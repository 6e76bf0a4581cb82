"""The parity sweep's pieces without training: the case table covers every key set and layout issue 17 lists,
eval_loss and exported-weight comparisons on literal values, and roll-parity's --case / --list-cases
command line (tests/parity trains every case; tests/distributed/test_parity_tool.py runs roll-parity)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from roll.parity import cli as parity
from roll.parity.cases import CASES, LAYOUTS, MODELS, format_cases, get_case
from roll.parity.report import compare_evals, weight_gap

REQUIRED = {
    "weight decay": lambda c: "weight_decay" in c.overrides,
    "grad clipping that clips": lambda c: c.clips and "max_grad_norm" in c.overrides,
    "uneven sample lengths under accumulation": lambda c: "uneven" in c.overrides.get("dataset", ""),
    "adam hyper-parameters": lambda c: {"adam_beta1", "adam_beta2", "adam_epsilon"} <= set(c.overrides),
    "packing": lambda c: c.overrides.get("packing") is True,
    "mid-run eval": lambda c: c.overrides.get("eval_strategy") == "steps",
    "resume mid-run": lambda c: c.resume_at is not None,
    "bf16": lambda c: c.overrides.get("bf16") is True,
    "lora_dropout 0": lambda c: c.overrides.get("lora_dropout") == 0.0,
    "lora rank/alpha/target variants": lambda c: "lora_alpha" in c.overrides
    and c.overrides["lora_target"] != "all",
}
"""Issue 17's key sets: each needs a case on one process."""


def test_every_key_set_has_a_one_process_case_and_every_layout_a_case():
    one_process = [case for case in CASES if case.layout == "1p"]
    for what, holds in REQUIRED.items():
        assert any(holds(case) for case in one_process), what
    from backends.mca.trainer.optim import STEP_SCHEDULES

    schedules = {c.overrides.get("lr_scheduler_type") for c in one_process if "warmup_steps" in c.overrides
                 or "warmup_ratio" in c.overrides}
    assert set(STEP_SCHEDULES) - {"constant"} <= schedules, set(STEP_SCHEDULES) - schedules
    losses = {c.overrides.get("pref_loss", "sigmoid") for c in one_process if c.base == "dpo"}
    assert losses == {"sigmoid", "ipo", "hinge", "orpo", "simpo"}
    assert set(LAYOUTS) == {case.layout for case in CASES}
    assert len({case.name for case in CASES}) == len(CASES)
    # at any layout: pref_ftx, use_rslora, and a MoE model with its default load-balancing loss over padded rows
    assert any(c.overrides.get("pref_ftx") for c in CASES)
    assert any(c.overrides.get("use_rslora") for c in CASES)
    assert any(c.model == "moe" and "moe_aux_loss_coeff" not in c.overrides
               and "uneven" in c.overrides.get("dataset", "") for c in CASES)
    # issue 22: each new stage and loss on a MoE model at EP2, and pref_ftx with the DPO-family losses
    at_ep2 = {(c.base, c.overrides.get("pref_loss")) for c in CASES if c.model in ("moe", "mixtral")
              and LAYOUTS[c.layout].keys.get("expert_model_parallel_size", 1) > 1}
    assert {("kto", None), ("rm", None), ("dpo", "orpo"), ("dpo", "simpo")} <= at_ep2, at_ep2
    with_ftx = {c.overrides.get("pref_loss", "sigmoid") for c in CASES if c.overrides.get("pref_ftx")}
    assert {"sigmoid", "hinge", "orpo", "simpo"} <= with_ftx, with_ftx


def test_adapter_configs_must_agree_on_rank_scaling_and_targets(tmp_path):
    import json

    from roll.parity.sweep import adapter_config_failures

    config = {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]}
    for name, changes in (("standard", {}), ("mca", {"lora_alpha": 8.0, "target_modules": ["v_proj", "q_proj"]}),
                          ("plain", {"use_rslora": False})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({**config, **changes, "peft_type": "LORA"}))
    assert adapter_config_failures(str(tmp_path / "standard"), str(tmp_path / "mca")) == []
    assert "use_rslora" in adapter_config_failures(str(tmp_path / "standard"), str(tmp_path / "plain"))[0]
    assert adapter_config_failures(str(tmp_path / "standard"), str(tmp_path / "none"))  # one run only
    assert adapter_config_failures(str(tmp_path / "none"), str(tmp_path / "none")) == []  # no LoRA


def test_case_recipes_keep_the_global_batch_and_read_back_as_written(tmp_path):
    for case in CASES:
        recipe = case.recipe(str(tmp_path))
        layout = LAYOUTS[case.layout]
        gas = {"ga_uneven_lengths": 8, "ep2_mixtral_moe_losses_ga8": 8, "tp2_mixtral_80_aux": 4,
               "kto_tokenization_pairs": 8}.get(case.name, 2)  # LLaMA-Factory's kto example: 1 row x 8
        assert recipe["gradient_accumulation_steps"] * layout.dp == gas, case.name
        assert yaml.safe_load(yaml.safe_dump(recipe)) == recipe, case.name  # 1e-05 stays a number
    assert MODELS["qwen2_4l"]["num_layers"] % 4 == 0  # PP2 x VPP2: one layer per model chunk


def test_eval_loss_compares_the_same_steps():
    good = compare_evals({0: 6.0, 3: 5.0}, {0: 6.0 * (1 + 1e-7), 3: 5.0}, 1e-6)
    assert good.passed and good.max_rel_diff == pytest.approx(1e-7, rel=1e-3)
    missing = compare_evals({0: 6.0, 3: 5.0}, {3: 5.0}, 1e-6)
    assert missing.failures() == ["eval_loss at step 0 missing from the mca log"]
    far = compare_evals({3: 5.0}, {3: 5.001}, 1e-6)
    assert far.failures() == ["eval_loss at step 3 rel diff 2.00e-04 > 1e-06"]


def test_weights_gap_is_relative_to_the_update():
    start = {"w": torch.zeros(2), "b": torch.ones(1)}
    standard = {"w": torch.tensor([3.0, 4.0]), "b": torch.ones(1)}  # moved by 5
    mca = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.005])}
    gap = weight_gap(start, standard, mca, 1e-3)
    assert gap.update_norm == pytest.approx(5.0) and gap.rel_diff == pytest.approx(1e-3)
    assert gap.passed and not weight_gap(start, standard, mca, 9e-4).passed
    adapter = weight_gap({}, {"lora_B": torch.tensor([0.0, 2.0])}, {"lora_B": torch.tensor([0.0, 2.0])}, 1e-3)
    assert adapter.rel_diff == 0.0 and adapter.update_norm == 2.0  # absent from the start model: from zero
    mismatched = weight_gap(start, standard, {"w": standard["w"]}, 1.0)
    assert not mismatched.passed and mismatched.failures() == ["the exports differ in tensors: b"]
    assert math.isinf(weight_gap(start, start, standard, 1.0).rel_diff)  # no update, a difference


def test_list_cases_and_unknown_case(capsys):
    out, err = [], []
    assert parity.main(["--list-cases"], out=out.append, err=err.append) == 0
    listed = [line.split()[0] for line in format_cases().splitlines()]
    assert listed == [case.name for case in CASES] and "".join(out).startswith(CASES[0].name)
    assert parity.main(["--case", "no_such_case"], out=out.append, err=err.append) == 2
    assert "no parity case named 'no_such_case'" in err[-1] and "weight_decay" in err[-1]
    assert parity.main(["r.yaml", "--case", "weight_decay"], out=out.append, err=err.append) == 2
    assert "a recipe or --case NAME, not both" in err[-1]
    assert parity.main(["--case", "resume_mid_run", "--steps", "3"], out=out.append, err=err.append) == 2
    assert "resumes from step 4: give --steps above it" in err[-1]
    assert get_case("bf16").bounds.steps > get_case("sft_plain").bounds.steps


def test_a_case_plans_both_runs_with_its_layout_and_the_command_line_bounds(tiny_model_dir, tmp_path,
                                                                            monkeypatch):
    from roll.parity import sweep as parity_sweep

    monkeypatch.setattr(parity_sweep, "build_model", lambda name, root: tiny_model_dir)
    options = parity.parse_command_line(["--case", "dp2_overlap_clipping_decay", "--tolerance", "1e-3",
                                         "weight_decay=0.2"])
    title, pairs, _ = parity_sweep.plan(options, str(tmp_path))
    (pair,) = pairs
    assert "layout dp2_overlap" in title and "weight_decay=0.2" in title
    assert "nproc_per_node=1" in pair.standard.args and "gradient_accumulation_steps=2" in pair.standard.args
    assert pair.mca.description.startswith("2 processes") and "save_hf_model=true" in pair.mca.args
    bounds = parity_sweep._bounds(options, True, get_case("dp2_overlap_clipping_decay").bounds)
    assert (bounds.steps, bounds.step1) == (1e-3, get_case("dp2_overlap_clipping_decay").bounds.step1)
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert recipe["overlap_param_gather"] is True and recipe["gradient_accumulation_steps"] == 1
