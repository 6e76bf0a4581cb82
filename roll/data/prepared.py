"""``tokenized_path``: data prepared once, loaded by every later run, node and backend without tokenizing.

LLaMA-Factory's key and meaning: when the directory does not exist yet, the run builds its datasets as usual
(tokenized, split, shuffled, packed) and saves them there; when it exists, the rows are memory-mapped from it
and the sources are not read. Unlike LLaMA-Factory, which then ignores every other data setting, roll records
the settings the rows were built with (``roll_data.json``) and refuses a recipe whose settings differ, naming
each difference: training on rows that no longer match the recipe would be silent.

Layout: ``train/`` and ``eval/`` (``datasets.save_to_disk``) and ``roll_data.json`` (the settings, and the
preprocessing stats so that the data report and the logs read the same as on the first run). The directory is
written under a temporary name and renamed, so a reader never sees half of it and two nodes preparing one
shared path both leave a whole one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from typing import Callable

from roll.data.fingerprint import code_digest, tokenizer_digest
from roll.data.stats import PreprocessStats
from roll.errors import ConfigError
from roll.logging import log_rank0

logger = logging.getLogger(__name__)

MANIFEST = "roll_data.json"
FORMAT = 1
"""Version of the directory layout; a directory of another version is refused like changed settings."""

NOT_DATA_SETTINGS = frozenset({"tokenized_path", "overwrite_cache", "preprocessing_num_workers",
                               "preprocessing_batch_size"})
"""DataArguments fields that do not change the prepared rows; every other field is compared."""


def data_settings(data_args, tokenizer, *, stage: str, seed: int) -> dict:
    """What the prepared rows depend on: every row-changing data key, the stage, the seed, the tokenizer and
    roll's data-processing code (each a digest), by name."""
    from roll.data import (dataset_info, feedback, formats, named_templates, packing, processors, reward, templates,
                           tool_formats)

    settings = {f.name: getattr(data_args, f.name) for f in dataclasses.fields(data_args)
                if f.init and f.name not in NOT_DATA_SETTINGS}
    if (data_args.packing and data_args.packing_algorithm == "llamafactory") or (
            stage == "kto" and data_args.kto_mismatched_rows == "llamafactory"):  # packed (paired) per tokenization batch
        settings.update(preprocessing_batch_size=data_args.preprocessing_batch_size,
                        preprocessing_num_workers=data_args.preprocessing_num_workers)
    code = (formats, processors, templates, named_templates, tool_formats, dataset_info, packing) + (
        (feedback,) if stage == "kto" else ()) + ((reward,) if stage == "rm" else ())
    settings.update(stage=stage, seed=seed, tokenizer=tokenizer_digest(tokenizer),
                    registry={name: repr(entry) for name, entry in
                              dataset_info.registered_entries(data_args).items()},
                    roll_data_code=code_digest(*code))
    return json.loads(json.dumps(settings, default=str))  # the values as they read back from the manifest


def load_or_prepare(path: str, settings: dict, build: Callable, *, rebuild: bool = False):
    """The DatasetBundle saved at ``path`` when its settings equal ``settings``; else (nothing there, or
    ``rebuild``) ``build()``'s bundle, saved there first. ConfigError when ``path`` holds other settings."""
    if has_data(path) and not rebuild:
        return load(path, settings)
    bundle = build()
    save(bundle, path, settings, replace=rebuild)
    return load(path, settings)


def has_data(path: str) -> bool:
    """Whether ``path`` holds something (an empty directory is where to prepare, as in LLaMA-Factory)."""
    return os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))


def load(path: str, settings: dict):
    import datasets

    from roll.data.pipeline import DatasetBundle

    start = time.perf_counter()
    manifest = read_manifest(path)
    differences = compare(manifest.get("settings", {}), settings)
    if manifest.get("format") != FORMAT:
        differences.insert(0, f"layout version {manifest.get('format')} there, {FORMAT} here")
    if differences:
        raise ConfigError(f"tokenized_path {path} holds data prepared with other settings: "
                          f"{'; '.join(differences)}. Set the recipe back to those values, or point "
                          "tokenized_path at a new directory (or delete this one, or set overwrite_cache: "
                          "true) to prepare the data again.")
    stats = PreprocessStats(**manifest["stats"])
    train = datasets.load_from_disk(os.path.join(path, "train"))
    eval_dir = os.path.join(path, "eval")
    eval_ds = datasets.load_from_disk(eval_dir) if os.path.isdir(eval_dir) else None
    stats.preprocess_seconds = round(time.perf_counter() - start, 3)
    log_rank0(logger, "data: loaded the prepared rows from tokenized_path %s (%d training rows)", path,
              len(train))
    for line in stats.summary_lines():
        log_rank0(logger, "data: %s", line)
    return DatasetBundle(train=train, eval=eval_ds, stats=stats)


def read_manifest(path: str) -> dict:
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        raise ConfigError(f"tokenized_path {path} exists but holds no {MANIFEST}: it was not prepared by "
                          "roll (or not completely). Point tokenized_path at a new directory, or delete this "
                          "one, "
                          "to prepare the data there.")
    with open(manifest, encoding="utf-8") as handle:
        return json.load(handle)


def compare(saved: dict, current: dict) -> list[str]:
    """'key: X there, Y here' for each setting that differs, in key order."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            there = json.dumps(saved[key]) if key in saved else "(not recorded)"
            here = json.dumps(current[key]) if key in current else "(not a setting here)"
            out.append(f"{key}: {there} there, {here} here")
    return out


def save(bundle, path: str, settings: dict, *, replace: bool = False) -> None:
    """Write ``bundle`` to ``path`` (to a sibling temporary directory, then renamed into place)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}.partial")
    try:
        bundle.train.save_to_disk(os.path.join(partial, "train"))
        if bundle.eval is not None:
            bundle.eval.save_to_disk(os.path.join(partial, "eval"))
        manifest = {"format": FORMAT, "settings": settings, "stats": dataclasses.asdict(bundle.stats)}
        with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1)
        if replace and os.path.exists(path):
            shutil.rmtree(path)
        try:
            os.rename(partial, path)
        except OSError:
            if not os.path.isdir(path):  # else another node renamed its copy first: that one is used
                raise
        else:
            log_rank0(logger, "data: prepared rows saved to tokenized_path %s", path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
