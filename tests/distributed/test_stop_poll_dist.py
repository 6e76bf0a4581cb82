"""The per-step stop poll on a GPU run (NCCL default group) reads no device tensor: 2 gloo processes."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO, output_of, results, torchrun

pytestmark = [pytest.mark.distributed]


def test_the_stop_poll_all_reduces_a_host_tensor_over_one_gloo_group():
    """Under an NCCL default group ``max_over_ranks`` (the stop poll after every step, the background save's
    check) all-reduces a CPU tensor over a gloo group of all ranks, made once with the default group's timeout
    (``ddp_timeout``): no step waits for its device. The answers are the ranks' maxima, and a signal on rank 1
    stops both ranks."""
    proc = torchrun(os.path.join(REPO, "tests", "distributed", "_stop_poll.py"), timeout=120)
    assert proc.returncode == 0, output_of(proc)
    rows = sorted(results(proc.stdout), key=lambda row: row["rank"])
    assert [row["values"] for row in rows] == [[3, 5]] * 2, output_of(proc)
    assert [row["action"] for row in rows] == ["STOP"] * 2, output_of(proc)
    for row in rows:
        assert row["groups_made"] == ["gloo"], row
        assert row["calls"] == [{"device": "cpu", "default_group": False}] * 3, row
        assert row["timeout"] == 37, row
