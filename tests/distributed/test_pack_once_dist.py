"""Packed data is prepared once per node (issue 28): 2 gloo processes on one empty datasets cache."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO, output_of, results, torchrun

pytestmark = [pytest.mark.distributed]


def test_local_rank_0_packs_and_the_other_rank_loads_its_file(tiny_model_dir, tmp_path):
    """On a first start only local rank 0 writes the packed rows (the other rank waits, then memory-maps
    them); on a warm start nobody packs; every rank trains on the same packed rows both times."""
    proc = torchrun(os.path.join(REPO, "tests", "distributed", "_pack_once.py"), tiny_model_dir, timeout=180,
                    HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    assert proc.returncode == 0, output_of(proc)
    by_rank = {row["rank"]: row for row in results(proc.stdout)}
    assert by_rank[0]["writes"] == [1, 0], output_of(proc)
    assert by_rank[1]["writes"] == [0, 0], output_of(proc)
    first, warm = by_rank[0]["rows"]
    assert len(first) > 1 and max(map(len, first)) > 64 // 2, "the rows were not packed"
    assert first == warm == by_rank[1]["rows"][0] == by_rank[1]["rows"][1]
