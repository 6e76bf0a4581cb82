"""roll.loss's kernel with the vocabulary split over 2 processes (gloo): the mca backend's TP > 1 loss."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO, output_of, results, torchrun

pytestmark = [pytest.mark.distributed]

LOG_PROB_BOUND = 2e-6
"""Absolute, against float64 ``log_softmax`` of the same float32 logits. Measured: 5.1e-7 on both ranks,
float32 rounding of log-probs up to ~20 in magnitude (eps 6e-8 x 20 / 2); 4x margin. Counting rank 1's
padding (logits 1e4) in the softmax moves log-probs by ~1e4."""
GRAD_BOUND = 1e-6
"""Absolute, gradients up to 2.1 in magnitude. Measured: 1.6e-7 and 1.7e-7 (float32 rounding); 6x margin."""


def test_vocab_split_over_two_ranks_with_padding_matches_float64_log_softmax():
    proc = torchrun(os.path.join(REPO, "tests", "distributed", "_vocab_parallel_loss.py"), timeout=180)
    assert proc.returncode == 0, output_of(proc)
    rows = sorted(results(proc.stdout), key=lambda row: row["rank"])
    assert [row["rank"] for row in rows] == [0, 1], output_of(proc)
    for row in rows:
        assert row["tokens"] == 56 and row["padding_grad_zero"], row
        assert row["log_prob_error"] < LOG_PROB_BOUND and row["grad_error"] < GRAD_BOUND, row
