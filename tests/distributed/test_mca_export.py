"""The HF export of a Megatron run is the trained model: train -> export -> reload with transformers -> the
same logits as the trained model's final state. At TP2, PP2 and DP2, each with the distributed optimizer,
overlap_grad_reduce and overlap_param_gather (the options that defer the last update's all-gather), in one
2-process torchrun job (tests/distributed/_mca_workers/export_checks.py). Also: the overlap options do not
change DP2's losses."""

from __future__ import annotations

import pytest

from tests.bounds import EXPORT_LOGITS, LAYOUT, Comparison, assert_within
from tests.distributed.test_mca_train import SFT, train_runs

pytestmark = [pytest.mark.distributed, pytest.mark.mca]
OVERLAP = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}
EXPORT_RUNS = [
    {"name": "tp2", "overrides": {**OVERLAP, "tensor_model_parallel_size": 2}},
    {"name": "pp2", "overrides": {**OVERLAP, "pipeline_model_parallel_size": 2}},
    {"name": "dp2", "overrides": OVERLAP},
    {"name": "dp2_plain", "overrides": {"use_distributed_optimizer": True}},
]


@pytest.fixture(autouse=True)
def _needs_megatron():
    pytest.importorskip("megatron.core")


def export_runs(model_dir: str, root) -> dict:
    """The three layouts trained 3 steps and exported, and DP2 without the overlap options; {layout: the
    worker's measurements}."""
    base = {**SFT, "model_name_or_path": model_dir, "max_steps": 3, "learning_rate": 1e-2,
            "output_dir": str(root / "out")}
    runs = [{"name": run["name"], "overrides": {**run["overrides"], "output_dir": str(root / run["name"])}}
            for run in EXPORT_RUNS]
    return train_runs(root, base, runs, worker="export_checks.py")


def overlap_comparison(result: dict) -> Comparison:
    """The overlap options change when gradients are reduced and weights gathered, not the losses."""
    return Comparison("dp2 with overlap", result["dp2"]["losses"], result["dp2_plain"]["losses"],
                      LAYOUT["overlap"])


def test_the_export_equals_the_trained_model_at_tp2_pp2_dp2(tiny_model_dir, tmp_path):
    """The export's logits equal the trained model's within EXPORT_LOGITS (relative to the largest logit);
    the last optimizer step moved those logits by over 100x that bound, so an export one step stale (or
    one that skipped the forced all-gather of the distributed optimizer's shards) fails here."""
    result = export_runs(tiny_model_dir, tmp_path)
    assert sorted(result) == ["dp2", "dp2_plain", "pp2", "tp2"], result
    assert_within([overlap_comparison(result)])
    for name, run in result.items():
        bound = EXPORT_LOGITS.rel * run["logit_scale"]
        assert len(run["losses"]) == 3 and run["losses"][-1] < run["losses"][0], (name, run["losses"])
        assert run["last_step_moved"] > 100 * bound, (name, run)  # a stale export would show
        assert run["export_vs_trained"] <= bound, (
            f"{name}: the exported model's logits differ from the trained model's by "
            f"{run['export_vs_trained']:.3e} (bound {bound:.3e}; the last step moved them by "
            f"{run['last_step_moved']:.3e}): the export is not "
            "the final state")
