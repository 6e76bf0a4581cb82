"""roll-train as the tasks of a SLURM job step, with srun's environment made by hand (no SLURM here; the real
loopback cluster's tests are tests/slurm/): two `roll-train` processes with SLURM_PROCID 0/1,
SLURM_STEP_NUM_TASKS=2, SLURM_LOCALID 0/1, SLURM_STEP_NODELIST=localhost and a job id are one 2-rank run
with the losses of `nproc_per_node=2`; they hold under SLURM's signals (SIGCONT+SIGTERM to every task, a
forwarded SIGTERM after it, the early warning with and without requeue); and the same command, rerun as a
requeued job (SLURM_RESTART_COUNT >= 1) without any resume key, resumes to the uninterrupted losses."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from roll import slurm
from roll.errors import EXIT_PREEMPTED
from tests.helpers import REPO, clean_env, wait_until

pytestmark = pytest.mark.distributed

TIMEOUT = 240
WRITE_DELAY = "4"
"""Seconds each background checkpoint write of the first run is held (``roll.background_save``'s test hook):
the ranks are still saving when the forwarded SIGTERM arrives 1 s after SLURM's."""
TOLERANCE = 1e-5
"""Resuming restores weights, optimizer, schedule, RNG and data position exactly; fp32 on CPU (as
tests/distributed/test_reliability.py)."""


def _args(model_dir: str, out: str, **extra) -> list[str]:
    keys = dict(model_name_or_path=model_dir, stage="sft", dataset="recipes/demo/data/arithmetic_sft.json",
                cutoff_len=64, output_dir=out, per_device_train_batch_size=2, learning_rate=1e-3,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", save_hf_model="false",
                report_to="none", disable_tqdm="true")
    keys.update(extra)
    return [f"{key}={value}" for key, value in keys.items()]


def _free_job_id() -> str:
    """A job id whose derived MASTER_PORT (``slurm.job_port``) is free now."""
    import socket

    for job in range(int(time.time()) % 1000, 2000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", slurm.job_port(str(job))))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no free port in roll.slurm's range")


class Step:
    """Two roll-train processes started as srun starts the tasks of `srun -n 2` on one node."""

    def __init__(self, args: list[str], log_dir: str, job: str, **env: str) -> None:
        self.logs = [os.path.join(log_dir, f"task{rank}.log") for rank in range(2)]
        self.procs = []
        for rank in range(2):
            slurm_env = dict(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
                             SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
                             SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1", SLURM_STEP_NODELIST="localhost",
                             SLURM_JOB_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2", **env)
            with open(self.logs[rank], "a", encoding="utf-8") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "roll.cli", *args], cwd=REPO,
                                                   env=clean_env(**slurm_env), stdout=log,
                                                   stderr=subprocess.STDOUT))

    def signal(self, *signums: int) -> None:
        for signum in signums:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signum)

    def finish(self, timeout: float = TIMEOUT) -> tuple[list[int], str]:
        try:
            for proc in self.procs:
                proc.wait(timeout=timeout)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        return [proc.returncode for proc in self.procs], self.text()

    def text(self) -> str:
        return "\n".join(open(log, encoding="utf-8").read() for log in self.logs)


def _records(out: str) -> list[dict]:
    path = os.path.join(out, "train_log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [entry for entry in map(json.loads, fh) if "loss" in entry]


def _steps(out: str) -> int:
    return max((entry["step"] for entry in _records(out)), default=0)


def _losses(out: str) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in _records(out)}  # a step logged again keeps its last


def _fake_scontrol(bin_dir, pid_file) -> str:
    """An `scontrol` that records its arguments and does what slurmctld does on `scontrol requeue`: SIGCONT
    and SIGTERM to every process of the job at once."""
    path = bin_dir / "scontrol"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {bin_dir}/scontrol.calls\n"
                    f"for pid in $(cat {pid_file}); do kill -CONT $pid; kill -TERM $pid; done\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


def test_srun_tasks_signal_burst_then_the_requeued_job_resumes(tiny_model_dir, tmp_path):
    out, job = str(tmp_path / "run"), _free_job_id()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = _fake_scontrol(bin_dir, tmp_path / "pids") + os.pathsep + os.environ["PATH"]

    # 1. srun -n 2: one run (each step logged once, by rank 0); the early warning saves and training goes on;
    #    then SLURM's SIGCONT+SIGTERM to both tasks, and srun's forwarded SIGTERM a second later, while the
    #    ranks still save (every background write is held WRITE_DELAY s): one stop, not "stop at once"
    first = Step(_args(tiny_model_dir, out, max_steps=10_000, slurm_signal="USR1"), str(tmp_path), job,
                 PATH=path, ROLL_TEST_CHECKPOINT_WRITE_DELAY=WRITE_DELAY)
    try:
        assert wait_until(lambda: _steps(out) >= 2, TIMEOUT), first.text()[-4000:]
        first.procs[0].send_signal(signal.SIGUSR1)  # `--signal=B:USR1`: one process of the step gets it
        assert wait_until(lambda: any(name.startswith("checkpoint-") and not name.endswith(".tmp")
                                      for name in os.listdir(out)), TIMEOUT), first.text()[-4000:]
        warned = _steps(out)
        assert wait_until(lambda: _steps(out) >= warned + 2, TIMEOUT), "training stopped after the warning"
        first.signal(signal.SIGCONT, signal.SIGTERM)
        time.sleep(1.0)
        first.signal(signal.SIGTERM)
        codes, text = first.finish()
    finally:
        first.finish(timeout=1) if any(p.poll() is None for p in first.procs) else None
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], text[-4000:]
    stopped = _steps(out)
    assert f"stopped by SIGTERM after step {stopped}" in text and "Traceback" not in text, text[-4000:]
    assert "from SLURM: RANK=0, WORLD_SIZE=2" in text and "part of the same stop" in text, text[-4000:]
    assert os.path.isdir(os.path.join(out, f"checkpoint-{stopped}")), os.listdir(out)
    assert [entry["step"] for entry in _records(out)] == list(range(1, stopped + 1))  # one run, not two

    # 2. requeued (SLURM_RESTART_COUNT=1), no resume key: resumes; the early warning with slurm_requeue saves,
    #    stops and requeues (the fake scontrol then signals both tasks, as slurmctld does)
    second = Step(_args(tiny_model_dir, out, max_steps=10_000, slurm_signal="USR1", slurm_requeue="true"),
                  str(tmp_path), job, PATH=path, SLURM_RESTART_COUNT="1")
    (tmp_path / "pids").write_text(" ".join(str(p.pid) for p in second.procs))
    assert wait_until(lambda: _steps(out) >= stopped + 2, TIMEOUT), second.text()[-4000:]
    second.procs[1].send_signal(signal.SIGUSR1)
    codes, text = second.finish()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], text[-4000:]
    requeued = _steps(out)
    assert f"SLURM_RESTART_COUNT=1): resume_from_checkpoint defaults to auto: resuming from {out}" in text
    assert "Traceback" not in text, text[-4000:]
    assert f"SLURM job {job} requeued" in text, text[-4000:]
    assert (bin_dir / "scontrol.calls").read_text().split() == ["requeue", job]
    assert os.path.isdir(os.path.join(out, f"checkpoint-{requeued}"))

    # 3. the requeued job's run: the same command, to the end; every step's loss is the uninterrupted run's.
    #    How many steps the stops above took depends on the machine's speed (steps go on while a save is held
    #    WRITE_DELAY s: hundreds on an idle machine), so the end and the uninterrupted run follow from them
    #    (the LR is constant: a step's loss does not depend on max_steps).
    end = requeued + 3
    third = Step(_args(tiny_model_dir, out, max_steps=end, slurm_signal="USR1", slurm_requeue="true"),
                 str(tmp_path), job, PATH=path, SLURM_RESTART_COUNT="2")
    codes, text = third.finish()
    assert codes == [0, 0], text[-4000:]
    ref_out = str(tmp_path / "reference")
    ref = subprocess.run([sys.executable, "-m", "roll.cli", *_args(tiny_model_dir, ref_out, max_steps=end,
                                                                  nproc_per_node=2)],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert ref.returncode == 0, ref.stderr[-4000:]
    reference = _losses(ref_out)
    losses = _losses(out)
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=TOLERANCE), (step, losses[step], loss)


def test_srun_tasks_are_one_mca_tp2_run(tiny_model_dir, tmp_path):
    """`srun -n 2 roll-train R --use-mca tensor_model_parallel_size=2`: today each task alone exits 2
    (tp(2) * ... != world_size(1)); now one TP2 run with the losses of `nproc_per_node=2` (measured equal)."""
    mca = dict(max_steps=3, tensor_model_parallel_size=2, use_mca="true")
    ref_out, out = str(tmp_path / "reference"), str(tmp_path / "run")
    ref = subprocess.run([sys.executable, "-m", "roll.cli", *_args(tiny_model_dir, ref_out, nproc_per_node=2,
                                                                  **mca)],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert ref.returncode == 0, ref.stderr[-4000:]
    codes, text = Step(_args(tiny_model_dir, out, **mca), str(tmp_path), _free_job_id()).finish()
    assert codes == [0, 0], text[-4000:]
    want, got = _losses(ref_out), _losses(out)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=TOLERANCE), (step, got[step], loss)
