"""What is left when a 2-process run dies, is preempted, diverges or hangs — on both backends.

- SIGKILL of every process at seeded random moments inside checkpoint saves (10 trials): each restart with
  ``resume_from_checkpoint: true`` finds a complete checkpoint, and the per-step losses of the whole
  chain equal an uninterrupted run's;
- SIGKILL inside an asynchronous save (``save_async``, held open by a test hook): the run resumes from the
  previous checkpoint, and resuming from a background-written or a synchronous checkpoint gives the same
  losses;
- SIGTERM to roll-train: every rank finishes its step, a checkpoint is written, exit code 75; resuming
  gives the uninterrupted run's losses;
- a model whose loss is NaN: every step skipped and counted, then exit code 3 naming the step and samples;
- a rank killed (dead peer) or stopped (hang, ddp_timeout=10 s): the others end with exit code 4 and a
  message naming the rank and what it was doing, instead of waiting forever.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from roll.errors import EXIT_DIVERGED, EXIT_HUNG, EXIT_PREEMPTED
from tests.helpers import REPO, clean_env, wait_until

pytestmark = pytest.mark.distributed

TIMEOUT = 240
TOLERANCE = 1e-5
"""Resuming restores weights, optimizer, LR schedule, RNG and data position exactly; fp32 on CPU."""


def _args(model_dir: str, out: str, use_mca: bool, **extra) -> list[str]:
    keys = dict(model_name_or_path=model_dir, stage="sft", dataset="recipes/demo/data/arithmetic_sft.json",
                cutoff_len=64, output_dir=out, per_device_train_batch_size=2, nproc_per_node=2,
                learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                save_hf_model="false", report_to="none", disable_tqdm="true", use_mca=str(use_mca).lower())
    keys.update(extra)
    return [f"{key}={value}" for key, value in keys.items()]


def _start(args: list[str], log_path: str, **env: str) -> subprocess.Popen:
    log = open(log_path, "a", encoding="utf-8")
    return subprocess.Popen([sys.executable, "-m", "roll.cli", *args], cwd=REPO, env=clean_env(**env),
                            stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log_path: str, timeout: float = TIMEOUT) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    finally:
        _kill_tree(proc)
    with open(log_path, encoding="utf-8") as fh:
        return proc.returncode, fh.read()


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        parent = psutil.Process(proc.pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL roll-train, its launcher and every rank at once: what a dying node does to a job."""
    procs = _tree(proc)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait(timeout=30)


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for p in _tree(proc)[1:]:
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "roll.cli" in cmdline and "roll.torchrun" not in cmdline:
            found.append(p)
    return found


def _rank_process(proc: subprocess.Popen, rank: int) -> psutil.Process:
    for p in _ranks(proc):
        try:
            if p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"rank {rank} not found")


def _steps_logged(out: str) -> int:
    path = os.path.join(out, "train_log.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        steps = [json.loads(line).get("step", 0) for line in fh if line.strip()]
    return max(steps, default=0)


def _losses(out: str) -> dict[int, float]:
    """step -> loss; a step logged again after a resume keeps its last value."""
    losses = {}
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as fh:
        for entry in map(json.loads, fh):
            if "loss" in entry:
                losses[entry["step"]] = entry["loss"]
    return losses


def _records_per_step(out: str) -> dict[int, int]:
    """step -> how many training records train_log.jsonl holds for it (a step after a resume: two)."""
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as fh:
        steps = [entry["step"] for entry in map(json.loads, fh) if "loss" in entry]
    return {step: steps.count(step) for step in set(steps)}


STEPS = 40
"""Steps of the uninterrupted reference run. The LR is constant, so a run stopped early may have been started
with a larger max_steps (it must not finish before it is stopped) and be resumed to STEPS."""


@pytest.fixture(scope="module")
def reference(tiny_model_factory, tmp_path_factory):
    """``reference(use_mca)``: the per-step losses of an uninterrupted 2-process run of STEPS steps."""
    cache: dict[bool, dict[int, float]] = {}

    def run(use_mca: bool) -> dict[int, float]:
        if use_mca not in cache:
            out = str(tmp_path_factory.mktemp("reference") / "out")
            proc = _start(_args(tiny_model_factory("qwen2"), out, use_mca, max_steps=STEPS), out + ".log")
            code, log = _finish(proc, out + ".log")
            assert code == 0, log[-4000:]
            cache[use_mca] = _losses(out)
        return cache[use_mca]

    return run


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=TOLERANCE), (step, got[step], want[step])


@pytest.mark.parametrize("use_mca", [False, True], ids=["standard", "mca"])
def test_sigkill_during_checkpoint_saves_always_resumes(tiny_model_dir, tmp_path, use_mca, reference):
    """5 trials per backend, chained, every start the same command (``resume_from_checkpoint=auto``, as a
    requeued job reruns it): the first kill lands inside the very first save, which leaves no checkpoint
    (``auto`` then starts fresh); each later restart resumes from what the previous kill left."""
    trials = 5
    rng = random.Random(1234 + use_mca)
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")

    def args(max_steps: int = 10_000) -> list[str]:
        return _args(tiny_model_dir, out, use_mca, max_steps=max_steps, save_strategy="steps", save_steps=1,
                     save_total_limit=2, resume_from_checkpoint="auto")

    def has_checkpoint() -> bool:
        return bool(glob.glob(os.path.join(out, "checkpoint-*[0-9]")))

    def saving() -> bool:
        return bool(glob.glob(os.path.join(out, "checkpoint-*.tmp")))

    _kill_inside_the_first_save(lambda: _start(args(), log), out, log)
    left_partial = 1
    for _ in range(1, trials):
        proc = _start(args(), log)
        try:
            target = _steps_logged(out) + rng.randint(1, 2)
            assert wait_until(lambda: _steps_logged(out) >= target, TIMEOUT, 0.05), open(log).read()[-4000:]
            procs = _tree(proc)  # listed before, so the kill itself is immediate
            for _ in range(100):  # a tiny model saves in milliseconds: retry until a kill lands inside a save
                assert wait_until(saving, 30, 0.001), "no checkpoint save started"
                time.sleep(rng.uniform(0.0, 0.01))
                if saving():
                    break
            for p in procs:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        finally:
            _kill_tree(proc)
        left_partial += saving()
    assert _steps_logged(out) < STEPS, "the kills came too late to check the resumed steps"
    code, text = _finish(_start(args(STEPS), log), log)
    assert code == 0, text[-4000:]
    assert left_partial >= trials // 2, f"only {left_partial} of {trials} kills landed inside a save"
    assert "left by a save that did not finish" in text
    assert not glob.glob(os.path.join(out, "checkpoint-*.tmp"))
    _assert_same_losses(_losses(out), reference(use_mca))
    # resuming a finished run trains nothing (HF 5.23 alone would train one step past max_steps)
    code, text = _finish(_start(args(STEPS), log), log)
    assert code == 0, text[-4000:]
    _assert_same_losses(_losses(out), reference(use_mca))


def _kill_inside_the_first_save(start, out: str, log: str, attempts: int = 5) -> None:
    """Start a run and SIGKILL all its processes while checkpoint-1 is being written: the output_dir then
    holds checkpoint-1.tmp and no checkpoint (the case a requeued job with ``resume_from_checkpoint: true``
    could not continue from). The processes are frozen first, so what is on disk is checked before the kill."""
    for _ in range(attempts):
        shutil.rmtree(out, ignore_errors=True)
        proc = start()
        try:
            assert wait_until(lambda: len(_ranks(proc)) == 2, TIMEOUT, 0.05), open(log).read()[-4000:]
            procs = _tree(proc)
            assert wait_until(lambda: os.path.isdir(os.path.join(out, "checkpoint-1.tmp")), TIMEOUT, 0.001)
            for p in procs:
                p.suspend()
            inside = not os.path.isdir(os.path.join(out, "checkpoint-1"))
        finally:
            _kill_tree(proc)
        if inside:
            return
    raise AssertionError(f"no kill of {attempts} landed inside the first save")


WRITE_DELAY = "4"
"""Seconds every background checkpoint write is held after its files are written (``roll.background_save``'s test
hook) in the async test: longer than the tiny model's few steps between two saves, so the kill lands inside a
write every time."""
READ_DELAY = "1"
"""Seconds every background writer waits before it writes (the other hook): longer than a tiny step, so a save
that let the next optimizer step change the weights it reads (no ``fence``) would write a later step's."""


@pytest.mark.parametrize("use_mca", [False, True], ids=["standard", "mca"])
def test_sigkill_inside_an_async_save_resumes_as_a_sync_save_does(tiny_model_dir, tmp_path, use_mca,
                                                                   reference):
    """``save_async`` (on by default), each background write held READ_DELAY s before and WRITE_DELAY s after
    its files are written: the update after a save waits while the writer reads the live weights (CPU), then
    training goes on while checkpoint-4.tmp is finished (step 5 is logged before checkpoint-4 exists; a save
    that blocked training could not do that), and a SIGKILL then leaves checkpoint-2 the latest. A chain of
    the same command with ``resume_from_checkpoint: auto``: run 2 resumes from the background-written
    checkpoint-2 and saves synchronously (``save_async: false``) at steps 4 and 6; run 3 resumes from that
    synchronous checkpoint-6 to step 10. Every step's loss equals the uninterrupted run's: a checkpoint
    written in the background holds what a synchronous one holds."""
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")

    def args(max_steps: int, **extra) -> list[str]:
        return _args(tiny_model_dir, out, use_mca, max_steps=max_steps, save_strategy="steps", save_steps=2,
                     resume_from_checkpoint="auto", **extra)

    def ckpt(name: str) -> bool:
        return os.path.isdir(os.path.join(out, name))

    def inside_the_second_save() -> bool:
        return ckpt("checkpoint-4.tmp") and not ckpt("checkpoint-4") and _steps_logged(out) >= 5

    proc = _start(args(10_000), log, ROLL_TEST_CHECKPOINT_WRITE_DELAY=WRITE_DELAY,
                  ROLL_TEST_CHECKPOINT_READ_DELAY=READ_DELAY)
    try:
        assert wait_until(inside_the_second_save, TIMEOUT, 0.02), open(log).read()[-4000:]
        for p in _tree(proc):
            p.suspend()  # frozen, so what is on disk is what the kill leaves
        assert ckpt("checkpoint-2") and not ckpt("checkpoint-4"), os.listdir(out)
    finally:
        _kill_tree(proc)
    code, text = _finish(_start(args(6, save_async="false"), log), log)
    assert code == 0, text[-4000:]
    assert "checkpoint-4.tmp, left by a save that did not finish" in text
    logged = _records_per_step(out)  # a resumed run appends to train_log.jsonl, a fresh one empties it
    assert (logged[2], logged[3]) == (1, 2), f"run 2 did not continue from checkpoint-2: {logged}"
    code, text = _finish(_start(args(10), log), log)
    assert code == 0, text[-4000:]
    assert ckpt("checkpoint-10") and not glob.glob(os.path.join(out, "checkpoint-*.tmp")), os.listdir(out)
    _assert_same_losses(_losses(out), {step: loss for step, loss in reference(use_mca).items() if step <= 10})


@pytest.mark.parametrize("use_mca", [False, True], ids=["standard", "mca"])
def test_sigterm_saves_a_checkpoint_exits_75_and_resumes(tiny_model_dir, tmp_path, use_mca, reference):
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")
    steps = STEPS
    # a schedule that does not depend on max_steps, so the stopped run can be long and the resumed one short
    proc = _start(_args(tiny_model_dir, out, use_mca, max_steps=10_000), log)
    try:
        assert wait_until(lambda: _steps_logged(out) >= 3, TIMEOUT, 0.05), open(log).read()[-4000:]
        proc.send_signal(signal.SIGTERM)
        code, text = _finish(proc, log, timeout=120)
    finally:
        _kill_tree(proc)
    assert code == EXIT_PREEMPTED, text[-4000:]
    stopped = _steps_logged(out)
    assert f"stopped by SIGTERM after step {stopped}" in text and "Traceback" not in text
    assert os.path.isdir(os.path.join(out, f"checkpoint-{stopped}")), os.listdir(out)
    assert stopped < steps - 1, "stopped too late to check the resumed steps"
    resumed = _args(tiny_model_dir, out, use_mca, max_steps=steps, resume_from_checkpoint="true")
    code, text = _finish(_start(resumed, log), log)
    assert code == 0, text[-4000:]
    _assert_same_losses(_losses(out), reference(use_mca))


def test_one_run_per_output_dir(tiny_model_dir, tmp_path, reference):
    """A second run on a live run's output_dir exits 2 naming it, and the first goes on unharmed (its losses
    are the uninterrupted run's). Then the first's roll-train is SIGKILLed while its launcher and ranks are
    frozen (alive, as until the parent-death signal has stopped them): the same command again waits for
    them instead of writing next to them, and once they are gone takes the lock over, resumes (``auto``)
    and finishes."""
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")

    def args(max_steps: int) -> list[str]:
        return _args(tiny_model_dir, out, False, max_steps=max_steps, save_strategy="steps", save_steps=2,
                     resume_from_checkpoint="auto")

    first, orphans = _start(args(10_000), log), []
    try:
        assert wait_until(lambda: _steps_logged(out) >= 2, TIMEOUT, 0.05), open(log).read()[-4000:]
        second = subprocess.run([sys.executable, "-m", "roll.cli", *args(STEPS)], cwd=REPO, env=clean_env(),
                                capture_output=True, text=True, timeout=120)  # the same recipe started twice
        assert second.returncode == 2, second.stderr[-4000:]
        assert f"is in use by another run: PID {first.pid} on {socket.gethostname()}" in second.stderr
        assert "Traceback" not in second.stderr
        assert wait_until(lambda: _steps_logged(out) >= STEPS, TIMEOUT, 0.05), "the first run stopped"
        orphans = _tree(first)[1:]
        for p in orphans:
            p.suspend()
        first.kill()
        first.wait(timeout=30)
        rerun_log, frozen_at = str(tmp_path / "rerun.log"), _steps_logged(out)
        rerun = _start(args(frozen_at + 3), rerun_log)  # they finish one more step and save on SIGTERM
        assert wait_until(lambda: "waiting up to" in open(rerun_log).read(), TIMEOUT, 0.2), \
            open(rerun_log).read()[-4000:]
        time.sleep(2)
        with open(os.path.join(out, ".roll.lock"), encoding="utf-8") as fh:
            assert json.load(fh)["pid"] == first.pid  # the rerun has not taken over while they live
        for p in orphans:
            p.resume()  # the parent-death SIGTERM is delivered: they finish their step, save and stop
        code, text = _finish(rerun, rerun_log)
    finally:
        for p in orphans:
            p.kill() if p.is_running() else None
        _kill_tree(first)
    assert code == 0, text[-4000:]
    assert f"left by PID {first.pid}" in text, text[-4000:]
    assert not os.path.exists(os.path.join(out, ".roll.lock"))  # released at the end
    assert _steps_logged(out) == frozen_at + 3
    losses = _losses(out)
    _assert_same_losses({step: losses[step] for step in range(1, STEPS + 1)}, reference(False))


@pytest.fixture(scope="module")
def nan_model_dir(tiny_model_factory, tmp_path_factory) -> str:
    """The tiny model with a NaN in its final norm: every loss is NaN."""
    from safetensors.torch import load_file, save_file

    source = tiny_model_factory("qwen2")
    target = tmp_path_factory.mktemp("nan_model")
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(source, name), target / name)
    for path in glob.glob(os.path.join(source, "*.safetensors")):
        tensors = load_file(path)
        for key in tensors:
            if key.endswith("model.norm.weight"):
                tensors[key][0] = float("nan")
        save_file(tensors, str(target / os.path.basename(path)), metadata={"format": "pt"})
    return str(target)


@pytest.mark.parametrize("use_mca", [False, True], ids=["standard", "mca"])
def test_nan_steps_are_skipped_counted_then_stop_the_run(nan_model_dir, tmp_path, use_mca):
    out = str(tmp_path / "run")
    args = _args(nan_model_dir, out, use_mca, max_steps=20, nproc_per_node=1, max_consecutive_skipped_steps=3,
                 shuffle="false")  # the rows of step 3 are then its positions 4-5
    code, text = _finish(_start(args, out + ".log"), out + ".log")
    assert code == EXIT_DIVERGED, text[-4000:]
    assert "step 3: the loss or grad norm was not finite for 3 steps in a row" in text, text[-3000:]
    assert "training samples 4-5" in text and "Traceback" not in text  # step 3's global batch of 2
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as fh:
        skipped = [entry.get("skipped_steps") for entry in map(json.loads, fh) if "loss" in entry]
    assert skipped == [1, 2], skipped  # step 3's record is not logged: the run stopped inside it


def test_a_dead_rank_ends_the_others_with_a_message(tiny_model_dir, tmp_path):
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")
    proc = _start(_args(tiny_model_dir, out, False, max_steps=10_000), log)
    try:
        assert wait_until(lambda: _steps_logged(out) >= 2, TIMEOUT, 0.05), open(log).read()[-4000:]
        _rank_process(proc, 1).kill()
        start = time.monotonic()
        code, text = _finish(proc, log, timeout=90)
    finally:
        _kill_tree(proc)
    assert code == EXIT_HUNG, text[-4000:]
    assert time.monotonic() - start < 60
    assert "rank 1 ended without a report" in text and "rank 0: lost a peer rank while training step" in text


def test_a_hung_rank_times_out_after_ddp_timeout(tiny_model_dir, tmp_path):
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")
    proc = _start(_args(tiny_model_dir, out, True, max_steps=10_000, ddp_timeout=10), log)
    try:
        assert wait_until(lambda: _steps_logged(out) >= 2, TIMEOUT, 0.05), open(log).read()[-4000:]
        _rank_process(proc, 1).suspend()  # SIGSTOP: alive, but never joins the next collective
        code, text = _finish(proc, log, timeout=120)
    finally:
        _kill_tree(proc)
    assert code == EXIT_HUNG, text[-4000:]
    expected = "rank 0: a collective did not complete after ddp_timeout=10s while training step"
    assert expected in text, text[-3000:]
