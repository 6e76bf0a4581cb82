"""roll-bench's baseline (a): a plain ``transformers.Trainer`` on the data roll-train would see.

roll prepares the data once (the same tokenizer, processor and packing as ``roll-train`` with the same
recipe, so every case trains on the same rows); the training loop is Hugging Face's own:
``transformers.Trainer``, a twelve-line collator, no roll trainer, callback or backend. Its own seeded
sampler draws the batches, the order both roll backends draw too (``roll.data.order``), so the baseline
trains on the same batches (with ``shuffle: false`` HF's sequential sampler).

It writes ``OUTPUT_DIR/train_log.jsonl`` with the keys roll-bench reads (``step``, ``loss``,
``tokens_per_second``, ``step_time``), one line per step.

    python -m roll.bench.hf RECIPE.yaml OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time


def _collate(pad_id: int):
    """Right-pad rows; packed rows (with ``position_ids``) get no attention mask, so HF reads the sample
    boundaries from the restarting position ids, as it does on the standard backend."""
    import torch

    def collate(features: list[dict]) -> dict:
        length = max(len(f["input_ids"]) for f in features)

        def pad(key: str, value: int) -> torch.Tensor:
            return torch.tensor([f[key] + [value] * (length - len(f[key])) for f in features])

        batch = {"input_ids": pad("input_ids", pad_id), "labels": pad("labels", -100)}
        if "position_ids" in features[0]:
            tails = [list(range(length - len(f["position_ids"]))) for f in features]  # padding: own segment
            rows = [f["position_ids"] + tail for f, tail in zip(features, tails)]
            batch["position_ids"] = torch.tensor(rows)
        else:
            batch["attention_mask"] = pad("attention_mask", 0)
        return batch

    return collate


def _prepared_data(recipe: str):
    """The tokenized (and packed) train set and tokenizer that roll-train would build from ``recipe``."""
    from roll.config.parser import parse_args
    from roll.router import STAGES
    from roll import data

    _, config = parse_args([recipe])
    spec = STAGES[config.finetuning.stage]
    tokenizer = data.load_tokenizer(config.model, config.data)
    bundle = data.build_datasets(config.data, tokenizer, stage=config.finetuning.stage,
                                 processor=spec.processor, formats=spec.formats, seed=config.training.seed)
    return config, tokenizer, bundle.train


def train(recipe: str, output_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    config, tokenizer, dataset = _prepared_data(recipe)
    dataset = dataset.remove_columns([c for c in ("seq_lens",) if c in dataset.column_names])
    training = config.training
    torch.manual_seed(training.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model.model_name_or_path, dtype=torch.float32)
    log_path = os.path.join(output_dir, "train_log.jsonl")
    os.makedirs(output_dir, exist_ok=True)
    open(log_path, "w", encoding="utf-8").close()

    class StepLog(TrainerCallback):
        """Times each optimizer step and counts its non-pad tokens (roll's tokens_per_second definition)."""

        def __init__(self) -> None:
            self.start, self.tokens = time.perf_counter(), 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                seconds = time.perf_counter() - self.start
                record = {"step": state.global_step, "loss": logs["loss"], "step_time": round(seconds, 4),
                          "tokens_per_second": round(self.tokens / max(seconds, 1e-9), 2)}
                with open(log_path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(record) + "\n")
            self.tokens = 0

    step_log = StepLog()
    collate = _collate(tokenizer.pad_token_id)

    def counting_collate(features: list[dict]) -> dict:
        batch = collate(features)
        step_log.tokens += int((batch["input_ids"] != tokenizer.pad_token_id).sum())
        return batch

    args = TrainingArguments(
        output_dir=output_dir, max_steps=training.max_steps, logging_steps=1, save_strategy="no",
        report_to=[], per_device_train_batch_size=training.per_device_train_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        learning_rate=training.learning_rate, lr_scheduler_type="constant", seed=training.seed,
        data_seed=training.data_seed,
        train_sampling_strategy="random" if config.data.shuffle else "sequential",
        bf16=bool(training.bf16), use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        dataloader_num_workers=training.dataloader_num_workers, remove_unused_columns=False)
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=counting_collate,
            callbacks=[step_log]).train()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write(__doc__.rsplit("\n\n", 1)[-1] + "\n")
        raise SystemExit(2)
    train(*argv)


if __name__ == "__main__":
    main()
