"""Which data to train on and how it is tokenized, truncated and packed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roll.config.coerce import closest
from roll.data.named_templates import check_template_options
from roll.data.vision_resize import image_resize
from roll.errors import ConfigError

MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
KTO_MISMATCHED_ROWS = ("auto", "micro_batch", "llamafactory")


@dataclass
class DataArguments:
    dataset: str | None = None
    """One or more comma-separated sources: names registered in dataset_dir/dataset_info.json (LLaMA-Factory's registry), .json/.jsonl/.parquet/.csv/.txt files, directories of them, or a saved datasets directory."""

    eval_dataset: str | None = None
    """Sources for evaluation, same syntax as dataset (alternative to val_size)."""

    dataset_dir: str = "data"
    """The folder of dataset_info.json, the registry of dataset names (LLaMA-Factory's format; relative to the working directory); its file_name entries are relative to it."""

    formatting: Literal["auto", "alpaca", "sharegpt", "pairwise", "text"] = "auto"
    """Row format; 'auto' detects it from the columns."""

    template: str | None = None
    """Chat template: None uses the tokenizer's own; a name (qwen, qwen3, qwen3_nothink, qwen2_vl, llama3, mistral, deepseek3, glm4, chatml, default, empty) lays conversations out, labels and truncates them as LLaMA-Factory's template of that name does."""

    tool_format: str | None = None
    """With a named template: the format of tool lists and function calls (LLaMA-Factory's tool_format: default, qwen, llama3, mistral, glm4) instead of the template's own; a call is then laid out as the reply then EOS (efficient_eos: the reply alone), as LLaMA-Factory does."""

    default_system: str | None = None
    """The system prompt of conversations that have none (replaces a named template's default one)."""

    enable_thinking: bool = True
    """Reasoning templates (qwen3): an empty thought before a reply without one is trained (false: it is prompt, and thoughts are removed from replies); false is also passed to the tokenizer's chat template."""

    preserve_thinking: bool = False
    """Reasoning templates: keep the thoughts of earlier replies (by default they are removed from the history)."""

    image_max_pixels: int | None = None
    """Vision-language models: an image of more pixels is scaled down to about this many first, as LLaMA-Factory 0.9.5 does before the model's image processor (its arithmetic, PIL's default filter); unset: LLaMA-Factory's 768*768 with template: qwen2_vl or with image_min_pixels set, else no scaling first (the model's processor alone, with its own min_pixels / max_pixels). docs/vl.md, 'Image sizes'."""

    image_min_pixels: int | None = None
    """Vision-language models: an image of fewer pixels is scaled up to about this many first, as LLaMA-Factory 0.9.5 does; unset: LLaMA-Factory's 32*32 with template: qwen2_vl or with image_max_pixels set, else no scaling first."""

    train_on_prompt: bool = False
    """Train on the prompt tokens too (system, user turns, role headers), not only on the replies."""

    cutoff_len: int = 1024
    """Maximum tokens per sample (per packed row with packing). Prompts are trimmed before answers."""

    train_on_last_turn_only: bool = False
    """In multi-turn conversations, train only on the last assistant turn instead of every assistant turn (LLaMA-Factory's mask_history; with a named template the last turn also comes first when truncating)."""

    packing: bool = False
    """Pack several samples into each cutoff_len row (never splitting one); attention never crosses samples."""

    packing_algorithm: Literal["best_fit", "llamafactory"] = "best_fit"
    """With packing (sft): best_fit packs all rows best-fit decreasing (fuller rows); llamafactory packs as LLaMA-Factory 0.9.5 does, for the same rows in the same order: greedily per tokenization batch (preprocessing_batch_size rows, per preprocessing_num_workers shard), samples cut to cutoff_len - 1 and rows of cutoff_len - 1 tokens."""

    kto_mismatched_rows: Literal["auto", "micro_batch", "llamafactory"] = "auto"
    """stage kto: where each row's mismatched row (the KL reference point's prompt with another reply) takes its reply. micro_batch: the previous row of its micro-batch (TRL's rotation; 2 or more rows a micro-batch); llamafactory: the previous row of its tokenization batch (preprocessing_batch_size rows, per preprocessing_num_workers shard; the first row takes the batch's last), paired when tokenized, as LLaMA-Factory 0.9.5 does, so a micro-batch may hold one row; auto: micro_batch, or llamafactory when a kto micro-batch holds one row (per_device_train/eval_batch_size 1)."""

    max_samples: int | None = None
    """Use the first this many rows of each dataset entry (before mixing), as LLaMA-Factory does."""

    val_size: float = 0.0
    """Fraction (0-1) or count (>=1) of training rows held out for evaluation."""

    shuffle: bool = True
    """Each epoch in the HF Trainer's seeded random order (data_seed, else seed, plus the epoch) on both backends; false: the data's own order (LLaMA-Factory's disable_shuffling)."""

    preprocessing_num_workers: int | None = None
    """Processes for tokenization (datasets.map num_proc); None: in-process."""

    preprocessing_batch_size: int = 1000
    """Rows per batch handed to each tokenization call."""

    overwrite_cache: bool = False
    """Ignore the preprocessing cache (and a prepared tokenized_path) and tokenize and pack again."""

    tokenized_path: str | None = None
    """Directory of prepared data: the first run saves its tokenized (and packed) rows there, later runs, other nodes and the other backend load them without tokenizing; a recipe whose data settings differ from the saved ones is refused. `roll-train RECIPE --prepare-data` only prepares."""

    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = "concat"
    """How the comma-separated datasets of `dataset:` are mixed: one after the other (concat), or one row at a time until the first is exhausted (interleave_under) or until all are (interleave_over, smaller ones repeat)."""

    interleave_probs: list[float] | None = None
    """With interleave_*: the probability of drawing from each dataset (one per entry of `dataset:`, summing to 1, e.g. 0.7,0.3); unset: round robin."""

    streaming: bool = False
    """Read `dataset:` as a stream (tokenized, shuffled and packed as it is read; never all in memory): for corpora larger than memory or disk cache. Needs max_steps; see docs/data.md, 'Streaming'."""

    buffer_size: int = 16384
    """With streaming: rows in the shuffle buffer (a row is drawn at random from it as the next one is read); with packing also the most samples packed together in one block (the first block of a pass has 512, each next one twice the last)."""

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
        if self.packing_algorithm not in ("best_fit", "llamafactory"):
            raise ConfigError(f"packing_algorithm must be best_fit or llamafactory, got {self.packing_algorithm!r}.")
        if self.packing_algorithm == "llamafactory" and self.packing and self.streaming:
            raise ConfigError("packing_algorithm: llamafactory is not supported with streaming: roll's stream packs "
                              "blocks of its shuffle buffer best-fit (docs/data.md, 'Streaming'); use "
                              "packing_algorithm: best_fit, or streaming: false for LLaMA-Factory's rows.")
        if self.kto_mismatched_rows not in KTO_MISMATCHED_ROWS:
            raise ConfigError(f"kto_mismatched_rows must be one of {', '.join(KTO_MISMATCHED_ROWS)}, got "
                              f"{self.kto_mismatched_rows!r}.")
        if self.buffer_size < 1:
            raise ConfigError(f"buffer_size must be positive, got {self.buffer_size}.")
        image_resize(self)  # the bounds checked now (roll.data.vision_resize), before any model loads
        problem = check_template_options(self.template, self.train_on_prompt, self.train_on_last_turn_only,
                                         self.tool_format)
        if problem:
            raise ConfigError(problem)
        self._check_mixing()

    def _check_mixing(self) -> None:
        if self.mix_strategy not in MIX_STRATEGIES:
            hint = closest(str(self.mix_strategy), MIX_STRATEGIES)
            raise ConfigError(f"mix_strategy={self.mix_strategy!r} is not one of {', '.join(MIX_STRATEGIES)}"
                              + (f" (did you mean {hint!r}?)." if hint else "."))
        probs = self.interleave_probs
        if probs is None:
            return
        if self.mix_strategy == "concat":
            raise ConfigError("interleave_probs is used with mix_strategy interleave_under or interleave_over; "
                              "with concat every row of every dataset is used once: set mix_strategy or drop "
                              "interleave_probs.")
        entries = [p for p in (self.dataset or "").split(",") if p.strip()]
        if len(probs) != len(entries):
            raise ConfigError(f"interleave_probs has {len(probs)} value(s) but dataset has {len(entries)} "
                              f"comma-separated entr{'y' if len(entries) == 1 else 'ies'} ({self.dataset!r}): "
                              "give one probability per dataset.")
        if any(p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
            raise ConfigError(f"interleave_probs {probs} must be non-negative and sum to 1 (they sum to "
                              f"{sum(probs):.6g}).")


def check_streaming(data: DataArguments, training, stage: str) -> None:
    """What streaming cannot do, refused before any model loads (docs/data.md, 'Streaming')."""
    if not data.streaming:
        return
    refusals = [
        (stage not in ("pt", "sft"), f"stage {stage} cannot stream (pt and sft can): set streaming: false."),
        (training.max_steps <= 0, "a stream has no length, so the run needs max_steps (e.g. max_steps: 1000); "
                                  "num_train_epochs cannot say when to stop."),
        (bool(data.val_size), f"val_size={data.val_size} would hold rows out of a stream that is never all in "
                              "hand: set eval_dataset (read in full, not streamed) and val_size: 0."),
        (data.max_samples is not None, "max_samples caps an in-memory dataset; a stream's length is set by "
                                       "max_steps: drop max_samples."),
        (bool(data.tokenized_path), f"tokenized_path={data.tokenized_path} saves a dataset held whole, and a "
                                    "stream never is: drop tokenized_path (or set streaming: false)."),
    ]
    for strategy in ("eval_strategy", "save_strategy", "logging_strategy"):
        value = str(getattr(getattr(training, strategy, None), "value", getattr(training, strategy, None)))
        refusals.append((value == "epoch", f"{strategy}=epoch: a stream has no epochs; use steps with "
                                           f"{strategy.replace('strategy', 'steps')}."))
    for refused, message in refusals:
        if refused:
            raise ConfigError(f"streaming: true: {message}")
