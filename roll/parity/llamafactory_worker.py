"""LLaMA-Factory's side of a script that compares roll's data code with LLaMA-Factory's own, run in
LLaMA-Factory's environment (scripts/compare_llamafactory_rows.py, scripts/compare_llamafactory_images.py).

LLaMA-Factory is never a roll dependency: such a script runs itself a second time, as ``LF_PYTHON SCRIPT
--lf-worker FOLDER/spec.json``, with the interpreter of LLaMA-Factory's virtual environment (``bash
scripts/llamafactory_venv.sh lf``), offline and with none of roll's PYTHONPATH (the environment
``llamafactory-cli train`` gets in roll.parity.llamafactory). That worker reads the spec, calls
LLaMA-Factory's code with its output_dir at ``spec["out"]``, and writes what it got, as JSON, to
``spec["out_json"]``. This module is the script's half: the spec written, the worker run, its JSON read back.
"""

from __future__ import annotations

import json
import os
import subprocess

from roll.parity.llamafactory import INSTALL

WORKER_FLAG = "--lf-worker"
"""The hidden option that makes a comparison script the worker: ``--lf-worker SPEC.json``."""
TIMEOUT = 900.0


class WorkerFailed(RuntimeError):
    """The worker exited non-zero; ``stderr`` holds what it wrote (LLaMA-Factory's traceback)."""

    def __init__(self, code: int, stderr: str):
        super().__init__(f"the LLaMA-Factory worker exited {code}")
        self.code, self.stderr = code, stderr


def missing_python(lf_python: str) -> str | None:
    """Why ``lf_python`` cannot run a worker (with how to get LLaMA-Factory's environment), or None."""
    if os.path.isfile(lf_python):
        return None
    return f"no LLaMA-Factory environment at {lf_python}: {INSTALL}, or --lf-python PATH"


def run_worker(lf_python: str, script: str, spec: dict, folder: str, timeout: float = TIMEOUT) -> dict:
    """Run ``script``'s worker on ``spec`` in LLaMA-Factory's environment and return the JSON it wrote.

    ``spec`` gets ``out`` (LLaMA-Factory's output_dir, FOLDER/out) and ``out_json`` (FOLDER/lf.json) and is
    written to FOLDER/spec.json; the worker's datasets cache is FOLDER/cache. Raises WorkerFailed."""
    from roll.bench.side_by_side import Settings, environment

    spec = {**spec, "out": os.path.join(folder, "out"), "out_json": os.path.join(folder, "lf.json")}
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    env = environment("llamafactory", Settings(threads=threads), os.path.join(folder, "cache"))
    proc = subprocess.run([lf_python, os.path.abspath(script), WORKER_FLAG, spec_path], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise WorkerFailed(proc.returncode, proc.stderr.strip())
    with open(spec["out_json"], encoding="utf-8") as handle:
        return json.load(handle)
