"""Stage router: builds the shared data pieces for a stage and hands them to the chosen backend.

This module is the only place that knows the stage table. It drives a backend through the whole
``Backend`` interface: set-up, load, fine-tuning, train, evaluate (when there is an eval set), save.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Callable

from roll.checkpoints import clean_stale
from roll.config import RunConfig
from roll.contract import TrainJob, TrainResult
from roll.errors import ConfigError
from roll.gc_pause import start_up_objects_frozen
from roll.logging import is_rank0, log_rank0
from roll.registry import get_backend_class

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    """What the shared data pipeline does for one stage."""

    processor: str
    """Name of the stage processor in roll.data.processors."""
    collator: str
    """Name of the collator class in roll.data.collators."""
    formats: tuple[str, ...]
    """Row formats this stage accepts."""


STAGES: dict[str, StageSpec] = {
    "pt": StageSpec(processor="pretrain", collator="SequenceCollator", formats=("text",)),
    "sft": StageSpec(processor="supervised", collator="SequenceCollator", formats=("alpaca", "sharegpt")),
    "dpo": StageSpec(processor="pairwise", collator="PairwiseCollator", formats=("pairwise",)),
    "kto": StageSpec(processor="feedback", collator="FeedbackCollator", formats=("alpaca", "sharegpt")),
    "rm": StageSpec(processor="reward", collator="PairwiseCollator", formats=("pairwise",)),
}


def build_job(config: RunConfig, padding_policy) -> tuple[TrainJob, object]:
    """Tokenizer, datasets and collator for the configured stage; returns (job, preprocessing stats)."""
    from roll import data
    from roll.data.vision import load_vision

    spec = STAGES[config.finetuning.stage]
    tokenizer = data.load_tokenizer(config.model, config.data)
    vision = load_vision(config.model, tokenizer, config.data)
    bundle = data.build_datasets(config.data, tokenizer, stage=config.finetuning.stage,
                                 processor=spec.processor, formats=spec.formats, seed=config.training.seed,
                                 vision=vision)
    collator = data.build_collator(spec.collator, tokenizer, padding_policy, config.data, vision=vision)
    job = TrainJob(stage=config.finetuning.stage, tokenizer=tokenizer, train_dataset=bundle.train,
                   eval_dataset=bundle.eval, collator=collator)
    return job, bundle.stats


def check_batch_fits(config: RunConfig, rows: int, dp_size: int) -> None:
    """One global batch must fit in the training set (after packing, val_size and max_samples): otherwise the
    standard backend trains on smaller batches than asked and Megatron builds batches it cannot fill."""
    t = config.training
    batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp_size
    if rows < batch:
        packed = " packed" if config.data.packing else ""
        raise ConfigError(f"one global batch is {batch} samples (per_device_train_batch_size "
                          f"{t.per_device_train_batch_size} * gradient_accumulation_steps "
                          f"{t.gradient_accumulation_steps} * data-parallel size {dp_size}) but the training "
                          f"set has {rows}{packed} rows: not one full step. Lower "
                          "per_device_train_batch_size or gradient_accumulation_steps, or add data.")


def _set_stream_length(config: RunConfig, job: TrainJob, dp_size: int, *, share: bool = False) -> None:
    """A streamed training set is as long as the run reads: max_steps global batches (roll.data.streaming);
    with ``share`` only each node's local rank 0 reads it."""
    from roll.data.streaming import set_stream_length, share_stream

    t = config.training
    set_stream_length(job.train_dataset, t.max_steps,
                      t.per_device_train_batch_size * t.gradient_accumulation_steps * dp_size)
    if share:
        share_stream(job.train_dataset, t.output_dir)


def _check_resumed_data(config: RunConfig, job: TrainJob, dp_size: int) -> None:
    """A resumed run must train on the training set its checkpoint was trained on (every rank alike)."""
    from roll import resume_record
    from roll.checkpoints import resolve_resume

    t = config.training
    checkpoint = resolve_resume(t.resume_from_checkpoint, t.output_dir)
    if checkpoint is not None:
        resume_record.check_same_data(checkpoint, job.train_dataset, dataset_spec=config.data.dataset,
                                      global_batch_size=t.per_device_train_batch_size
                                      * t.gradient_accumulation_steps * dp_size)


def prepare_data(config: RunConfig, *, as_json: bool = False, out: Callable[[str], None] | None = None) -> None:
    """--prepare-data: build the datasets into ``tokenized_path`` (tokenizer only: no backend, no model) and
    print the data summary."""
    from roll import data
    from roll.data.prepared import has_data
    from roll.data.report import SUMMARY_KEYS
    from roll.model_dir import check_model_exists

    path = config.data.tokenized_path
    if not path:
        raise ConfigError("--prepare-data saves the prepared data to tokenized_path, which is not set: add "
                          "`tokenized_path: DIR` to the recipe (or tokenized_path=DIR on the command line).")
    check_model_exists(config.model.tokenizer_name_or_path or config.model.model_name_or_path,
                       "tokenizer_name_or_path" if config.model.tokenizer_name_or_path else "model_name_or_path")
    existed = has_data(path) and not config.data.overwrite_cache
    spec = STAGES[config.finetuning.stage]
    tokenizer = data.load_tokenizer(config.model, config.data)
    bundle = data.build_datasets(config.data, tokenizer, stage=config.finetuning.stage,
                                 processor=spec.processor, formats=spec.formats, seed=config.training.seed)
    stats = bundle.stats
    summary = {key: getattr(stats, key) for key in SUMMARY_KEYS}
    summary.update(tokenized_path=path, already_prepared=existed, num_rows=stats.num_rows,
                   num_eval_rows=0 if bundle.eval is None else len(bundle.eval))
    verb = "already held these settings' data" if existed else "prepared"
    text = "\n".join([f"tokenized_path {path}: {verb}", *("  " + line for line in stats.summary_lines()),
                      f"train with tokenized_path: {path} (either backend, any node that sees it)"])
    (out or sys.stdout.write)(json.dumps(summary) + "\n" if as_json else text + "\n")


def run(config: RunConfig, *, dry_run: bool = False, as_json: bool = False,
        out: Callable[[str], None] | None = None) -> TrainResult | None:
    """Run the configured stage end to end (or only the data side with dry_run, written with ``out``:
    by default the current ``sys.stdout``, looked up at call time so a caller may have replaced it)."""
    from roll import unpickle

    unpickle.set_trusted(config.model.trust_checkpoint_pickles)  # loads deep inside DeepSpeed / PyTorch DCP
    backend = get_backend_class(config.backend_name)(config)
    policy = backend.padding_policy(config.finetuning.stage)
    if dry_run:
        from roll.data.report import dry_run_report

        job, stats = build_job(config, policy)
        _set_stream_length(config, job, dp_size=1)
        stats.num_rows = len(job.train_dataset)
        summary, text = dry_run_report(job, stats)
        (out or sys.stdout.write)(json.dumps(summary) + "\n" if as_json else text)
        return None
    from roll.checkpoints import prepare_output_dir
    from roll.outputs import run_identity, write_marker

    for path in prepare_output_dir(config.training, is_rank0=is_rank0()):  # no lost work: refuse or replace
        logger.warning("overwrite_output_dir: deleted %s, a checkpoint of an earlier run", path)
    try:  # teardown also after a failed set-up: it may have set env vars or a process group
        info = backend.setup_distributed()
        if is_rank0():
            clean_stale(config.training.output_dir)
        job, _ = build_job(config, policy)
        _set_stream_length(config, job, info.dp_size, share=True)
        check_batch_fits(config, len(job.train_dataset), info.dp_size)
        _check_resumed_data(config, job, info.dp_size)
        log_rank0(logger, "stage %s on the %s backend: %d process(es), data-parallel size %d",
                  config.finetuning.stage, config.backend_name, info.world_size, info.dp_size)
        models = backend.apply_finetuning(backend.load_models(job.stage, job.tokenizer))
        if is_rank0():  # after the model loaded: a mistake found while loading leaves output_dir untouched
            write_marker(config.training.output_dir, run_identity(config))
        with start_up_objects_frozen():  # no full garbage-collector pass over the start-up's objects mid-training
            result = backend.train(job, models)
        if job.eval_dataset is not None:
            metrics = backend.evaluate(job, models)
            result.metrics.update(metrics)
            log_rank0(logger, "evaluation: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())))
        if config.training.save_hf_model:
            result.hf_model_dir = backend.save(models, job.tokenizer, config.training.output_dir)
            log_rank0(logger, "final model (HF format) written to %s", result.hf_model_dir)
        if is_rank0():
            _plot_losses(config, info.world_size)
        return result
    finally:
        backend.teardown()


def _plot_losses(config: RunConfig, world_size: int) -> None:
    """OUTPUT_DIR/loss.png from the train_log.jsonl the backend wrote (never fails the run)."""
    from roll.plot import write_loss_plot

    processes = "1 process" if world_size == 1 else f"{world_size} processes"
    tuning = config.finetuning
    title = f"{tuning.stage} ({tuning.finetuning_type}), {config.backend_name} backend, {processes}"
    path = write_loss_plot(config.training.output_dir, title)
    if path:
        logger.info("loss curve written to %s", path)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
