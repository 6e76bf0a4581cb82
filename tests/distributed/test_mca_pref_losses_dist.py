"""pref_loss orpo and simpo (reference-free; roll.preference) on Megatron: every logged metric of 5 steps equals
the standard backend's, and TP2 with a padded vocabulary, PP2 x VPP2 and CP2 equal TP1 x DP2. Real runs on
tiny models, CPU, gloo: the runs share their process launches with test_mca_dpo's (tests/distributed/conftest.py:
one standard process, one 2-process torchrun job)."""

from __future__ import annotations

import pytest

from roll.preference import METRICS
from tests.bounds import (BACKEND_PREF, BACKEND_PREF_REWARDS, PREF_LAYOUT, PREF_LAYOUT_REWARDS, Comparison,
                          assert_within)
from tests.distributed.test_mca_dpo import PreferenceRuns, preference_runs

pytestmark = [pytest.mark.distributed, pytest.mark.mca]
VARIANTS = {"orpo": {"pref_loss": "orpo"},
            "simpo": {"pref_loss": "simpo", "pref_beta": 2.0, "simpo_gamma": 0.3, "pref_ftx": 0.5}}
"""ORPO at LLaMA-Factory's defaults; SimPO at a beta of the paper's range, with an SFT term."""
ABSOLUTE = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "log_odds_ratio",
            "log_odds_chosen")
"""Metrics compared on the scale of 1 (they start near 0 or cross it); the others relative."""
LAYOUTS = {"orpo_tp2_padded": ("orpo", {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 384}),
           "simpo_pp2_vpp2": ("simpo", {"pipeline_model_parallel_size": 2,
                                        "virtual_pipeline_model_parallel_size": 2}),
           "orpo_cp2": ("orpo", {"context_parallel_size": 2})}


@pytest.fixture(autouse=True)
def _needs_megatron():
    pytest.importorskip("megatron.core")


def pref_specs(make_model) -> PreferenceRuns:
    """Each loss on the standard backend, and at TP1 x DP2 and the ``LAYOUTS`` on Megatron."""
    runs = [{"name": loss, "overrides": keys} for loss, keys in VARIANTS.items()]
    runs += [{"name": name, "overrides": {**VARIANTS[loss], **keys, "gradient_accumulation_steps": 2}}
             for name, (loss, keys) in LAYOUTS.items()]
    return PreferenceRuns(dict(VARIANTS), runs)


def pref_runs(make_model, root) -> tuple[dict, dict]:
    """``pref_specs``' runs alone: ({loss: standard log}, {name: Megatron run})."""
    return preference_runs(make_model, root, [pref_specs(make_model)])[0]


def metric_comparisons(label: str, log: list[dict], reference: list[dict], loss: str, bounds) -> list[Comparison]:
    """The loss and every metric of ``loss``, step by step (``bounds``: relative, absolute)."""
    return [Comparison(f"{label} {name}", [entry[name] for entry in log], [entry[name] for entry in reference],
                       bounds[name in ABSOLUTE], scale=1.0 if name in ABSOLUTE else 0.0)
            for name in ("loss", *METRICS[loss])]


def pref_comparisons(standard: dict, result: dict) -> list[Comparison]:
    comparisons = []
    for loss, log in standard.items():
        comparisons += metric_comparisons(f"{loss} vs standard", result[loss]["log"], log, loss,
                                          (BACKEND_PREF, BACKEND_PREF_REWARDS))
    for name, (loss, _) in LAYOUTS.items():
        comparisons += metric_comparisons(name, result[name]["log"], result[loss]["log"], loss,
                                          (PREF_LAYOUT, PREF_LAYOUT_REWARDS))
    return comparisons


def test_orpo_and_simpo_match_across_backends_and_layouts(preference_runs_of_the_session):
    """Standard vs Megatron at TP1 x DP2: the loss and every metric of 5 steps within the measured backend gap
    (orpo's nll_loss and odds-ratio terms too); TP2 with a padded vocabulary, PP2 x VPP2 and CP2 within the
    measured layout gap of TP1 x DP2; the losses move (the runs train)."""
    standard, result = preference_runs_of_the_session["pref"]
    assert_within(pref_comparisons(standard, result))
    for loss in VARIANTS:
        losses = [entry["loss"] for entry in standard[loss]]
        assert len(losses) == 5 and losses[-1] < losses[0] - 1e-3, (loss, losses)
