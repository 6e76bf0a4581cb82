"""The --dry-run report: the preprocessing summary plus one decoded example with its trained span marked."""

from __future__ import annotations

import dataclasses

from roll import IGNORE_INDEX

OPEN, CLOSE = "[TRAIN>", "<TRAIN]"
"""Markers around trained tokens in the decoded example."""

SUMMARY_KEYS = ("num_samples", "num_dropped", "num_truncated", "num_tokens", "num_trainable_tokens",
                "packing_efficiency", "preprocess_seconds")


def marked_text(tokenizer, input_ids: list[int], labels: list[int]) -> str:
    """Decode ``input_ids`` and wrap every run of trained tokens (label != IGNORE_INDEX) in markers."""
    parts, run, trained = [], [], False
    for token, label in zip(input_ids, labels):
        is_trained = label != IGNORE_INDEX
        if is_trained != trained and run:
            parts.append(_wrap(tokenizer.decode(run), trained))
            run = []
        run.append(token)
        trained = is_trained
    if run:
        parts.append(_wrap(tokenizer.decode(run), trained))
    return "".join(parts)


def _wrap(text: str, trained: bool, keep: int = 400) -> str:
    """Mark a trained run; runs longer than 2 * keep characters show only their ends."""
    if len(text) > 2 * keep:
        text = f"{text[:keep]} [... {len(text) - 2 * keep} characters ...] {text[-keep:]}"
    return f"{OPEN}{text}{CLOSE}" if trained else text


def _example(job) -> list[str]:
    row = job.train_dataset[0]
    if "chosen_input_ids" in row:
        return [f"--- {side} (first training pair) ---\n"
                + marked_text(job.tokenizer, row[f"{side}_input_ids"], row[f"{side}_labels"])
                for side in ("chosen", "rejected")]
    if "kto_tag" in row:
        return _kto_example(job)
    if getattr(job.collator, "vision", None) is not None:  # a VL model: a row with images, their sizes
        from roll.data.vision import image_example

        return image_example(job, marked_text)
    ids, labels = row["input_ids"], row["labels"]
    header = "--- first training row ---"
    if "seq_lens" in row:
        header = f"--- first sample of the first packed row ({len(row['seq_lens'])} samples in it) ---"
        ids, labels = ids[: row["seq_lens"][0]], labels[: row["seq_lens"][0]]
    return [header + "\n" + marked_text(job.tokenizer, ids, labels)]


def _kto_example(job) -> list[str]:
    """stage kto: the first row with its label, and its mismatched row (its prompt with the completion of the
    micro-batch's previous row, here the second row's in a micro-batch of the first two; with
    kto_mismatched_rows: llamafactory the one formed at tokenization, from its batch's previous row)."""
    from roll.data.feedback import KL, mismatched_rows, paired_rows

    rows = [job.train_dataset[i] for i in range(min(2, len(job.train_dataset)))]
    first = rows[0]
    label = "desirable" if first["kto_tag"] else "undesirable"
    out = [f"--- first training row (kto_tag: {str(first['kto_tag']).lower()}, {label}) ---\n"
           + marked_text(job.tokenizer, first["input_ids"], first["labels"])]
    if KL[0] in first:
        kl, whose = paired_rows([first])[0], "the previous row of its tokenization batch (the first: the last)"
    else:
        kl = mismatched_rows(rows, getattr(job.collator, "cutoff_len", len(first["input_ids"])),
                             getattr(job.collator, "named_template", False))[0]
        whose = f"the {'second' if len(rows) > 1 else 'same'} row"
    out.append(f"--- its mismatched row for the KL reference point (its prompt, the completion of {whose}) ---\n"
               + marked_text(job.tokenizer, kl["input_ids"], kl["labels"]))
    return out


def _legend(stage: str) -> str:
    if stage == "rm":  # its labels mark the one token each side's reward is read at (roll.data.reward)
        return f"the token each side is scored at (the reward model's output there) is marked {OPEN}...{CLOSE}"
    return f"trained tokens are marked {OPEN}...{CLOSE}"


def dry_run_report(job, stats) -> tuple[dict, str]:
    """(summary dict for --json, human-readable text) for a built TrainJob and its PreprocessStats."""
    summary = {key: getattr(stats, key) for key in SUMMARY_KEYS}
    summary.update(stage=job.stage, num_samples_in=stats.num_samples_in, num_rows=stats.num_rows,
                   dropped=dict(stats.dropped), num_eval_samples=stats.num_eval_samples)
    vision = getattr(job.collator, "vision", None)
    if vision is not None:  # LLaMA-Factory's resize before the processor, or none (roll.data.vision_resize)
        summary["image_resize"] = dataclasses.asdict(vision.resize) if vision.resize else None
    first = [job.train_dataset[i] for i in range(min(2, len(job.train_dataset)))]
    summary["batch_shapes"] = {key: list(value.shape) for key, value in job.collator(first).items()}
    unit = "pairs" if "chosen_input_ids" in first[0] else "rows"
    classes = []
    if "kto_tag" in first[0]:
        desirable = sum(1 for tag in job.train_dataset["kto_tag"] if tag)
        summary["kto_tags"] = {"desirable": desirable, "undesirable": len(job.train_dataset) - desirable}
        classes = [f"  kto_tag: {desirable} desirable (true), {len(job.train_dataset) - desirable} undesirable "
                   "(false) training rows"]
    lines = [f"stage {job.stage}: data summary", *("  " + line for line in stats.summary_lines()), *classes,
             f"  collated batch of the first {len(first)} {unit}: "
             + ", ".join(f"{k} {v}" for k, v in summary["batch_shapes"].items()),
             _legend(job.stage), *_example(job)]
    return summary, "\n".join(lines) + "\n"
