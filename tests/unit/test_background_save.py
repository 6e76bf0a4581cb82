"""roll.background_save in one process: the host copy, the fence of a save that reads training's own tensors,
and a checkpoint that is published only once its writer finished (the 2-process SIGKILL test on both backends is tests/distributed/test_reliability.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from roll import checkpoints
from roll.background_save import TEST_READ_DELAY_ENV, TEST_WRITE_DELAY_ENV, BackgroundSaves, host_copy


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


def test_the_test_hooks_delay_the_write(tmp_path, monkeypatch):
    out, saves = str(tmp_path), BackgroundSaves()
    monkeypatch.setenv(TEST_READ_DELAY_ENV, "0.5")
    _start(saves, out, 1)
    assert saves.poll() is None  # held before the write: nothing written, nothing published
    assert os.listdir(os.path.join(out, "checkpoint-1.tmp")) == []
    assert saves.wait() == os.path.join(out, "checkpoint-1")
    monkeypatch.delenv(TEST_READ_DELAY_ENV)
    monkeypatch.setenv(TEST_WRITE_DELAY_ENV, "0.5")
    _start(saves, out, 2)
    staged = os.path.join(out, "checkpoint-2.tmp", "weights.bin")
    deadline = time.monotonic() + 10
    while not os.path.exists(staged) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(staged) and saves.poll() is None  # held after the write: not published
    assert saves.wait() == os.path.join(out, "checkpoint-2")


def test_a_live_save_holds_the_update_until_written_and_is_finalized_before_the_publish(tmp_path):
    """``live``: the writer reads training's own tensor; ``fence`` (before the optimizer step) returns only once
    it has, so the checkpoint holds the value of the save, not of the update. ``finalize`` runs once the writer
    finished, before the publish, and what it writes is in the checkpoint."""
    out, saves, gate, weight = str(tmp_path), BackgroundSaves(), threading.Event(), torch.ones(4)
    staging = checkpoints.open_staging(out, 5, is_writer=True)

    def write():
        gate.wait(30)
        torch.save(weight, os.path.join(staging, "weight.pt"))

    def finalize():
        assert not os.path.exists(os.path.join(out, "checkpoint-5"))
        with open(os.path.join(staging, "metadata"), "w") as fh:
            fh.write("written last")

    saves.start(out, 5, [write], is_writer=True, live=True, finalize=finalize)
    fenced = threading.Thread(target=lambda: (saves.fence(), weight.add_(1)))  # the step, after its fence
    fenced.start()
    fenced.join(0.3)
    assert fenced.is_alive() and weight.tolist() == [1.0] * 4  # the update waits for the writer
    gate.set()
    fenced.join(30)
    assert weight.tolist() == [2.0] * 4 and saves.fence_waits > 0.2
    final = saves.wait()
    assert torch.load(os.path.join(final, "weight.pt")).tolist() == [1.0] * 4
    with open(os.path.join(final, "metadata")) as fh:
        assert fh.read() == "written last"


def test_a_save_from_a_host_copy_does_not_hold_the_update(tmp_path):
    out, saves, gate = str(tmp_path), BackgroundSaves(), threading.Event()
    _start(saves, out, 6, gate)  # not live: its writes read a copy
    saves.fence()  # returns at once though the writer has not written
    assert saves.fence_waits == 0.0 and saves.poll() is None
    gate.set()
    assert saves.wait() == os.path.join(out, "checkpoint-6")
