"""Worker: vision-language training steps (Qwen2.5-VL, Qwen2-VL, Qwen3-VL) through McaBackend + MegatronTrainer on hand-made
multimodal rows.

usage: torchrun --nproc_per_node=2 vl_train_runs.py SPEC.json RESULT.json

SPEC.json lists the models: [{"family": ..., "model": MODEL_DIR, "rows": ROWS.pt, "runs": [run names]}]. ROWS.pt
holds tokenized rows (``input_ids``, ``attention_mask``, ``labels``) with ``images``: a list of (pixel_values
[patches, C*T*P*P], grid (t, h, w)) per row, served as a ``datasets.Dataset`` (what a checkpoint records the sample
order of). The collator is roll's Megatron SequenceCollator plus docs/vl.md's batch contract (the micro-batch's
pixel_values / image_grid_thw concatenated in row order), as roll.data.vision.VisionCollator builds it from image
files. Runs (2 steps of 4 rows each, lr 1e-3): ``tp1`` (DP2), ``tp2_sp`` (with sequence parallelism and full
recompute), ``pp2`` (saving a checkpoint after each step) with the vision tower and projector trained,
``pp2_resume`` resuming ``pp2``'s checkpoint-1 (the tower comes back from the Megatron checkpoint), ``pp2_frozen``
with LLaMA-Factory's defaults (both frozen, through McaBackend.apply_finetuning), ``cp2`` (context parallelism:
each rank holds 2 of the 4 chunks of every row, the placeholders' image features among them), ``packed`` (DP2) and
``packed_pp2``: rows 2i and 2i+1 packed into one (``packing: true``, packed_runs.pack_pairs, one packed row a
micro-batch, so a step trains the same 4 samples as the others), ``packed_cp2`` (both: each packed sample cut into
4 chunks; Qwen3-VL's deepstack features take the rank's rows as the image features do), ``packed_tp2_sp`` (packed
with TP2 and sequence parallelism). Rank 0 writes {family: {run:
{"losses": [...], "sequence_parallel": bool, "tower_recomputes": bool, "tower_changed": bool, "merger_changed": bool,
"deepstack_changed": bool (Qwen3-VL)}}} (rank 0 holds the first stage, the tower, in every run).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from packed_runs import pack_pairs, write_results  # noqa: E402 (this folder: the script's own)

RUNS = {"tp1": ({"per_device_train_batch_size": "2", "gradient_accumulation_steps": "1"}, True),
        "tp2_sp": ({"tensor_model_parallel_size": "2", "sequence_parallel": "true", "recompute_granularity": "full",
                    "recompute_method": "uniform", "recompute_num_layers": "1"}, True),
        "pp2": ({"pipeline_model_parallel_size": "2", "save_strategy": "steps", "save_steps": "1"}, True),
        "pp2_resume": ({"pipeline_model_parallel_size": "2", "resume_from_checkpoint": "pp2/checkpoint-1"}, True),
        "pp2_frozen": ({"pipeline_model_parallel_size": "2"}, False),
        "cp2": ({"context_parallel_size": "2"}, True),
        "packed": ({"packing": "true", "per_device_train_batch_size": "1", "gradient_accumulation_steps": "1"}, True),
        "packed_pp2": ({"packing": "true", "pipeline_model_parallel_size": "2", "per_device_train_batch_size": "1"},
                       True),
        "packed_cp2": ({"packing": "true", "context_parallel_size": "2", "per_device_train_batch_size": "1"}, True),
        "packed_tp2_sp": ({"packing": "true", "tensor_model_parallel_size": "2", "sequence_parallel": "true",
                           "per_device_train_batch_size": "1"}, True)}
"""name -> (recipe overrides, vision tower and projector trained); ``pp2_resume`` runs after ``pp2``."""


class ImageCollator:
    """The text collator's batch plus the micro-batch's images (docs/vl.md's contract)."""

    def __init__(self, base) -> None:
        self.base = base

    def __call__(self, features: list[dict]) -> dict:
        batch = self.base([{k: v for k, v in f.items() if k not in IMAGE_KEYS} for f in features])
        pixels = [torch.tensor(p) for f in features for p in f["pixels"]]
        if pixels:
            batch["pixel_values"] = torch.cat(pixels)
            batch["image_grid_thw"] = torch.tensor([grid for f in features for grid in f["grids"]])
        return batch


IMAGE_KEYS = ("pixels", "grids")


def as_dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list([{**{k: r[k] for k in ("input_ids", "attention_mask", "labels")},
                               "pixels": [p.tolist() for p, _ in r["images"]],
                               "grids": [list(g) for _, g in r["images"]]} for r in rows])


PARTS = {"tower": "patch_embed.", "merger": "merger.", "deepstack": "deepstack_merger_list."}
"""A part of the tower whose first parameter tells whether it trained -> its name prefix inside ``visual``."""


def tower_weights(chunks) -> dict[str, torch.Tensor]:
    from backends.mca.models.unwrap import unwrap_model

    visual = getattr(unwrap_model(chunks[0]), "visual", None)
    if visual is None:
        return {}
    params = dict(visual.named_parameters())
    return {part: next(p for n, p in params.items() if n.startswith(prefix)).detach().clone()
            for part, prefix in PARTS.items() if any(n.startswith(prefix) for n in params)}


def main() -> None:
    import torch.distributed as dist

    spec_file, result_file = sys.argv[1:]
    with open(spec_file, encoding="utf-8") as fh:
        models = json.load(fh)
    dist.init_process_group("gloo")  # this worker's: kept across the runs' Megatron set-ups
    results = {model["family"]: family_runs(model, os.path.dirname(result_file)) for model in models}
    write_results(results, result_file)


def family_runs(model: dict, runs: str) -> dict[str, dict]:
    """The runs ``model["runs"]`` of one model (SPEC.json's entry), outputs under ``runs/FAMILY_RUN``."""
    from transformers import AutoTokenizer

    from backends.mca.backend import McaBackend
    from backends.mca.models.unwrap import unwrap_model
    from backends.mca.trainer.loop import MegatronTrainer
    from backends.mca.vision import freeze_parts
    from roll.config.parser import resolve
    from roll.contract import ModelBundle
    from roll.data.collators import SequenceCollator

    model_dir, family = model["model"], model["family"]
    rows = as_dataset(torch.load(model["rows"], weights_only=True))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    recipe = {"model_name_or_path": model_dir, "stage": "sft", "dataset": "recipes/demo/data/arithmetic_sft.json",
              "cutoff_len": 64, "use_mca": True, "nproc_per_node": int(os.environ.get("WORLD_SIZE", "1")),
              "learning_rate": 1e-3, "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
              "seed": 0, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
              "shuffle": False}  # step 1 trains rows 0-3, the rows the test's HF loss reads
    results = {}
    for name in model["runs"]:
        overrides, trained = RUNS[name]
        if "resume_from_checkpoint" in overrides:
            checkpoint = os.path.join(runs, f"{family}_{overrides['resume_from_checkpoint']}")
            overrides = {**overrides, "resume_from_checkpoint": checkpoint}
        config = resolve(recipe, {**overrides, "output_dir": os.path.join(runs, f"{family}_{name}")}, None)
        backend = McaBackend(config)
        backend.setup_distributed()
        models = backend.load_models("sft", tokenizer)
        if trained:
            freeze_parts(models.policy, SimpleNamespace(freeze_vision_tower=False, freeze_multi_modal_projector=False,
                                                     freeze_language_model=False))
        else:
            models = backend.apply_finetuning(ModelBundle(policy=models.policy))  # the recipe's (LF's) defaults
        before = tower_weights(models.policy)
        collator = ImageCollator(SequenceCollator(tokenizer.pad_token_id, backend.padding_policy("sft")))
        trainer = MegatronTrainer(models.policy, config.training, config.megatron, config.layout,
                                  pad_token_id=tokenizer.pad_token_id)
        history = trainer.train(pack_pairs(rows, IMAGE_KEYS) if config.data.packing else rows, collator).log_history
        after = tower_weights(models.policy)
        visual = getattr(unwrap_model(models.policy[0]), "visual", None)
        results[name] = {"losses": [entry["loss"] for entry in history if "loss" in entry],
                         "sequence_parallel": bool(models.policy[0].config.sequence_parallel),
                         "tower_recomputes": bool(visual is not None and visual.is_gradient_checkpointing),
                         **{f"{part}_changed": not torch.equal(before[part], after[part]) for part in before}}
        backend.teardown()
    return results


if __name__ == "__main__":
    main()
