"""DeepSpeed in one plain process (no launcher) and a non-DeepSpeed run after it in the same process:
the backend's W5 (1-rank env) and W6 (state reset) make both work with no tricks in the test."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO

SFT_DATA = os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json")
DPO_DATA = os.path.join(REPO, "recipes", "demo", "data", "arithmetic_dpo.json")


def _run(model_dir, out_dir, **extra):
    from roll import router
    from roll.config.parser import resolve

    recipe = dict(model_name_or_path=model_dir, stage="sft", dataset=SFT_DATA, cutoff_len=64,
                  output_dir=str(out_dir),
                  per_device_train_batch_size=8, max_steps=2, logging_steps=1, learning_rate=1e-3,
                  save_strategy="no", report_to="none", disable_tqdm=True)
    return router.run(resolve({**recipe, **extra}, {}, None))


def test_zero3_in_one_process_then_plain_dpo(tiny_model_dir, tmp_path):
    # LOCAL_RANK + WORLD_SIZE left behind would also make this process look launched (clean exit, W2)
    launch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {key: os.environ.get(key) for key in launch_vars}
    plain = _run(tiny_model_dir, tmp_path / "plain")
    ds = os.path.join(REPO, "recipes", "deepspeed", "ds_z3.json")
    zero3 = _run(tiny_model_dir, tmp_path / "z3", deepspeed=ds)
    assert zero3.log_history[0]["loss"] == pytest.approx(plain.log_history[0]["loss"], rel=1e-4)
    assert {key: os.environ.get(key) for key in launch_vars} == before  # the 1-rank env was restored
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ

    # a later non-DeepSpeed DPO in the same process must not try to DeepSpeed-wrap its reference model
    dpo = _run(tiny_model_dir, tmp_path / "dpo", stage="dpo", dataset=DPO_DATA, per_device_train_batch_size=4)
    assert dpo.log_history[0]["loss"] == pytest.approx(0.6931, abs=1e-3)


def test_zero3_checkpoint_resume_reproduces_the_run(tiny_model_dir, tmp_path):
    """A DeepSpeed (ZeRO-3) checkpoint at step 3; resuming from it reproduces steps 4-6."""
    import json

    ds = os.path.join(REPO, "recipes", "deepspeed", "ds_z3.json")
    common = dict(deepspeed=ds, max_steps=6, save_strategy="steps", save_steps=3,
                  per_device_train_batch_size=4, lr_scheduler_type="linear")
    full = _run(tiny_model_dir, tmp_path / "full", **common)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert any(name.startswith("global_step") for name in os.listdir(checkpoint))  # DeepSpeed's own state
    _run(tiny_model_dir, tmp_path / "resumed", resume_from_checkpoint=str(checkpoint), **common)
    with open(tmp_path / "resumed" / "train_log.jsonl", encoding="utf-8") as fh:
        resumed = [entry for entry in map(json.loads, fh) if "loss" in entry]
    expected = [entry["loss"] for entry in full.log_history if "loss" in entry][3:]
    assert [entry["step"] for entry in resumed] == [4, 5, 6]
    assert [entry["loss"] for entry in resumed] == pytest.approx(expected, rel=1e-5)
