"""Worker: packed (THD) vs unpacked training on the same samples, through MegatronTrainer.

usage: torchrun --nproc_per_node=N packed_runs.py MODEL_DIR RESULT.json [key=value ...]

The tokenized sft rows come from the shared pipeline; packed rows are built from consecutive pairs
(rows 2i and 2i+1 in one row, positions restarting at the second sample, as roll's packer lays them
out), so a packed step of 2 rows holds exactly the 4 samples of an unpacked step of 4 rows. Both
runs start from the same weights; rank 0 writes {"unpacked": [...], "packed": [...]} losses.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)


def pack_pairs(dataset, extra: tuple[str, ...] = ()):
    """Rows 2i and 2i+1 as one packed row (roll's packer's layout); the list columns ``extra`` (a VL row's images)
    concatenated in the same order."""
    from datasets import Dataset

    rows = []
    for i in range(0, len(dataset) - 1, 2):
        a, b = dataset[i], dataset[i + 1]
        rows.append({"input_ids": a["input_ids"] + b["input_ids"], "labels": a["labels"] + b["labels"],
                     "position_ids": list(range(len(a["input_ids"]))) + list(range(len(b["input_ids"]))),
                     "seq_lens": [len(a["input_ids"]), len(b["input_ids"])], **{k: a[k] + b[k] for k in extra}})
    return Dataset.from_list(rows)


def write_results(results: dict, result_file: str) -> None:
    """Rank 0 writes the runs' results to ``result_file``; the worker's process group ends."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(result_file, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def main() -> None:
    import torch.distributed as dist

    from backends.mca.backend import McaBackend
    from backends.mca.trainer.loop import MegatronTrainer
    from roll.config.parser import resolve
    from roll.data.collators import SequenceCollator
    from roll.data.order import SampleOrder
    from roll.data.policy import PaddingPolicy
    from roll.router import build_job

    model_dir, result_file, *overrides = sys.argv[1:]
    cli = dict(item.split("=", 1) for item in overrides)
    recipe = {"model_name_or_path": model_dir, "stage": "sft", "dataset": "recipes/demo/data/arithmetic_sft.json",
              "cutoff_len": 64, "use_mca": True, "nproc_per_node": int(os.environ.get("WORLD_SIZE", "1")),
              "learning_rate": 1e-3, "max_steps": 5, "logging_steps": 1, "save_strategy": "no",
              "report_to": "none", "seed": 0}
    dist.init_process_group("gloo")  # this worker's: kept across the two runs' Megatron set-ups
    losses = {}
    for name, batch_size in (("unpacked", 4), ("packed", 2)):
        config = resolve(recipe, {**cli, "per_device_train_batch_size": str(batch_size),
                                  "output_dir": os.path.join(os.path.dirname(result_file), name)}, None)
        backend = McaBackend(config)
        backend.setup_distributed()
        job, _ = build_job(config, backend.padding_policy("sft"))
        dataset, collator = job.train_dataset, job.collator
        if name == "packed":
            policy = PaddingPolicy.for_megatron(config.layout, cutoff_len=128, packing=True)
            dataset, collator = pack_pairs(dataset), SequenceCollator(job.tokenizer.pad_token_id, policy)
        chunks = backend.load_models("sft", job.tokenizer).policy
        # the rows in order: packed row k holds rows 2k and 2k+1, so step k trains the same samples both ways
        trainer = MegatronTrainer(chunks, config.training, config.megatron, config.layout,
                                  pad_token_id=job.tokenizer.pad_token_id, order=SampleOrder(0, shuffle=False))
        losses[name] = [entry["loss"] for entry in trainer.train(dataset, collator).log_history]
        backend.teardown()
    write_results(losses, result_file)


if __name__ == "__main__":
    main()
