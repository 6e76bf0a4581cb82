"""Regenerate tests/recipes/goldens.json: the per-step losses of every demo recipe on both backends.

usage: OMP_NUM_THREADS=1 python scripts/update_goldens.py

Run this only when a change of the losses is intended (a new default, a fixed bug in the loss or the data
pipeline), and say in the commit that changes goldens.json why the losses changed. The tests never
regenerate goldens themselves. Same runs as the tests (tests/recipes/recipe_runs.py): the tiny BPE
Qwen2 model, CPU, fp32, the mca backend in one 1-process torchrun job. goldens.json records the command,
the library versions, the commit and the date (``describe_environment``); commit first, so that the
commit it names is the code that produced them.
"""

import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
for var, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                   ("TOKENIZERS_PARALLELISM", "false"), ("DS_ACCELERATOR", "cpu")):
    os.environ.setdefault(var, value)

from roll.logging import setup_logging  # noqa: E402
from roll.demo.tiny_model import make_tiny_model  # noqa: E402
from tests.recipes.recipe_runs import GOLDENS, STEPS, describe_environment, run_all  # noqa: E402


def main() -> int:
    setup_logging("WARNING")
    with tempfile.TemporaryDirectory(prefix="roll-goldens-") as root:
        model_dir = make_tiny_model(os.path.join(root, "tiny_qwen2_bpe"), kind="qwen2", tokenizer="bpe")
        losses = run_all(model_dir, root)
    goldens = {"steps": STEPS, "generated_by": "OMP_NUM_THREADS=1 python scripts/update_goldens.py (CPU, fp32; "
                                                "tests/recipes/recipe_runs.py: the tiny BPE Qwen2, mca in one "
                                                "1-process torchrun job)",
               "environment": describe_environment(), "losses": losses}
    with open(GOLDENS, "w", encoding="utf-8") as fh:
        json.dump(goldens, fh, indent=1)
        fh.write("\n")
    for name, by_backend in losses.items():
        for backend, values in by_backend.items():
            print(f"{name:>10} {backend:>8}: " + " ".join(f"{v:.6f}" for v in values))
    print(f"written to {os.path.relpath(GOLDENS, REPO)}; explain in the commit why the losses changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
