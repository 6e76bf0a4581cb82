"""roll.background_save in one process: the host copy, and a checkpoint that is published only once its writer
finished (the 2-process SIGKILL test on both backends is tests/distributed/test_reliability.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from roll import checkpoints
from roll.background_save import TEST_WRITE_DELAY_ENV, BackgroundSaves, host_copy


def test_host_copy_is_a_snapshot_that_keeps_ties_and_frozen_tensors():
    weight, frozen = torch.ones(3), torch.zeros(2)
    state = {"a": weight, "tied": weight, "nested": [frozen, (weight[:2], 4)], "step": 7}
    copy = host_copy(state, keep=lambda t: t.data_ptr() == frozen.data_ptr())
    weight.add_(1)  # training changes the weights in place after the copy
    assert copy["a"].tolist() == [1.0, 1.0, 1.0] and copy["tied"] is copy["a"]
    assert copy["nested"][0] is frozen and copy["nested"][1][0].tolist() == [1.0, 1.0]
    assert isinstance(copy["nested"][1], tuple) and copy["step"] == 7


def _start(saves: BackgroundSaves, out: str, step: int, gate: threading.Event | None = None, fail=False):
    staging = checkpoints.open_staging(out, step, is_writer=True)

    def write():
        if gate is not None:
            gate.wait(30)
        if fail:
            raise OSError("disk full")
        with open(os.path.join(staging, "weights.bin"), "wb") as fh:
            fh.write(b"w" * 100)

    saves.start(out, step, [write], is_writer=True, keep=1)


def test_published_only_after_the_writer_finished_and_older_ones_rotated(tmp_path):
    out, saves, gate = str(tmp_path), BackgroundSaves(), threading.Event()
    _start(saves, out, 2)
    assert saves.wait() == os.path.join(out, "checkpoint-2")
    _start(saves, out, 4, gate)
    assert saves.poll() is None and saves.pending  # still writing: checkpoint-2 stays the latest
    assert checkpoints.last_checkpoint(out) == os.path.join(out, "checkpoint-2")
    assert os.path.isdir(os.path.join(out, "checkpoint-4.tmp"))
    gate.set()
    assert saves.wait() == os.path.join(out, "checkpoint-4") and not saves.pending
    assert [os.path.basename(p) for _, p in checkpoints.checkpoint_dirs(out)] == ["checkpoint-4"]
    with open(os.path.join(out, "checkpoint-4", "weights.bin"), "rb") as fh:
        assert fh.read() == b"w" * 100
    assert not os.path.exists(os.path.join(out, "checkpoint-4.tmp"))


def test_a_failed_write_raises_and_publishes_nothing(tmp_path):
    out, saves = str(tmp_path), BackgroundSaves()
    _start(saves, out, 3, fail=True)
    with pytest.raises(OSError, match="disk full"):
        saves.wait()
    assert checkpoints.last_checkpoint(out) is None and not saves.pending


def test_the_test_hook_delays_the_write(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_WRITE_DELAY_ENV, "0.5")
    out, saves = str(tmp_path), BackgroundSaves()
    _start(saves, out, 1)
    assert saves.poll() is None  # held by the hook: nothing written, nothing published
    assert os.listdir(os.path.join(out, "checkpoint-1.tmp")) == []
    assert saves.wait() == os.path.join(out, "checkpoint-1")
