"""The backend-agnostic pieces of roll.reliability, roll.checkpoints and roll.launch's status reports."""

from __future__ import annotations

import os
import signal

import pytest

from roll import checkpoints, launch, reliability
from roll.errors import EXIT_HUNG, EXIT_PREEMPTED, EXIT_USAGE, Diverged


def test_global_batch_samples_follow_the_epoch_and_its_short_tail():
    # 10 samples, global batch 4: steps of an epoch take [0,4), [4,8), [8,10); then the next epoch
    assert [list(reliability.global_batch_samples(step, 4, 10)) for step in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_skip_counter_stops_after_n_in_a_row_and_names_step_and_samples():
    counter = reliability.SkipCounter(limit=3)
    counter.record(True, 1, range(0, 4))
    counter.record(False, 2)  # a good step resets the streak
    counter.record(True, 3, range(8, 12))
    counter.record(True, 4, range(12, 16))
    with pytest.raises(Diverged) as err:
        counter.record(True, 5, [16, 17, 18, 20])
    message = str(err.value)
    assert "step 5" in message and "3 steps in a row" in message and "16-18, 20" in message
    assert "max_consecutive_skipped_steps" in message and counter.total == 4


def test_skip_counter_limit_zero_never_stops():
    counter = reliability.SkipCounter(limit=0)
    for step in range(1, 50):
        counter.record(True, step)
    assert counter.consecutive == 49


def test_collective_failures_become_hung_with_rank_and_activity(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    reliability.set_activity("training step 7")
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    hung = reliability.collective_failure(timeout, 5)
    assert hung is not None and "rank 1" in str(hung) and "training step 7" in str(hung)
    assert "ddp_timeout=5s" in str(hung)
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3984")
    assert "lost a peer" in str(reliability.collective_failure(peer))
    assert reliability.collective_failure(RuntimeError("shape mismatch")) is None
    assert reliability.collective_failure(ValueError("Timed out")) is None


def test_stop_signal_sets_the_flag_once_then_the_second_signal_acts(monkeypatch):
    # Python's own SIGINT handler underneath, whatever an earlier test or the CI shell left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = reliability.StopSignal()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.requested() and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # the second one: Python's default SIGINT handler
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
        signal.signal(signal.SIGINT, previous)


def test_the_second_signal_stops_a_run_started_with_sigint_ignored():
    """`roll-train ... &` from a script or nohup: the shell starts it with SIGINT ignored (Python keeps
    SIG_IGN). The first SIGINT still asks for save-and-stop, and the second still stops at once."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = reliability.StopSignal()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
        signal.signal(signal.SIGINT, previous)


def test_under_slurm_a_burst_of_signals_is_one_stop(monkeypatch):
    """SLURM signals every process of a step, srun and the launcher forward it again: within BURST_S the
    repeats are one request; after it, the second signal still stops at once. Outside SLURM: at once."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    stop = reliability.StopSignal()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # srun's forwarded copy
        except KeyboardInterrupt:  # (pytest would take it for the user's Ctrl-C and stop the session)
            pytest.fail("the second signal of a SLURM burst stopped at once")
        assert stop.signum == signal.SIGINT and stop.poll() is reliability.Action.STOP
        monkeypatch.setattr(reliability, "BURST_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
        signal.signal(signal.SIGINT, previous)


def test_the_early_warning_saves_and_trains_on_or_stops_for_a_requeue():
    previous = signal.getsignal(signal.SIGTERM)
    stop = reliability.StopSignal()
    stop.install(warning=signal.SIGUSR1)
    try:
        assert stop.poll() is reliability.Action.CONTINUE
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.poll() is reliability.Action.SAVE  # once: the next step trains on
        assert stop.poll() is reliability.Action.CONTINUE and stop.signum is None
        stop.install(warning=signal.SIGUSR1, requeue=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.poll() is reliability.Action.STOP and stop.requeued and stop.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # SLURM stopping the requeued job: expected, ignored
    finally:
        stop.uninstall()
    # the requeued process ends with SIGTERM ignored (it has nothing left to save)
    ignored = signal.signal(signal.SIGTERM, previous)
    assert ignored == signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_installing_the_stop_handler_twice_still_restores_the_original_handlers():
    """Two in-process runs install it twice: uninstall must restore the caller's handler, not its own."""
    original = signal.getsignal(signal.SIGINT)
    stop = reliability.StopSignal()
    stop.install()
    stop.install()
    stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is original


def _make_checkpoint(output_dir, step: int) -> str:
    path = os.path.join(output_dir, f"checkpoint-{step}")
    os.makedirs(path)
    with open(os.path.join(path, "weights"), "w") as fh:
        fh.write(str(step))
    return path


def test_the_stop_polls_host_group_goes_with_the_default_group(tmp_path, monkeypatch):
    """Under an NCCL default group ``host_group`` makes one gloo group and reuses it, but holds no reference
    that outlives ``destroy_process_group``: a group still alive then was destroyed at interpreter exit, where
    its gloo threads aborted one 2-rank run in four ("terminate called without an active exception")."""
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        group = reliability.host_group()
        assert group is not None and reliability.host_group() is group
        world, made = weakref.ref(dist.group.WORLD), weakref.ref(group)
        del group
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert made() is None and world() is None


def test_publish_rotate_and_clean_stale_never_leave_a_partial_checkpoint_name(tmp_path):
    out = str(tmp_path)
    for step in (1, 2):
        _make_checkpoint(out, step)
    tmp = os.path.join(out, "checkpoint-3.tmp")
    os.makedirs(tmp)
    assert checkpoints.last_checkpoint(out).endswith("checkpoint-2")  # a .tmp is never picked
    checkpoints.publish(tmp, os.path.join(out, "checkpoint-3"))
    assert checkpoints.last_checkpoint(out).endswith("checkpoint-3") and not os.path.exists(tmp)
    assert [os.path.basename(p) for p in checkpoints.rotate(out, 2)] == ["checkpoint-1"]
    os.makedirs(os.path.join(out, "checkpoint-9.tmp"))  # a killed save
    os.makedirs(os.path.join(out, "checkpoint-2.old"))  # a killed rotation
    removed = checkpoints.clean_stale(out)
    assert sorted(os.path.basename(p) for p in removed) == ["checkpoint-2.old", "checkpoint-9.tmp"]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-3"]


def test_status_reports_pick_the_most_telling_code(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.STATUS_DIR_ENV, str(tmp_path))
    for rank, code, message in ((0, EXIT_PREEMPTED, "stopped"), (1, EXIT_USAGE, "bad key")):
        monkeypatch.setenv("RANK", str(rank))
        launch.write_status(code, message)
    statuses = launch.read_statuses(str(tmp_path))
    assert launch.summarize(statuses, range(2), 1) == launch.Outcome(EXIT_USAGE, "bad key")
    assert launch.summarize({0: statuses[0]}, range(2), 0) == launch.Outcome(EXIT_PREEMPTED, "stopped")
    # a rank that died without a report: named, and the survivors' "lost a peer" explains the rest
    dead = launch.summarize({0: {"code": EXIT_HUNG, "message": "rank 0: lost a peer"}}, range(2), 1)
    assert dead.code == EXIT_HUNG and "rank 1 ended without a report" in dead.message
    assert launch.summarize({}, range(2), 0) == launch.Outcome(0)
    assert launch.summarize({}, range(2), -9).code == -9
