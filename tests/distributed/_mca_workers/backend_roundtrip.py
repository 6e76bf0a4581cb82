"""Worker: McaBackend loads an HF model at the given layout and exports it back to HF format, twice:
the bare chunks to OUT_DIR, then the same chunks wrapped in Megatron DistributedDataParallel (as the
trainer wraps them; the distributed optimizer swaps every parameter's storage for a buffer view) to
OUT_DIR_ddp.

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
    backend.setup_distributed()
    try:
        models = backend.load_models("sft", tokenizer=None)
        assert isinstance(models.policy, list) and models.ref is None
        backend.save(models, None, out_dir)
        models.policy = wrap_in_ddp(models.policy)
        backend.save(models, None, out_dir + "_ddp")
    finally:
        backend.teardown()


def wrap_in_ddp(chunks: list) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from backends.mca.models.unwrap import unwrap_model

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    assert all(unwrap_model(w) is c for w, c in zip(wrapped, chunks))
    assert all(next(iter(dict(w.named_parameters()))).startswith("module.") for w in wrapped)  # wrapper names
    return wrapped


if __name__ == "__main__":
    main()
