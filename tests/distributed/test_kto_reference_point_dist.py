"""KTO's reference point averaged over 2 data-parallel processes (gloo): what both backends all-reduce."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO, output_of, results, torchrun

pytestmark = [pytest.mark.distributed]


def test_reference_point_is_the_mean_of_the_ranks_means_over_real_rows_clamped():
    """TRL's ``gather_for_metrics(kl).mean().clamp(min=0)``: micro-batch 1, rank means 2 and 0 -> 1 (a filler
    row of 50 counts nothing); micro-batch 2, rank 1 all filler -> rank 0's mean 3 alone; micro-batch 3, means
    -1 and -3 -> clamped to 0. Every rank gets the same points."""
    proc = torchrun(os.path.join(REPO, "tests", "distributed", "_kto_reference_point.py"), timeout=120)
    assert proc.returncode == 0, output_of(proc)
    rows = sorted(results(proc.stdout), key=lambda row: row["rank"])
    assert [row["z"] for row in rows] == [[1.0, 3.0, 0.0]] * 2, output_of(proc)
