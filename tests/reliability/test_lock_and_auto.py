"""In-process (milliseconds): the output_dir lock (``roll.lock``) and ``resume_from_checkpoint: auto``.
The same behaviour with real roll-train processes is in tests/distributed/test_reliability.py."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from roll import lock
from roll.checkpoints import check_output_dir, prepare_output_dir, resolve_resume
from roll.errors import ConfigError


def test_a_second_holder_is_refused_naming_host_and_pid(tmp_path):
    held = lock.acquire(str(tmp_path))
    try:
        record = json.loads((tmp_path / lock.LOCK_NAME).read_text())
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        # flock is per open file: a second open, even in this process, is another run
        with pytest.raises(ConfigError, match=rf"is in use by another run: PID {os.getpid()} on "
                                              rf"{socket.gethostname()}"):
            lock.acquire(str(tmp_path), wait_s=0)
    finally:
        held.release()
    assert not (tmp_path / lock.LOCK_NAME).exists()
    lock.acquire(str(tmp_path)).release()  # free again


def test_the_lock_record_and_its_refusal_hold_no_secret(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["roll-train", "r.yaml", "hub_token=hf_SECRET", "--api_key", "k-SECRET"])
    held = lock.acquire(str(tmp_path))
    try:
        assert "SECRET" not in (tmp_path / lock.LOCK_NAME).read_text()
        with pytest.raises(ConfigError) as refused:
            lock.acquire(str(tmp_path), wait_s=0)
        assert "hub_token=<redacted>" in str(refused.value) and "SECRET" not in str(refused.value)
    finally:
        held.release()


def test_a_dead_holders_lock_is_taken_over_with_a_log_line(tmp_path, caplog, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    (tmp_path / lock.LOCK_NAME).write_text(json.dumps({"host": "node07", "pid": int(dead.stdout)}))
    monkeypatch.setattr(logging.getLogger("roll"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="roll")
    held = lock.acquire(str(tmp_path))
    held.release()
    assert f"left by PID {int(dead.stdout)} on node07" in caplog.text and "no longer running" in caplog.text


def test_a_lock_held_by_the_orphans_of_a_dead_roll_train_is_waited_for(tmp_path, caplog, monkeypatch):
    """The file names a PID that is gone, but a process still holds the lock (a killed roll-train's ranks)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)"],
                              stdin=subprocess.DEVNULL)
    try:
        held = lock.acquire(str(tmp_path))
        os.set_inheritable(held.fd, True)
        # the orphan: a process that inherited the lock, as the launcher and ranks inherit it as stdin
        orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=held.fd)
        os.close(held.fd)
        record = {"host": socket.gethostname(), "pid": holder.pid, "started": 0.0}  # start time: not this one
        (tmp_path / lock.LOCK_NAME).write_text(json.dumps(record))
        monkeypatch.setattr(logging.getLogger("roll"), "propagate", True)
        caplog.set_level(logging.WARNING, logger="roll")
        with pytest.raises(ConfigError, match="still in use by the launcher or ranks of a killed run"):
            lock.acquire(str(tmp_path), wait_s=1.0)
        assert "waiting up to 1 s" in caplog.text
        orphan.kill()
        orphan.wait()
        lock.acquire(str(tmp_path), wait_s=1.0).release()  # gone: taken over
    finally:
        holder.kill()
        holder.wait()


def test_a_requeued_slurm_job_waits_for_its_earlier_run_instead_of_refusing(tmp_path, caplog, monkeypatch):
    """SLURM requeues a job under the same SLURM_JOB_ID; its earlier run may still hold the lock (on another
    node, until SLURM's SIGKILL): the rerun waits for it. Another job's live run is refused at once."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    held = lock.acquire(str(tmp_path))  # the first run of job 77 records its job and restart count
    record = json.loads((tmp_path / lock.LOCK_NAME).read_text())
    assert (record["slurm_job"], record["slurm_restart"]) == ("77", 0)
    os.set_inheritable(held.fd, True)
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=held.fd)
    os.close(held.fd)  # only the earlier run's process holds it now: alive, as until KillWait ends
    record.update(host="node07", pid=earlier.pid)  # on another node: never taken for an orphan of this host
    (tmp_path / lock.LOCK_NAME).write_text(json.dumps(record))
    monkeypatch.setattr(logging.getLogger("roll"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="roll")
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):  # the same job, not requeued
            lock.acquire(str(tmp_path), wait_s=1.0)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with pytest.raises(ConfigError, match="after 1 s"):
            lock.acquire(str(tmp_path), wait_s=1.0)
        assert "earlier run of this requeued SLURM job 77" in caplog.text
        monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job: refused, no wait
        with pytest.raises(ConfigError, match="is in use by another run"):
            lock.acquire(str(tmp_path), wait_s=30.0)
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        earlier.kill()
        earlier.wait()
        lock.acquire(str(tmp_path), wait_s=1.0).release()
    finally:
        earlier.kill()
        earlier.wait()


def test_who_takes_the_lock():
    one_node, node1 = SimpleNamespace(nnodes=1, node_rank=None), SimpleNamespace(nnodes=2, node_rank=1)
    clean = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "ROLL_LAUNCHED", "RANK")}
    assert lock.takes_lock(one_node, clean) and not lock.takes_lock(node1, clean)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "ROLL_LAUNCHED"):
            mp.delenv(key, raising=False)
        mp.setenv("LOCAL_RANK", "0")
        mp.setenv("WORLD_SIZE", "2")
        for rank, takes in (("0", True), ("1", False)):  # the user's own torchrun: global rank 0
            assert lock.takes_lock(one_node, {**os.environ, "RANK": rank}) is takes
        mp.setenv("ROLL_LAUNCHED", "1")  # under roll-train's launcher: the parent holds it for everyone
        assert not lock.takes_lock(one_node, {**os.environ, "RANK": "0"})


def test_an_output_dir_that_cannot_be_created_is_a_config_error(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        lock.acquire(str(tmp_path / "a_file" / "out"))


def test_an_output_dir_the_run_created_is_removed_again_while_empty(tmp_path):
    """A run that fails before writing anything (a mistake found after the lock, e.g. by the ranks) leaves
    the file system as it found it: the directories the lock created go on release, each only while empty."""
    lock.acquire(str(tmp_path / "a" / "b" / "out")).release()
    assert os.listdir(tmp_path) == []
    (tmp_path / "mine").mkdir()
    held = lock.acquire(str(tmp_path / "mine" / "out"))
    (tmp_path / "mine" / "out" / "train_log.jsonl").write_text("")
    held.release()
    assert os.listdir(tmp_path / "mine" / "out") == ["train_log.jsonl"]  # a run that wrote keeps its output
    lock.acquire(str(tmp_path / "mine")).release()  # it existed: kept, though empty of the lock now
    assert (tmp_path / "mine").is_dir()


def _training(out, resume=None, overwrite=False):
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume, overwrite_output_dir=overwrite)


def test_auto_resumes_the_latest_complete_checkpoint_or_starts_fresh(tmp_path):
    assert resolve_resume("auto", str(tmp_path / "missing")) is None
    (tmp_path / "checkpoint-1.tmp").mkdir()  # a save killed before the first checkpoint was published
    (tmp_path / "train_log.jsonl").write_text("{}\n")
    assert resolve_resume("auto", str(tmp_path)) is None
    assert prepare_output_dir(_training(tmp_path, "auto"), is_rank0=True) == []
    with pytest.raises(ConfigError, match="holds no checkpoint-N"):
        resolve_resume("true", str(tmp_path))
    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-12.tmp").mkdir()
    assert resolve_resume(" Auto ", str(tmp_path)) == str(tmp_path / "checkpoint-10")
    check_output_dir(_training(tmp_path, "auto"))  # resuming: not refused
    assert prepare_output_dir(_training(tmp_path, "auto", overwrite=True), is_rank0=True) == []  # kept


def test_auto_without_a_checkpoint_still_refuses_a_finished_model(tmp_path):
    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(ConfigError, match="already holds a trained model"):
        check_output_dir(_training(tmp_path, "auto"))
