"""Raw dataset loading: registered names (roll.data.dataset_info), local files, directories of them, saved
datasets, or hub names.

Each file is loaded as its own ``datasets.Dataset`` so that an error can name the file and the
row index inside it. Loading goes through ``datasets.load_dataset``, whose arrow cache under the
HF datasets cache (``HF_DATASETS_CACHE``) is what makes the later ``map`` steps cacheable.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

from roll.data.dataset_info import DatasetEntry, lookup, read_registry, unknown_name
from roll.errors import DataError

logger = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
"""File extension -> datasets builder."""


@dataclass
class Source:
    """One loaded file (or saved dataset / hub dataset) and the name errors should show."""

    name: str
    dataset: "datasets.Dataset"  # noqa: F821
    file_rows: list[int] | None = None
    """The file's row index of each dataset row when only some rows were kept (max_samples), so that
    errors still name the row in the file; None when the dataset is the whole file in order."""
    entry: DatasetEntry | None = None
    """The registry entry the file belongs to (its format, columns and tags), when named by one."""


def split_sources(spec: str | None) -> list[str]:
    """'a.json, b.jsonl' -> ['a.json', 'b.jsonl']."""
    parts = [p.strip() for p in (spec or "").split(",") if p.strip()]
    if not parts:
        raise DataError("no dataset given: set `dataset:` to one or more comma-separated files or "
                        "directories.")
    return parts


def resolve_source(part: str, dataset_dir: str | None = None) -> tuple[list[str], DatasetEntry | None]:
    """The files behind one ``dataset:`` entry and, for a name registered in dataset_dir/dataset_info.json,
    its registry entry (a registered name wins over a path of the same spelling)."""
    entry = lookup(part, dataset_dir)
    if entry is None:
        return expand(part, dataset_dir), None
    if entry.hub:
        if hub_offline():
            raise DataError(f"{entry.describe()} is the Hub dataset {entry.location!r} (hf_hub_url), and the Hub "
                            f"is off ({', '.join(OFFLINE_ENV)}): download its rows and register their file.")
        return [entry.location], entry
    if not os.path.exists(entry.location):
        raise DataError(f"{entry.describe()}: its file_name {entry.location!r} does not exist.")
    return expand(entry.location, dataset_dir), entry


def expand(spec: str, dataset_dir: str | None = None) -> list[str]:
    """Files (or a saved dataset dir, or a hub name) behind one source string, in a stable order."""
    if os.path.isfile(spec):
        _builder_for(spec)
        return [spec]
    if os.path.isdir(spec):
        if _is_saved_dataset(spec):
            return [spec]
        files = sorted(os.path.join(spec, f) for f in os.listdir(spec)
                       if os.path.splitext(f)[1].lower() in BUILDERS and not f.startswith("."))
        if not files:
            raise DataError(f"dataset directory {spec} has no {'/'.join(BUILDERS)} files and is not a "
                            "saved dataset.")
        return files
    if _looks_like_hub_name(spec) and not hub_offline() and read_registry(dataset_dir) is None:
        return [spec]
    hint = f" (hub names need network; one of {', '.join(OFFLINE_ENV)} is set)" if hub_offline() else ""
    raise DataError(f"dataset source {spec!r} not found: {unknown_name(spec, dataset_dir)}{hint}.")


def load_sources(spec: str | None, dataset_dir: str | None = None) -> list[Source]:
    """Load every file behind a comma-separated ``dataset:`` value."""
    sources = []
    for part in split_sources(spec):
        paths, entry = resolve_source(part, dataset_dir)
        for path in paths:
            sources.append(Source(name=path, dataset=_load_one(path), entry=entry))
    return sources


def _load_one(path: str):
    import datasets

    if os.path.isdir(path):
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"saved dataset {path} has splits {list(loaded)}; "
                                "roll needs a 'train' split.")
            loaded = loaded["train"]
        return loaded
    if not os.path.exists(path):
        return datasets.load_dataset(path, split="train")
    builder = _builder_for(path)
    if _is_blank(path):
        raise DataError(f"{path} is empty (no rows): add rows or remove it from dataset:.")
    if builder == "json":
        check_json_depth(path)
    try:
        dataset = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as exc:  # the arrow error rarely names the row: find it ourselves
        raise DataError(f"cannot read {path}: {diagnose(path, builder) or exc}") from exc
    if builder == "json":
        check_mixed_types(dataset, path)
    return dataset


def check_mixed_types(dataset, path: str) -> None:
    """Reject a column whose rows hold different JSON types (e.g. one 'output' is a number).

    ``datasets`` stores such a column as ``Json`` and decodes every value with json.loads, which
    silently turns the *string* "3" into the number 3 elsewhere in the column, so the row at fault
    must be found in the raw file. Columns whose rows share one type (e.g. lists of turns with
    varying keys) are fine.
    """
    mixed = [name for name, feature in dataset.features.items() if type(feature).__name__ == "Json"]
    if not mixed:
        return
    rows = _raw_rows(path)
    for column in mixed:
        kinds = [type(row.get(column)).__name__ for row in rows if row.get(column) is not None]
        majority = max(set(kinds), key=kinds.count) if kinds else None
        for index, row in enumerate(rows):
            value = row.get(column)
            if value is not None and type(value).__name__ != majority:
                raise DataError(f"{path}, row {index} (0-based): column {column!r} holds a "
                                f"{type(value).__name__} ({json.dumps(value)[:60]}), but the other rows hold "
                                f"a {majority}; fix or remove it.")


def _raw_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _builder_for(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in BUILDERS:
        raise DataError(f"{path}: unsupported file type {ext!r}; use one of {', '.join(BUILDERS)}.")
    return BUILDERS[ext]


def diagnose(path: str, builder: str) -> str | None:
    """Locate the first undecodable line/row of a json/jsonl/text file, for the error message."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return f"not valid UTF-8 at byte {exc.start} (line {line}); re-save the file as UTF-8."
    except OSError as exc:
        return str(exc)
    if builder != "json":
        return None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}."
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        return None if bad is None else f"row {bad} is a {type(rows[bad]).__name__}, expected a JSON object."
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"invalid JSON on line {lineno} (row {lineno - 1}): {exc.msg}."
        if not isinstance(row, dict):
            return f"line {lineno} (row {lineno - 1}) is a {type(row).__name__}, expected a JSON object."
    return None


def _is_blank(path: str) -> bool:
    """Whether the file holds nothing but whitespace (read in blocks: a big file stops at its first row)."""
    with open(path, "rb") as handle:
        while block := handle.read(1 << 16):
            if block.strip():
                return False
    return True


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects a JSON dataset file may have (a conversation row is about 6 deep). A file
nested far deeper crashes the readers: a RecursionError in Python's json, a segfault in pyarrow's."""

_JSON_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')  # unrolled: no backtracking stack per character
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_json_depth(path: str, limit: int = MAX_JSON_DEPTH) -> None:
    """DataError when the JSON(L) file nests arrays/objects deeper than ``limit``, found without a parser:
    strings removed, brackets kept, their running depth summed (a JSON string never spans lines, so the file
    is read in blocks that end at a newline)."""
    import numpy as np

    depth, line = 0, 1
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24) + handle.readline():
            brackets = _JSON_STRING.sub(b"", block).translate(None, _NOT_BRACKETS)
            opening = np.frombuffer(brackets, np.uint8) & 0x02 != 0  # '[' 0x5b, '{' 0x7b; ']' 0x5d, '}' 0x7d
            running = depth + np.cumsum(np.where(opening, 1, -1))
            if running.size and running.max() > limit:
                too_deep = int(np.argmax(running > limit))
                at = line + _line_of_bracket(block, too_deep)
                raise DataError(f"{path}: JSON nested more than {limit} levels deep (line {at}); a dataset "
                                "row is a flat object of strings and lists of messages. Fix or remove that "
                                "row.")
            depth = int(running[-1]) if running.size else depth
            line += block.count(b"\n")


def _line_of_bracket(block: bytes, index: int) -> int:
    """Lines before the ``index``-th bracket outside strings in ``block``."""
    seen = 0
    for lineno, text in enumerate(block.split(b"\n")):
        seen += len(_JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKETS))
        if seen > index:
            return lineno
    return 0


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def _looks_like_hub_name(spec: str) -> bool:
    return spec.count("/") <= 1 and not spec.startswith((".", "/")) and os.path.splitext(spec)[1] == ""


OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is switched off (any of ``OFFLINE_ENV`` set to 1/true/yes/on, as HF reads
    them). The one check for both data sources and models."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_ENV)
