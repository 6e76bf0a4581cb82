"""Worker: stage rm runs (roll.router.run, the production path) in one torchrun job; for the runs that export,
the export loaded with transformers scores the held-out pairs as the trained Megatron model does.

usage: torchrun --nproc_per_node=N reward_checks.py SPEC.json RESULT.json

SPEC.json: {"base": {recipe keys}, "runs": [{"name": str, "overrides": {key: value}, "export": bool}, ...]}.
Every run trains ``base`` + its overrides. A run with ``"export": true`` (an eval set, ``save_hf_model``, no
pipeline parallelism) is observed at ``McaBackend.evaluate``, after training: the trained chunks score every
held-out pair in one batch (the chosen rows, then the rejected ones: the backend's own collator, GPTModel's
forward, ``backends.mca.trainer.reward.pooled_rewards``); after ``McaBackend.save`` returned, rank 0 loads the
export from disk (a ``...ForSequenceClassification`` with ``AutoModelForSequenceClassification``; a LoRA run's
SEQ_CLS adapter with ``PeftModel`` on that class built from the base model) and scores the same batch.

Rank 0 writes {name: {"log": [training records], "eval": {eval metrics}, "mca_rewards": [...], "hf_rewards":
[...], "config": {architectures, num_labels, pad_token_id of the export}}} to RESULT.json.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

OBSERVED: dict = {}


@torch.no_grad()
def held_out_rewards(chunks: list[torch.nn.Module], job) -> tuple[list[float], dict]:
    """(the trained chunks' reward of every held-out row, the collated batch they scored)."""
    from megatron.core import parallel_state as ps

    from backends.mca.models.gpt import model_device
    from backends.mca.models.unwrap import unwrap_model
    from backends.mca.trainer.data import model_inputs
    from backends.mca.trainer.reward import pooled_rewards

    assert ps.get_pipeline_model_parallel_world_size() == 1 and len(chunks) == 1, "scored without a pipeline"
    batch = job.collator([job.eval_dataset[i] for i in range(len(job.eval_dataset))])
    inputs = model_inputs(batch, model_device())
    model = unwrap_model(chunks[0])
    model.eval()
    scores = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], attention_mask=None)
    model.train()
    rewards, marks = pooled_rewards(scores[..., 0], inputs["labels"])
    assert marks.eq(1).all(), marks
    return rewards.tolist(), batch


def observe() -> None:
    from backends.mca.backend import McaBackend

    evaluate = McaBackend.evaluate

    def scoring_evaluate(self, job, models):
        if OBSERVED.get("export"):
            OBSERVED["mca_rewards"], OBSERVED["batch"] = held_out_rewards(models.policy, job)
        return evaluate(self, job, models)

    McaBackend.evaluate = scoring_evaluate


@torch.no_grad()
def export_rewards(config, batch: dict) -> tuple[list[float], dict]:
    """The export's rewards of ``batch`` and its config's reward fields (rank 0, from disk)."""
    from transformers import AutoModelForSequenceClassification

    out = config.training.output_dir
    if config.finetuning.finetuning_type == "lora":
        from peft import PeftModel

        with open(os.path.join(out, "adapter_config.json"), encoding="utf-8") as fh:
            adapter = json.load(fh)
        base = AutoModelForSequenceClassification.from_pretrained(
            adapter["base_model_name_or_path"], num_labels=1, pad_token_id=OBSERVED["pad_token_id"],
            dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out)
        fields = {"task_type": adapter["task_type"], "modules_to_save": adapter["modules_to_save"]}
    else:
        model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
        fields = {"architectures": model.config.architectures}
    fields.update(num_labels=model.config.num_labels, pad_token_id=model.config.pad_token_id)
    logits = model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[:, 0].double().tolist(), fields


def run_one(spec: dict, item: dict) -> dict:
    from roll.router import run

    from spec_runs import recipe_config

    config = recipe_config(spec, item)
    OBSERVED.clear()
    OBSERVED["export"] = item.get("export", False)
    result = run(config)
    entry = {"log": [e for e in result.log_history if "loss" in e],
             "eval": {k: v for k, v in result.metrics.items() if k.startswith("eval_")}}
    if OBSERVED["export"] and dist.get_rank() == 0:
        from transformers import AutoTokenizer

        OBSERVED["pad_token_id"] = AutoTokenizer.from_pretrained(config.model.model_name_or_path).pad_token_id
        entry["mca_rewards"] = OBSERVED["mca_rewards"]
        entry["hf_rewards"], entry["config"] = export_rewards(config, OBSERVED["batch"])
    return entry


if __name__ == "__main__":
    from spec_runs import main

    main(run_one, setup=observe)
