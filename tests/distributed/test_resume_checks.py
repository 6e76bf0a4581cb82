"""Resuming on both backends: the skipped-step count continues, a changed training set is refused.

One chain per backend, one process each, on the tiny model with a NaN in its final norm (every step is
skipped, so every step moves the counter): 2 steps with a checkpoint at step 2; a resume after one row of
the data file was edited (same file, same row count: only the content fingerprint tells) exits 2; a resume
on the restored file runs step 3, and its log says 3 skipped steps, not 1.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from roll.errors import EXIT_USAGE
from tests.distributed.test_reliability import nan_model_dir  # noqa: F401 - the fixture
from tests.helpers import roll_train

pytestmark = pytest.mark.distributed

DATA = "recipes/demo/data/arithmetic_sft.json"


def _run(model_dir: str, out: str, data: str, use_mca: bool, **extra):
    keys = dict(model_name_or_path=model_dir, stage="sft", dataset=data, cutoff_len=64, output_dir=out,
                per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="constant",
                logging_steps=1, save_steps=2, save_hf_model="false", report_to="none", disable_tqdm="true",
                max_consecutive_skipped_steps=0, use_mca=str(use_mca).lower(), **extra)
    return roll_train(*[f"{key}={value}" for key, value in keys.items()], timeout=300)


def _skipped_by_step(out: str) -> dict[int, int]:
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as fh:
        return {entry["step"]: entry.get("skipped_steps") for entry in map(json.loads, fh) if "loss" in entry}


@pytest.mark.parametrize("use_mca", [False, True], ids=["standard", "mca"])
def test_resume_keeps_the_skip_count_and_refuses_an_edited_dataset(nan_model_dir, tmp_path,  # noqa: F811
                                                                     use_mca):
    data, out = str(tmp_path / "train.json"), str(tmp_path / "run")
    shutil.copy(DATA, data)
    first = _run(nan_model_dir, out, data, use_mca, max_steps=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _skipped_by_step(out) == {1: 1, 2: 2}
    with open(os.path.join(out, "checkpoint-2", "roll_resume.json"), encoding="utf-8") as fh:
        record = json.load(fh)
    assert (record["global_step"], record["consumed_samples"], record["skipped_steps"]) == (2, 4, 2)

    with open(data, encoding="utf-8") as fh:
        rows = json.load(fh)
    edited = [dict(rows[0], output=rows[0]["output"] + " Indeed."), *rows[1:]]
    with open(data, "w", encoding="utf-8") as fh:
        json.dump(edited, fh)
    refused = _run(nan_model_dir, out, data, use_mca, max_steps=3, resume_from_checkpoint="true")
    assert refused.returncode == EXIT_USAGE, refused.stderr[-3000:]
    assert f"dataset={data!r}" in refused.stderr and "with other contents or order" in refused.stderr
    assert "overwrite_output_dir: true" in refused.stderr and "Traceback" not in refused.stderr

    with open(data, "w", encoding="utf-8") as fh:
        json.dump(rows, fh)
    resumed = _run(nan_model_dir, out, data, use_mca, max_steps=3, resume_from_checkpoint="true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _skipped_by_step(out)[3] == 3  # continued from the checkpoint's 2, not restarted at 1
