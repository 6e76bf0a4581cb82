"""Worker: McaBackend loads an HF model at the given layout and exports it back to HF format.

usage: torchrun --nproc_per_node=N backend_roundtrip.py MODEL_DIR OUT_DIR [key=value ...]
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)


def main() -> None:
    from backends.mca.backend import McaBackend
    from roll.config.parser import resolve

    model_dir, out_dir, *overrides = sys.argv[1:]
    cli = dict(item.split("=", 1) for item in overrides)
    cli.update(use_mca="true", nproc_per_node=os.environ.get("WORLD_SIZE", "1"))
    config = resolve({"model_name_or_path": model_dir, "stage": "sft"}, cli, None)
    backend = McaBackend(config)
    backend.initialize()
    try:
        models = backend.load_models("sft", tokenizer=None)
        assert isinstance(models.policy, list) and models.ref is None
        backend.save(models, None, out_dir)
    finally:
        backend.teardown()


if __name__ == "__main__":
    main()
