"""roll-parity on a recipe in a process of its own: the step every held-out check repeats (scripts/heldout_stages.py,
scripts/heldout_vl.py). Each check writes its recipe, runs ``python -m roll.parity ... --json`` and keeps the JSON
verdict, with the exit status and the command that reproduces it; a run that prints no verdict is a failed check
with the end of its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from roll.parity.cases import REPO


def offline_env(**extra: str) -> dict[str, str]:
    """This process's environment, offline (no hub access), plus ``extra``."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


def run_parity(recipe: dict, run_dir: str, steps: int, *, save_models: bool = False,
               env: dict[str, str] | None = None, timeout: float = 3600) -> dict:
    """roll-parity on ``recipe`` (written to RUN_DIR/recipe.yaml, its runs in RUN_DIR/out): the JSON verdict plus
    ``exit`` and ``command``; ``{"passed": False, "error": the end of its output}`` when it printed none."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "recipe.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(recipe, fh, indent=1)  # JSON is valid YAML
    command = [sys.executable, "-m", "roll.parity", path, "--steps", str(steps), "--output-dir",
               os.path.join(run_dir, "out"), "--json"] + (["--save-models"] if save_models else [])
    proc = subprocess.run(command, cwd=REPO, env=env or offline_env(), capture_output=True, text=True,
                          timeout=timeout)
    try:
        verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        verdict = {"passed": False, "error": (proc.stdout + proc.stderr)[-3000:]}
    verdict["exit"] = proc.returncode
    verdict["command"] = f"roll-parity {path} --steps {steps}"
    return verdict
