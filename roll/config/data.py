"""Which data to train on and how it is tokenized, truncated and packed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roll.errors import ConfigError


@dataclass
class DataArguments:
    dataset: str | None = None
    """One or more comma-separated sources: .json/.jsonl/.parquet/.csv/.txt files, directories of them, or a saved datasets directory."""

    eval_dataset: str | None = None
    """Sources for evaluation, same syntax as dataset (alternative to val_size)."""

    formatting: Literal["auto", "alpaca", "sharegpt", "pairwise", "text"] = "auto"
    """Row format; 'auto' detects it from the columns."""

    template: str | None = None
    """Chat template: None uses the tokenizer's own; or a built-in name ('qwen'/'chatml', 'llama3', 'default')."""

    cutoff_len: int = 1024
    """Maximum tokens per sample (per packed row with packing). Prompts are trimmed before answers."""

    train_on_last_turn_only: bool = False
    """In multi-turn conversations, train only on the last assistant turn instead of every assistant turn."""

    packing: bool = False
    """Pack several samples into each cutoff_len row (never splitting one); attention never crosses samples."""

    max_samples: int | None = None
    """Use at most this many rows of each source: a seeded random subset with shuffle, else the first rows."""

    val_size: float = 0.0
    """Fraction (0-1) or count (>=1) of training rows held out for evaluation."""

    shuffle: bool = True
    """Shuffle once with `seed` before training; both backends consume that same order."""

    preprocessing_num_workers: int | None = None
    """Processes for tokenization (datasets.map num_proc); None: in-process."""

    preprocessing_batch_size: int = 1000
    """Rows per batch handed to each tokenization call."""

    overwrite_cache: bool = False
    """Ignore the preprocessing cache (and a prepared tokenized_path) and tokenize and pack again."""

    tokenized_path: str | None = None
    """Directory of prepared data: the first run saves its tokenized (and packed) rows there, later runs, other nodes and the other backend load them without tokenizing; a recipe whose data settings differ from the saved ones is refused. `roll-train RECIPE --prepare-data` only prepares."""

    def __post_init__(self) -> None:
        if self.cutoff_len < 2:
            raise ConfigError(f"cutoff_len must be at least 2, got {self.cutoff_len}.")
        if self.val_size < 0 or (self.val_size >= 1 and self.val_size != int(self.val_size)):
            raise ConfigError(f"val_size must be a fraction in [0, 1) or a whole row count, got {self.val_size}.")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"max_samples must be positive, got {self.max_samples}.")
        if self.preprocessing_num_workers is not None and self.preprocessing_num_workers < 1:
            raise ConfigError(f"preprocessing_num_workers must be positive, got {self.preprocessing_num_workers}.")
        if self.preprocessing_batch_size < 1:
            raise ConfigError(f"preprocessing_batch_size must be positive, got {self.preprocessing_batch_size}.")
