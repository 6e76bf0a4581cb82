"""roll-train under a real SLURM cluster (tests/slurm/cluster.py: two slurmd nodes on loopback, one CPU each).

- ``srun -n 2 roll-train R`` (standard) and ``srun -n 2 roll-train R --use-mca tensor_model_parallel_size=2``:
  one 2-rank run each, one task per node, every step logged once, with the losses of a local
  ``nproc_per_node=2`` run;
- a 2-rank batch job (the shipped examples/slurm/train.sbatch; 2 tasks, or 1 task with nproc_per_node=2)
  requeued with ``scontrol requeue`` mid-run: its ranks save a checkpoint on SIGTERM and exit, SLURM runs the
  same script again (``SLURM_RESTART_COUNT=1``, no resume key), it resumes from that checkpoint
  and ends with the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.helpers import REPO, output_of, roll_train
from tests.slurm.cluster import CRED_EXPIRE, KILL_WAIT, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.slurm]

TIMEOUT = 240
STEPS = 16
TOLERANCE = 1e-5
"""fp32 on CPU, gloo: a run is bit-identical to another of the same layout (the bound of test_multinode's
two-node run is 1e-6); 1e-5 as the issue states it. One 1-process run instead of one 2-rank run is off by
5e-2 (measured on main c76e567, ../shared/research/slurm.md)."""

LAYOUTS = {"standard": {}, "mca-tp2": {"use_mca": "true", "tensor_model_parallel_size": "2"}}


def _args(model_dir: str, out, **extra: str) -> list[str]:
    keys = dict(model_name_or_path=model_dir, stage="sft", dataset="recipes/demo/data/arithmetic_sft.json",
                cutoff_len=64, output_dir=str(out), per_device_train_batch_size=2, max_steps=STEPS,
                learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                save_hf_model="false", report_to="none", disable_tqdm="true")
    keys.update(extra)
    return [f"{key}={value}" for key, value in keys.items()]


def _recipe(folder, args: list[str]) -> tuple[str, list[str]]:
    """A recipe file with the model and stage; the other keys, for the command line."""
    path = folder / "recipe.yaml"
    path.write_text("".join(arg.replace("=", ": ", 1) + "\n" for arg in args[:2]))
    return str(path), args[2:]


def _log(out) -> list[dict]:
    path = os.path.join(out, "train_log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _steps(out) -> list[int]:
    """The steps in train_log.jsonl, in the order logged (a resumed run appends)."""
    return [entry["step"] for entry in _log(out) if "loss" in entry]


def _losses(out) -> list[float]:
    """Loss per step; a step logged again keeps its last value."""
    by_step = {entry["step"]: entry["loss"] for entry in _log(out) if "loss" in entry}
    return [by_step[step] for step in sorted(by_step)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """layout -> per-step losses of a local ``roll-train R nproc_per_node=2`` run (computed once per layout)."""
    cache: dict[str, list[float]] = {}

    def losses(layout: str) -> list[float]:
        if layout not in cache:
            out = tmp_path_factory.mktemp(f"local-{layout}") / "out"
            proc = roll_train(*_args(tiny_model_dir, out, nproc_per_node=2, **LAYOUTS[layout]), timeout=TIMEOUT)
            assert proc.returncode == 0, output_of(proc)
            assert _steps(out) == list(range(1, STEPS + 1)), _log(out)
            cache[layout] = _losses(out)
        return cache[layout]

    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_srun_with_two_tasks_is_one_run(slurm_cluster, tiny_model_dir, tmp_path, reference, layout):
    out = tmp_path / "out"
    recipe, keys = _recipe(tmp_path, _args(tiny_model_dir, out, **LAYOUTS[layout]))
    proc = slurm_cluster.srun("--ntasks=2", "roll-train", recipe, *keys, timeout=TIMEOUT)
    assert proc.returncode == 0, output_of(proc)
    # one run: each step once (two 1-process runs on one output_dir log every step twice)
    assert _steps(out) == list(range(1, STEPS + 1)), output_of(proc)
    assert _losses(out) == pytest.approx(reference(layout), rel=TOLERANCE, abs=0)


TEMPLATE = os.path.join(REPO, "examples", "slurm", "train.sbatch")
"""The shipped sbatch script (``exec srun roll-train "$RECIPE" ... "$@"``), run as a user would."""


FORMS = {"task-per-rank": ("--nodes=2", {}), "task-per-node": ("--nodes=1", {"nproc_per_node": "2"})}
"""The template's two forms, both 2 ranks: one task per rank on 2 nodes (the ranks get SLURM's SIGTERM), and one
task per node launching its 2 ranks (SLURM signals roll-train, the launcher and the ranks at once: a burst)."""


@pytest.mark.parametrize("form", list(FORMS))
def test_a_requeued_job_resumes_with_the_same_script(slurm_cluster, tiny_model_dir, tmp_path, reference, form):
    out, job_out = tmp_path / "out", tmp_path / "job.out"
    nodes, extra = FORMS[form]
    recipe, keys = _recipe(tmp_path, _args(tiny_model_dir, out, **extra))
    # the template asks for 2 nodes of 8 GPUs for a day: this cluster has 2 nodes of 1 CPU and no GPU
    job = slurm_cluster.sbatch(nodes, "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0",
                               "--time=10", f"--output={job_out}", "--job-name=roll-requeue", TEMPLATE, recipe,
                               *keys)

    def text() -> str:
        return job_out.read_text(errors="replace") if job_out.exists() else ""

    try:
        # as soon as step 2 is logged: a tiny step takes 0.05-0.1 s on 2 CPU cores
        wait_for(lambda: len(_steps(out)) >= 2, TIMEOUT, f"step 2 of job {job}\n{text()[-3000:]}", interval=0.02)
        requeue = slurm_cluster.command("scontrol", "requeue", job)
        assert requeue.returncode == 0, requeue.stderr
        # the first run stops (save, exit 75: at most KillWait), waits cred_expire + 1 s, runs again
        done = slurm_cluster.wait_job(job, lambda f: f["JobState"] not in ("RUNNING", "PENDING", "REQUEUED",
                                                                           "COMPLETING", "CONFIGURING"),
                                      KILL_WAIT + CRED_EXPIRE + TIMEOUT)
    finally:
        slurm_cluster.command("scancel", job)
    assert (done["JobState"], done.get("Restarts")) == ("COMPLETED", "1"), f"{done}\n{text()[-4000:]}"
    found = re.findall(r"stopped by SIGTERM after step (\d+)", text())
    assert found, f"no checkpoint on the requeue's SIGTERM:\n{text()[-4000:]}"
    stopped = int(found[-1])
    assert 2 <= stopped < STEPS - 1, "the requeue came too late to test a resume"
    assert os.path.isdir(out / f"checkpoint-{stopped}"), os.listdir(out)
    # resumed at step stopped + 1: a rerun from scratch would log steps 1.. again
    assert _steps(out) == list(range(1, STEPS + 1)), text()[-4000:]
    assert _losses(out) == pytest.approx(reference("standard"), rel=TOLERANCE, abs=0)
