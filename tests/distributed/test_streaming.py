"""Streaming (``streaming: true``) trains both backends on the same rows in the same order, across a resume.

One recipe exercises the whole streamed path: two datasets mixed ``interleave_over`` with
``interleave_probs``, a shuffle buffer smaller than the data, packing on the fly, and more steps than one pass
over the data holds (the stream starts its next epoch). The standard backend runs in this process, the mca
backend at TP1 x DP2 in one 2-process torchrun job (the same global batch of 2 rows, one per rank); each
resumes mid-stream from its step-3 checkpoint. The standard backend also trains on 2 processes (roll-train). On two processes only local rank 0 reads the stream; the
other rank gets its rows through the node's spool (roll.data.stream_share) and tokenizes nothing.
"""

from __future__ import annotations

import json

import pytest

from tests.bounds import BACKEND, Comparison, assert_within
from tests.distributed.test_mca_train import standard_log, train_runs

pytestmark = [pytest.mark.distributed, pytest.mark.mca]


def _rows(first: int, count: int) -> list[dict]:
    return [{"instruction": f"What is {a} plus {a + 3}?", "output": f"{a} plus {a + 3} equals {2 * a + 3}."}
            for a in range(first, first + count)]


def streaming_recipe(model_dir: str, tmp_path) -> dict:
    files = []
    for name, first, count in (("a.jsonl", 0, 8), ("b.jsonl", 40, 4)):
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in _rows(first, count)))
        files.append(str(path))
    # 12 rows, mixed interleave_over (~17 draws), packed in blocks of 5: ~10 packed rows a pass, so the 6 steps
    # of 2 rows run into the stream's second pass (reshuffled); the resume at step 3 replays 6 rows.
    return dict(stage="sft", model_name_or_path=model_dir, dataset=",".join(files), streaming=True,
                buffer_size=5, mix_strategy="interleave_over", interleave_probs="0.6,0.4", packing=True,
                cutoff_len=64,
                learning_rate=1e-3, per_device_train_batch_size=2, max_steps=6, logging_steps=1,
                save_strategy="steps", save_steps=3, save_hf_model=False, report_to="none", seed=3,
                disable_tqdm=True)


def _standard(recipe: dict, output_dir, **overrides) -> list[float]:
    from roll import router
    from roll.config.parser import resolve

    config = resolve({**recipe, "output_dir": str(output_dir), **overrides}, {}, None)
    router.run(config)
    # a resumed run logs only the steps it trained
    with open(output_dir / "train_log.jsonl", encoding="utf-8") as fh:
        return [record["loss"] for record in map(json.loads, fh) if "loss" in record]


def test_streaming_same_losses_on_both_backends_and_across_a_resume(tiny_model_dir, tmp_path):
    recipe = streaming_recipe(tiny_model_dir, tmp_path)
    full = _standard(recipe, tmp_path / "std")
    resumed = _standard(recipe, tmp_path / "std_resumed",
                        resume_from_checkpoint=str(tmp_path / "std" / "checkpoint-3"))
    assert len(full) == 6 and resumed == pytest.approx(full[3:], rel=1e-6), (full, resumed)
    # the standard backend on 2 processes (accelerate shards each global batch; rank 1 reads the spool)
    two = [r["loss"] for r in standard_log(tmp_path, recipe, "std_dp2", per_device_train_batch_size=1,
                                           nproc_per_node=2)]
    assert_within([Comparison("streamed sft, standard DP2 vs DP1", two, full, BACKEND)])
    mca_out = tmp_path / "mca"
    runs = train_runs(tmp_path, {**recipe, "output_dir": str(mca_out), "per_device_train_batch_size": 1}, [
        {"name": "full"},
        {"name": "resumed", "overrides": {"output_dir": str(tmp_path / "mca_resumed"),
                                          "resume_from_checkpoint": str(mca_out / "checkpoint-3")}}], nproc=2)
    assert runs["resumed"]["losses"] == pytest.approx(runs["full"]["losses"][3:], rel=1e-6), runs
    assert_within([Comparison("streamed sft, mca (DP2) vs standard", runs["full"]["losses"], full, BACKEND)])
    # local rank 0 read the 12 rows of the 6 steps (the resumed run replays the first 6), rank 1 none
    assert runs["full"]["stream_rows_read"] == [12, 0] and runs["resumed"]["stream_rows_read"] == [12, 0]
