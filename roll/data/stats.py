"""Preprocessing counts: what went in, what was kept, what was dropped and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

DROP_REASONS = {
    "empty_conversation": "the conversation has no turns",
    "no_assistant_reply": "no assistant turn to train on (e.g. the conversation ends with the user)",
    "bad_turn_order": "roles out of order (optional system first, then user/assistant alternating)",
    "empty_reply": "the assistant reply (or chosen/rejected answer) is empty",
    "chosen_equals_rejected": "the chosen and rejected answers are identical",
    "unrenderable": "the chat template raised an error on this conversation",
    "no_trainable_tokens": "no trainable token is left after cutoff_len truncation",
    "empty_text": "the text is empty",
    "image_cut": "cutoff_len would cut an image's vision tokens (raise cutoff_len; docs/vl.md)",
}
"""Every reason a row can be skipped; the summary counts each one. Nothing is dropped silently."""


@dataclass
class PreprocessStats:
    """Counts over the training split, logged after preprocessing and printed by --dry-run."""

    num_samples_in: int = 0
    """Rows read from the sources (after max_samples, before the validation split)."""
    num_samples: int = 0
    """Samples kept for training (documents for pt; before packing/chunking into rows)."""
    num_dropped: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Skipped rows by reason (see DROP_REASONS)."""
    num_truncated: int = 0
    """Samples cut to cutoff_len (pt: documents split across rows)."""
    num_rows: int = 0
    """Rows of the training dataset the collator sees (packed bins / pt chunks / samples)."""
    num_tokens: int = 0
    """Real (non-padding) tokens in the training rows."""
    num_trainable_tokens: int = 0
    """Tokens whose label is not IGNORE_INDEX."""
    packing_efficiency: float | None = None
    """Real tokens / (packed rows * cutoff_len); None when not packing."""
    num_eval_samples: int = 0
    preprocess_seconds: float = 0.0
    streaming: bool = False
    """The training rows are a stream (roll.data.streaming): nothing is read ahead, so nothing is counted."""

    def add_drops(self, reasons: Counter) -> None:
        for reason, count in reasons.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        self.num_dropped = sum(self.dropped.values())

    def summary_lines(self) -> list[str]:
        if self.streaming:
            return ["streaming: rows are tokenized (and packed) as training reads them, so there are no "
                    f"counts ahead; training rows: {self.num_rows} (max_steps x global batch), eval samples: "
                    f"{self.num_eval_samples}"]
        eff = "n/a (packing off)" if self.packing_efficiency is None else f"{self.packing_efficiency:.4f}"
        dropped = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        return [
            f"samples in: {self.num_samples_in}, kept: {self.num_samples}, "
            f"dropped: {self.num_dropped} ({dropped})",
            f"truncated: {self.num_truncated}, training rows: {self.num_rows}, "
            f"eval samples: {self.num_eval_samples}",
            f"tokens: {self.num_tokens}, trainable tokens: {self.num_trainable_tokens}, "
            f"packing efficiency: {eff}",
            f"preprocessing took {self.preprocess_seconds:.2f}s",
        ]
