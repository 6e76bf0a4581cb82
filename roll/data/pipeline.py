"""build_datasets: sources -> formats -> tokenized rows -> stats -> split -> (pack).

Order of operations: each source is loaded and capped to its first ``max_samples`` rows (LLaMA-Factory's
meaning), tokenized with a batched, cached ``datasets.map``, the sources are mixed, rows without a
trainable token are dropped and counted, ``val_size`` rows are held out (seeded) and, with ``packing``, the
rest packed. The rows are not shuffled here: both backends draw each epoch's order from
``roll.data.order`` (the HF Trainer's seeded sampler; DESIGN.md section 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

from roll import IGNORE_INDEX
from roll.data import formats as fmts
from roll.data import prepared
from roll.data.fingerprint import code_digest, settings_digest, tokenizer_digest
from roll.data.loading import Source, load_sources
from roll.data.mixing import entry_sizes, mix_datasets
from roll.data.named_templates import encoder_for
from roll.data.packing import PT_LLAMAFACTORY_PACKING, pack_dataset
from roll.data.policy import PAIR_PREFIXES
from roll.data.feedback import FeedbackProcessor, check_both_labels
from roll.data.processors import (META_COLUMNS, PairwiseProcessor, PretrainProcessor, SupervisedProcessor)
from roll.data.reward import RewardProcessor
from roll.data.stats import PreprocessStats
from roll.data.tokenizer import pretrain_eos_id
from roll.data.vision import VisionSupervisedProcessor
from roll.data.vision import check_source as vision_check_source
from roll.data.vision import media_dir as vision_media_dir
from roll.errors import ConfigError, DataError
from roll.launch import local_rank
from roll.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)

COUNT_BATCH_ROWS = 8192
"""Rows per batch when counting tokens (_count): at 200k alpaca rows, 65,536-row batches raised a warm start's
peak anonymous memory from 372 to 637 MB, for no measurable speed (docs/performance.md, the data benchmark)."""

PROCESSORS = {"pretrain": PretrainProcessor, "supervised": SupervisedProcessor, "pairwise": PairwiseProcessor,
              "feedback": FeedbackProcessor, "reward": RewardProcessor}
PAIRWISE = ("pairwise", "reward")
"""Processors whose rows are pairs (``chosen_*`` / ``rejected_*``)."""


@dataclass
class DatasetBundle:
    train: "datasets.Dataset"  # noqa: F821
    eval: "datasets.Dataset | None"  # noqa: F821
    stats: PreprocessStats


def build_datasets(data_args, tokenizer, *, stage: str, processor: str, formats: tuple[str, ...],
                   seed: int, vision=None) -> DatasetBundle:
    """Tokenized train (and eval) datasets for ``stage`` plus the preprocessing stats; ``vision``
    (roll.data.vision.Vision) lays out the images of a vision-language model's rows."""
    if processor not in PROCESSORS:
        raise ValueError(f"unknown processor {processor!r}; known: {', '.join(PROCESSORS)}")
    if data_args.packing and processor in (*PAIRWISE, "feedback"):
        raise ConfigError(f"packing is not supported for stage {stage}; set packing: false.")
    if llamafactory_packing(data_args) and processor == "pretrain":
        raise ConfigError(PT_LLAMAFACTORY_PACKING)
    build = functools.partial(_build, data_args, tokenizer, stage=stage, processor=processor, formats=formats,
                              seed=seed, vision=vision)
    with local_rank0_first():
        if data_args.streaming:
            return _build_streaming(data_args, tokenizer, stage=stage, processor=processor, formats=formats,
                                    seed=seed)
        if data_args.tokenized_path:
            settings = prepared.data_settings(data_args, tokenizer, stage=stage, seed=seed)
            return prepared.load_or_prepare(data_args.tokenized_path, settings, build,
                                            rebuild=_fresh(data_args))
        return build()


def _build_streaming(data_args, tokenizer, *, stage: str, processor: str, formats: tuple[str, ...],
                     seed: int) -> DatasetBundle:
    """roll.data.streaming's bundle; its eval_dataset is read in full, as without streaming."""
    import dataclasses

    from roll.data.streaming import build_streaming

    def build_eval():
        args = dataclasses.replace(data_args, dataset=data_args.eval_dataset, eval_dataset=None,
                                   streaming=False, shuffle=False, mix_strategy="concat", interleave_probs=None)
        return _build(args, tokenizer, stage=stage, processor=processor, formats=formats, seed=seed).train

    return build_streaming(data_args, tokenizer, stage=stage, seed=seed,
                           make_processor=functools.partial(make_processor, data_args=data_args,
                                                            tokenizer=tokenizer, stage=stage,
                                                            processor=processor, allowed=formats),
                           build_eval=build_eval)


@contextlib.contextmanager
def local_rank0_first():
    """In a distributed run each node's local rank 0 tokenizes first; the other ranks load its cache."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    first = local_rank() == 0
    if distributed and not first:
        dist.barrier()
    try:
        yield
    finally:
        if distributed and first:
            dist.barrier()


def _fresh(data_args) -> bool:
    """overwrite_cache: packed rows and prepared data are written again by each node's local rank 0 only (the
    other ranks, which wait for it, load what it wrote)."""
    return data_args.overwrite_cache and local_rank() == 0


def _build(data_args, tokenizer, *, stage: str, processor: str, formats: tuple[str, ...],
           seed: int, vision=None) -> DatasetBundle:
    start = time.perf_counter()
    stats = PreprocessStats()
    sources, sizes = _cap(load_sources(data_args.dataset, data_args.dataset_dir), data_args.dataset, data_args)
    stats.num_samples_in = sum(len(s.dataset) for s in sources)
    tokenized = mix_datasets([_tokenize(s, data_args, tokenizer, stage, processor, formats, vision) for s in sources],
                             data_args, seed, sizes=sizes)
    kept = len(tokenized) and any(d == "" for d in tokenized["_drop"])
    if processor == "pretrain" and not kept and len(tokenized) < stats.num_samples_in:  # texts, no whole row
        raise DataError(f"{data_args.dataset}: no training row: the texts of each tokenization batch "
                        f"({data_args.preprocessing_batch_size} rows) hold fewer than cutoff_len={data_args.cutoff_len} "
                        "tokens, and stage pt drops a batch's short remainder, as LLaMA-Factory does. Lower "
                        "cutoff_len, or set packing: true (every document its own sample).")
    train = _drop_skipped(tokenized, stats)
    eval_ds = None
    if data_args.eval_dataset:
        eval_sources, _ = _cap(load_sources(data_args.eval_dataset, data_args.dataset_dir), data_args.eval_dataset,
                               data_args)
        eval_ds = _drop_skipped(_concat([_tokenize(s, data_args, tokenizer, stage, processor, formats, vision)
                                         for s in eval_sources]), PreprocessStats())
    elif data_args.val_size:
        train, eval_ds = _hold_out(train, data_args.val_size, seed)
    if processor == "feedback":
        check_both_labels(train, data_args.dataset)
    _count(train, stats, pairwise=processor in PAIRWISE)
    if processor != "pretrain" and stats.num_truncated == len(train):  # pt chunks to cutoff_len by design
        raise DataError(f"every one of the {len(train)} training samples is longer than cutoff_len="
                        f"{data_args.cutoff_len} and was cut (prompt trimmed, answer shortened): the model "
                        "would never see a whole example. Raise cutoff_len.")
    train = train.remove_columns([c for c in META_COLUMNS if c in train.column_names])
    if eval_ds is not None:
        stats.num_eval_samples = len(eval_ds)
        eval_ds = eval_ds.remove_columns([c for c in META_COLUMNS if c in eval_ds.column_names])
    if data_args.packing:
        reuse = not _fresh(data_args)
        lf_batches = ((data_args.preprocessing_batch_size, data_args.preprocessing_num_workers)
                      if llamafactory_packing(data_args) else None)
        pack = functools.partial(pack_dataset, capacity=sample_cutoff(data_args), use_cache=reuse,
                                 llamafactory=lf_batches)
        train, stats.packing_efficiency = pack(train)
        if eval_ds is not None:
            eval_ds, _ = pack(eval_ds)
    stats.num_rows = len(train)
    stats.preprocess_seconds = round(time.perf_counter() - start, 3)
    for line in stats.summary_lines():
        log_rank0(logger, "data: %s", line)
    return DatasetBundle(train=train, eval=eval_ds, stats=stats)


def llamafactory_packing(data_args) -> bool:
    """packing as LLaMA-Factory 0.9.5 packs (``packing_algorithm: llamafactory``)."""
    return data_args.packing and data_args.packing_algorithm == "llamafactory"


def sample_cutoff(data_args) -> int:
    """The most tokens of a sample and of a packed row: cutoff_len, or cutoff_len - 1 when packing as
    LLaMA-Factory does (it lowers cutoff_len by one with packing, then pads each row to cutoff_len)."""
    return data_args.cutoff_len - 1 if llamafactory_packing(data_args) else data_args.cutoff_len


def _cap(sources: list[Source], spec: str, data_args) -> tuple[list[Source], list[int]]:
    """Each dataset entry's first ``max_samples`` rows, as LLaMA-Factory takes them (per entry of ``dataset:``,
    before mixing; a folder entry's files in order, the files past the cap left out), and how many files each
    entry keeps (``roll.data.mixing.mix_datasets``' ``sizes``)."""
    sizes = entry_sizes(spec, data_args.dataset_dir)
    if data_args.max_samples is None:
        return sources, sizes
    kept, kept_sizes, start = [], [], 0
    for size in sizes:
        left, count = data_args.max_samples, 0
        for source in sources[start:start + size]:
            if left == 0:
                break
            n = min(left, len(source.dataset))
            if n < len(source.dataset):
                rows = None if source.file_rows is None else source.file_rows[:n]
                source = dataclasses.replace(source, dataset=source.dataset.select(range(n)), file_rows=rows)
            kept.append(source)
            left, count = left - n, count + 1
        kept_sizes.append(count)
        start += size
    return kept, kept_sizes


def resolve_format(source: Source, formatting: str, allowed: tuple[str, ...], stage: str) -> str:
    """The row format of one source: a registry entry's, else detected from its columns unless
    ``formatting:`` names one."""
    columns = list(source.dataset.column_names)
    if source.entry is not None:
        fmt = source.entry.format_for(allowed, stage)
        missing = source.entry.missing_columns(fmt, columns)
        if missing:
            raise DataError(f"{source.name}: {source.entry.describe()}: {'; '.join(missing)} (the file's columns: "
                            f"{columns}); fix the entry's columns.")
        unread = source.entry.unread_columns(columns)
        if unread:
            warn_once(logger, f"{source.entry.describe()}: the file's column(s) {', '.join(unread)} are not read: "
                              "with `columns`, LLaMA-Factory's registry reads only the columns it names.")
        return fmt
    fmt = fmts.detect(columns) if formatting == "auto" else formatting
    if fmt is None:
        raise DataError(f"{source.name}: cannot tell the row format from the columns {columns}; "
                        f"stage {stage} "
                        f"expects {' or '.join(allowed)} rows (see docs/data.md), or set `formatting:`.")
    if fmt not in allowed:
        raise DataError(f"{source.name}: {fmt} rows (columns {columns}) cannot be used for stage {stage}, "
                        f"which expects {' or '.join(allowed)} rows.")
    missing = fmts.missing_columns(fmt, columns)
    if missing:
        raise DataError(f"{source.name}: {fmt} rows need the column(s) {', '.join(missing)}; "
                        f"the file has {columns}.")
    return fmt


def make_processor(source: Source, *, data_args, tokenizer, stage: str, processor: str,
                   allowed: tuple[str, ...], vision=None):
    """The stage processor (a batched map function) for one source, whose format it resolves."""
    fmt = resolve_format(source, data_args.formatting, allowed, stage)
    vision_check_source(source, vision)
    encoder = encoder_for(data_args)
    chat = {"encoder": encoder, "default_system": data_args.default_system,
            "enable_thinking": data_args.enable_thinking}
    options = {"supervised": {"train_turns": "last" if data_args.train_on_last_turn_only else "all",
                              "train_on_prompt": data_args.train_on_prompt, **chat},
               "pairwise": chat, "reward": chat,
               "feedback": {"encoder": encoder, "pair_in_batch": data_args.kto_mismatched_rows == "llamafactory"},
               "pretrain": {"packing": data_args.packing,
                            "eos_id": pretrain_eos_id(tokenizer, encoder.template) if encoder else None}}
    if vision is not None:  # roll.data.vision: images laid out (stage sft only, roll.data.vision.check_config)
        options[processor].update(vision=vision, media_dir=vision_media_dir(source, data_args),
                                  images_column=source.entry.column("images") if source.entry else "images")
        return VisionSupervisedProcessor(tokenizer=tokenizer, cutoff_len=sample_cutoff(data_args), fmt=fmt,
                                         source=source.name, file_rows=source.file_rows, entry=source.entry,
                                         **options[processor])
    return PROCESSORS[processor](tokenizer=tokenizer, cutoff_len=sample_cutoff(data_args), fmt=fmt,
                                 source=source.name, file_rows=source.file_rows, entry=source.entry,
                                 **options.get(processor, {}))


def _tokenize(source: Source, data_args, tokenizer, stage: str, processor: str, allowed: tuple[str, ...],
              vision=None):
    fn = make_processor(source, data_args=data_args, tokenizer=tokenizer, stage=stage, processor=processor,
                        allowed=allowed, vision=vision)
    ds = source.dataset
    if len(ds) == 0:
        raise DataError(f"{source.name} has no rows.")
    return ds.map(fn, batched=True, with_indices=True, batch_size=data_args.preprocessing_batch_size,
                  num_proc=data_args.preprocessing_num_workers, remove_columns=ds.column_names,
                  load_from_cache_file=not data_args.overwrite_cache, new_fingerprint=fingerprint(ds, fn),
                  desc=f"Tokenizing {source.name} ({stage})")


def fingerprint(ds, fn) -> str:
    """Cache key of a tokenization: input data, processor settings, tokenizer, and the processing code.

    Cheaper than letting ``datasets`` pickle the whole tokenizer (~2 s for Qwen's 151k vocab), and
    unlike that pickle it changes when roll's processing code changes, so a stale cache is never reused.
    """
    import sys

    from roll.data import (dataset_info, formats, named_templates, processors, templates, tool_formats, vision,
                           vision_resize)

    settings = {k: v for k, v in vars(fn).items() if k != "tokenizer"}
    # the processor's own module too (feedback for kto, reward for rm)
    modules = dict.fromkeys([formats, processors, templates, named_templates, tool_formats, dataset_info, vision,
                             vision_resize, sys.modules[type(fn).__module__]])
    return settings_digest(ds._fingerprint, type(fn).__name__, settings, tokenizer_digest(fn.tokenizer),
                           code_digest(*modules))


def _concat(parts: list):
    import datasets

    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _drop_skipped(ds, stats: PreprocessStats):
    reasons = Counter(r for r in ds["_drop"] if r)
    stats.add_drops(reasons)
    if reasons:
        log_rank0(logger, "data: skipped %d row(s): %s (see docs/data.md, 'Skipped rows')",
                  sum(reasons.values()),
                  ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())), level=logging.WARNING)
        ds = ds.filter(lambda drop: [d == "" for d in drop], batched=True, input_columns="_drop",
                       desc="Dropping skipped rows")
    if len(ds) == 0:
        hint = ("raise cutoff_len: every prompt fills it, leaving no answer token to train on"
                if "no_trainable_tokens" in reasons else "fix the rows (docs/data.md, 'Skipped rows')")
        raise DataError(f"no samples left after preprocessing: all {sum(reasons.values())} row(s) were "
                        "skipped "
                        f"({', '.join(f'{k}={v}' for k, v in sorted(reasons.items()))}); {hint}.")
    return ds


def _hold_out(ds, val_size: float, seed: int):
    # A fraction rounds up, as datasets' own train_test_split does; the split is then given this
    # exact count, so the check below judges the split that really happens.
    held_out = int(val_size) if val_size >= 1 else math.ceil(val_size * len(ds))
    if held_out < 1 or held_out >= len(ds):
        raise ConfigError(f"val_size={val_size} leaves no training or no eval rows out of {len(ds)}.")
    split = ds.train_test_split(test_size=held_out, seed=seed, shuffle=True)
    return split["train"], split["test"]


def _count(ds, stats: PreprocessStats, pairwise: bool) -> None:
    """Token counts of the training split, computed on arrow columns (no python loop over tokens), a batch at a
    time: a shuffled split's rows are gathered per batch, never the whole split into memory at once."""
    import pyarrow.compute as pc

    prefixes = PAIR_PREFIXES if pairwise else ("",)
    for table in ds.with_format("arrow").iter(batch_size=COUNT_BATCH_ROWS):
        for prefix in prefixes:
            stats.num_tokens += pc.sum(pc.list_value_length(table[f"{prefix}input_ids"])).as_py() or 0
            labels = pc.list_flatten(table[f"{prefix}labels"])
            stats.num_trainable_tokens += pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0
        stats.num_samples += pc.sum(table["_docs"]).as_py() or 0
        stats.num_truncated += pc.sum(table["_truncated"].cast("int64")).as_py() or 0
