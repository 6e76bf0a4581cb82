"""Elastic resume on the standard backend: a ZeRO checkpoint written by 2 processes resumes on 1 with the
same global batch (per-device 2 x accumulation 2 x 1 process = 2 x 1 x 2) and repeats the uninterrupted run's
losses, step by step; a checkpoint of that 1-process run resumes on 2 processes again (ZeRO-2). DeepSpeed's
own load refuses another number of ZeRO partitions; roll converts the checkpoint to DeepSpeed's universal
checkpoint once (backends/standard/elastic.py). The mca backend's DP2 -> DP1 resume:
tests/distributed/test_mca_train.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.bounds import ELASTIC_RESUME, Comparison, assert_within
from tests.helpers import REPO, output_of, roll_train

pytestmark = pytest.mark.distributed

DATA = os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json")


def _train(model_dir: str, out, ds_file: str, nproc: int, grad_accum: int, **extra) -> list[float]:
    """``roll-train`` with a DeepSpeed file on ``nproc`` processes, per-device batch 2; the logged losses."""
    keys = dict(model_name_or_path=model_dir, stage="sft", dataset=DATA, cutoff_len=64, output_dir=str(out),
                per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum, nproc_per_node=nproc,
                deepspeed=os.path.join(REPO, "recipes", "deepspeed", ds_file), max_steps=4, logging_steps=1,
                learning_rate=1e-3, lr_scheduler_type="constant", save_hf_model="false", report_to="none",
                disable_tqdm="true", seed=0, **extra)
    proc = roll_train(*[f"{key}={value}" for key, value in keys.items()], timeout=420)
    assert proc.returncode == 0, output_of(proc)
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as fh:
        return [entry["loss"] for entry in map(json.loads, fh) if "loss" in entry]


def _resume_from(checkpoint, out) -> None:
    """A new output_dir holding only ``checkpoint`` (as a requeued job's would), resumed with auto."""
    os.makedirs(out)
    shutil.copytree(checkpoint, os.path.join(out, os.path.basename(checkpoint)))


def elastic_comparisons(model_dir: str, root, ds_file: str) -> list[Comparison]:
    """The uninterrupted 2-process run (saving every step), its step-2 checkpoint resumed on 1 process with
    accumulation 2, and (ZeRO-2) that run's step-3 checkpoint resumed on 2 processes again; also checks that
    the conversion sits in the checkpoint it resumed from only."""
    # HF takes save_steps from the checkpoint's trainer_state.json: every step, so the resumed run saves step 3
    full = _train(model_dir, root / "dp2", ds_file, 2, 1, save_steps=1)
    assert len(full) == 4
    _resume_from(root / "dp2" / "checkpoint-2", root / "dp1")
    shrunk = _train(model_dir, root / "dp1", ds_file, 1, 2, save_steps=1, resume_from_checkpoint="auto")
    converted = root / "dp1" / "checkpoint-2"
    assert (converted / "latest_universal").read_text() == "global_step2_universal"
    assert (converted / "global_step2_universal" / "zero" / "optimizer_state.pt").is_file()
    assert not (root / "dp2" / "checkpoint-2" / "latest_universal").exists()  # only where it resumed
    assert not (root / "dp1" / "checkpoint-3" / "latest_universal").exists()  # its own: an ordinary one
    compared = [Comparison(f"{ds_file}: DP2 -> DP1, steps 3-4", shrunk[-2:], full[2:], ELASTIC_RESUME)]
    if ds_file == "ds_z2.json":  # and back: the 1-process checkpoint of step 3 on 2 processes
        _resume_from(root / "dp1" / "checkpoint-3", root / "back")
        grown = _train(model_dir, root / "back", ds_file, 2, 1, resume_from_checkpoint="auto")
        compared.append(Comparison(f"{ds_file}: DP1 -> DP2, step 4", grown[-1:], full[3:], ELASTIC_RESUME))
    return compared


@pytest.mark.parametrize("ds_file", ["ds_z2.json", "ds_z3.json"])
def test_zero_checkpoint_resumes_on_another_number_of_processes(tiny_model_dir, tmp_path, ds_file):
    assert_within(elastic_comparisons(tiny_model_dir, tmp_path, ds_file))
