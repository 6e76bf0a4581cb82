"""The stage table, build_job, and roll-train --dry-run on the demo data (tokenizer, dataset, collator)."""

from __future__ import annotations

import json
import os
import re

import pytest

from roll import router
from roll.config import parse_args
from roll.contract import TrainJob
from roll.data.collators import COLLATORS
from roll.data.formats import FORMATS
from roll.data.pipeline import PROCESSORS
from roll.data.policy import PaddingPolicy
from tests.helpers import REPO, output_of, roll_train

DEMO = {stage: f"recipes/demo/tiny_{stage}.yaml" for stage in ("pt", "sft", "dpo", "kto", "rm")}


def test_stage_table_names_real_processors_collators_and_formats():
    for stage, spec in router.STAGES.items():
        assert spec.processor in PROCESSORS, stage
        assert spec.collator in COLLATORS, stage
        assert set(spec.formats) <= set(FORMATS), stage


@pytest.mark.parametrize("stage", ["pt", "sft", "dpo", "kto", "rm"])
def test_build_job_for_each_stage(stage, tiny_model_dir, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.chdir(REPO)
    _, config = parse_args([DEMO[stage], f"model_name_or_path={tiny_model_dir}"])
    job, stats = router.build_job(config, PaddingPolicy(pad_to_multiple_of=8))
    assert isinstance(job, TrainJob) and job.stage == stage
    assert stats.num_samples > 0 and stats.num_dropped == 0
    batch = job.collator([job.train_dataset[i] for i in range(3)])
    rows = 6 if stage in ("dpo", "kto", "rm") else 3  # pairs: chosen and rejected stacked; kto: rows, mismatched rows
    assert batch["input_ids"].shape[0] == rows and batch["input_ids"].shape[1] % 8 == 0


def _count_rows(path: str) -> int:
    with open(os.path.join(REPO, path), encoding="utf-8") as handle:
        return len(json.load(handle))


def test_dry_run_json_with_packing(tiny_model_dir, tmp_path):
    proc = roll_train(DEMO["sft"], f"model_name_or_path={tiny_model_dir}", "packing=true", "cutoff_len=256",
                      "--dry-run", "--json", timeout=240, HF_DATASETS_CACHE=str(tmp_path))
    assert proc.returncode == 0, output_of(proc)
    summary = json.loads(proc.stdout)
    assert summary["num_samples"] == _count_rows("recipes/demo/data/arithmetic_sft.json")
    for key in ("num_dropped", "num_truncated", "num_tokens", "num_trainable_tokens", "preprocess_seconds"):
        assert isinstance(summary[key], (int, float)), key
    rows = summary["num_rows"]
    assert summary["packing_efficiency"] == pytest.approx(summary["num_tokens"] / (rows * 256))
    assert rows <= -(-summary["num_tokens"] // 256) + 1  # ~30-token samples: at most one bin more than needed
    assert summary["num_trainable_tokens"] < summary["num_tokens"]
    assert "cu_seqlens" in summary["batch_shapes"]


def test_dry_run_text_marks_the_trained_span(tiny_model_dir, tmp_path):
    proc = roll_train(DEMO["dpo"], f"model_name_or_path={tiny_model_dir}", "--dry-run", timeout=240,
                      HF_DATASETS_CACHE=str(tmp_path))
    assert proc.returncode == 0, output_of(proc)
    assert "packing efficiency: n/a" in proc.stdout
    # two pairs collate to four rows (chosen stacked over rejected), and the line says pairs
    assert re.search(r"collated batch of the first 2 pairs: input_ids \[4, \d+\]", proc.stdout), proc.stdout
    assert "--- chosen" in proc.stdout and "--- rejected" in proc.stdout
    # both sides: the prompt unmarked, exactly the answer + end-of-turn token marked
    marked = re.findall(r"What is \d plus \d\?<\|im_end\|>\n<\|im_start\|>assistant\n"
                        r"\[TRAIN>\d plus \d equals \d+\.<\|im_end\|><TRAIN\]", proc.stdout)
    assert len(marked) == 2, proc.stdout


def test_dry_run_reports_the_broken_row(tiny_model_dir, tmp_path):
    with open(os.path.join(REPO, "recipes/demo/data/arithmetic_sft.json"), encoding="utf-8") as handle:
        rows = json.load(handle)[:10]
    rows[6]["output"] = ["not", "a", "string"]
    bad = tmp_path / "broken.json"
    bad.write_text(json.dumps(rows))
    proc = roll_train(DEMO["sft"], f"model_name_or_path={tiny_model_dir}", f"dataset={bad}", "--dry-run",
                      timeout=240, HF_DATASETS_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 2, output_of(proc)
    assert "Traceback" not in proc.stderr
    assert f"{bad}, row 6 (0-based): column 'output' holds a list" in proc.stderr
