"""Named datasets: ``dataset: identity,alpaca_en_demo`` looks the names up in ``dataset_dir/dataset_info.json``.

The registry is LLaMA-Factory's (its data/README.md; ``dataset_dir`` defaults to ``data``, relative to the
working directory, as there). Each name maps to an object:

- where the rows are: ``file_name`` (a file, or a folder of files, under ``dataset_dir``) or ``hf_hub_url``
  (a Hub dataset, read with the network only); ``split`` (default ``train``, the only split of a file);
- ``formatting``: ``alpaca`` (the default) or ``sharegpt``; ``ranking: true`` marks preference pairs (stage
  dpo reads only such entries, the other stages only the others);
- ``columns``: which column holds each part: alpaca ``prompt``, ``query``, ``response``, ``history``,
  ``system``; sharegpt ``messages``, ``system``; pairs ``chosen``, ``rejected``; ``kto_tag`` (a boolean column:
  the reply is desirable or not; carried into the row as ``kto_tag``). Without ``columns`` the defaults in
  ``COLUMNS`` are read; with it, as in LLaMA-Factory, only the parts it names (one warning names a default
  column the file has that is then not read);
- ``tags`` (sharegpt): the key of a turn's role and content, and the role names: the defaults in ``TAGS``
  without ``tags``, only those it names with it.

An entry's rows are rewritten into roll's own columns (``DatasetEntry.canonical``) before the stage's
format reads them, with LLaMA-Factory's meanings: an alpaca prompt is ``prompt`` and ``query`` joined by a
newline, leaving out empty ones; a system prompt or a history is read only from a column the entry names.
``columns.images`` names the image paths of a vision-language model's rows (roll.data.vision); ``tools`` (a JSON list
of tool descriptions, read only when named, as there) is laid out by the named templates. What roll cannot train on
is refused when the recipe is read: videos, audios,
``num_samples``, and hub entries other than ``hf_hub_url``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from roll.data.formats import RowError
from roll.errors import ConfigError


def _closest(word: str, candidates) -> str | None:
    from roll.config.coerce import closest  # late: roll.config imports this module

    return closest(word, candidates)

REGISTRY = "dataset_info.json"

COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None,
           "messages": "conversations", "system": None, "chosen": "chosen", "rejected": "rejected",
           "kto_tag": None, "images": None, "tools": None}
"""The columns an entry may name, with the column read when it names none (None: not read)."""

TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
"""sharegpt turn keys and role names an entry may rename, with their defaults."""

_ROLES = {"user_tag": "human", "assistant_tag": "gpt", "observation_tag": "observation",
          "function_tag": "function_call", "system_tag": "system"}
"""The role names roll.data.formats reads, for each role an entry may rename."""

LOCATIONS = ("file_name", "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
KEYS = frozenset(LOCATIONS + ("formatting", "ranking", "columns", "tags", "split", "subset", "folder",
                              "num_samples"))
REFUSED_COLUMNS = {
    "videos": "multimodal rows (videos) are not supported: roll reads text and images (docs/vl.md)",
    "audios": "multimodal rows (audios) are not supported: roll reads text and images (docs/vl.md)",
}


@dataclass(frozen=True)
class DatasetEntry:
    """One validated registry entry; ``columns`` and ``tags`` are complete (defaults filled in)."""

    name: str
    registry: str
    """The dataset_info.json it comes from, for messages."""
    location: str
    """The file or folder (joined to dataset_dir), or the Hub dataset name."""
    hub: bool
    formatting: str
    ranking: bool
    columns: tuple[tuple[str, str | None], ...]
    tags: tuple[tuple[str, str], ...]
    named: frozenset[str]
    """The columns the entry names itself (they must exist in the file)."""

    def column(self, part: str) -> str | None:
        return dict(self.columns)[part]

    def describe(self) -> str:
        return f"dataset {self.name!r} ({self.registry})"

    def format_for(self, allowed: tuple[str, ...], stage: str) -> str:
        """The roll row format this entry's rows become for a stage that reads ``allowed`` formats."""
        if "pairwise" in allowed:
            if not self.ranking:
                raise ConfigError(f"{self.describe()} holds no preference pairs (no `ranking: true`), and stage "
                                  f"{stage} trains on pairs: register a ranking dataset.")
            return "pairwise"
        if self.ranking:
            raise ConfigError(f"{self.describe()} holds preference pairs (`ranking: true`), which stage {stage} "
                              "does not train on (stage dpo does).")
        if "text" in allowed:
            return "text"
        return self.formatting

    def required(self, fmt: str) -> list[str]:
        """The parts rows of ``fmt`` cannot do without (an alpaca prompt may come from query alone)."""
        if self.formatting == "sharegpt":
            return ["messages"] + (["chosen", "rejected"] if fmt == "pairwise" else [])
        return {"alpaca": ["response"], "pairwise": ["chosen", "rejected"], "text": []}.get(fmt, [])

    def missing_columns(self, fmt: str, columns: list[str]) -> list[str]:
        """What the file lacks for rows of ``fmt``: a needed part the entry names no column for, or a named
        column the file does not have (a ConfigError message each)."""
        unnamed = [part for part in self.required(fmt) if self.column(part) is None]
        if fmt == "text" and self.formatting == "alpaca" and self.column("prompt") is None:
            unnamed.append("prompt")
        missing = [f"it names no column for {part} (with `columns`, only the columns named are read)"
                   for part in unnamed]
        return missing + [f"column {self.column(part)!r} (columns.{part}) is not in the file"
                          for part in sorted(self.named) if self.column(part) not in columns]

    def unread_columns(self, columns: list[str]) -> list[str]:
        """Default columns the file has that the entry's ``columns`` leaves unread (LLaMA-Factory's meaning)."""
        if not self.named:
            return []
        parts = ("messages",) if self.formatting == "sharegpt" else ("prompt", "query", "response")
        return [f"{COLUMNS[p]!r} (columns.{p})" for p in parts if self.column(p) is None and COLUMNS[p] in columns]

    def canonical(self, row: dict, fmt: str) -> dict:
        """``row`` in roll's own columns (roll.data.formats) for rows of ``fmt``; RowError when malformed."""
        out = self._sharegpt(row) if self.formatting == "sharegpt" else self._alpaca(row)
        if fmt == "text":
            return {"text": _first_prompt(out)}
        for part in ("kto_tag", "tools"):
            if self.column(part) is not None:
                out[part] = row.get(self.column(part))
        return out

    def _get(self, row: dict, part: str):
        column = self.column(part)
        return None if column is None else row.get(column)

    def _alpaca(self, row: dict) -> dict:
        parts = [value for value in (self._get(row, "prompt"), self._get(row, "query")) if value]
        for value in parts:
            if not isinstance(value, str):
                raise RowError(f"columns prompt/query must hold text, got {type(value).__name__}")
        out = {"instruction": "\n".join(parts), "output": self._get(row, "response")}
        for part in ("history", "system"):
            if self.column(part) is not None:
                out[part] = self._get(row, part)
        if self.ranking:
            out.update(chosen=self._get(row, "chosen"), rejected=self._get(row, "rejected"))
        return out

    def _sharegpt(self, row: dict) -> dict:
        messages = self._get(row, "messages")
        if not isinstance(messages, list):
            raise RowError(f"column {self.column('messages')!r} (columns.messages) must hold a list of turns, "
                           f"got {type(messages).__name__}")
        out: dict[str, Any] = {"conversations": [self._turn(turn, i) for i, turn in enumerate(messages)]}
        if self.column("system") is not None:
            out["system"] = self._get(row, "system")
        if self.ranking:
            for side in ("chosen", "rejected"):
                value = self._get(row, side)
                out[side] = self._turn(value, side) if isinstance(value, dict) else value
        return out

    def _turn(self, turn: Any, where: int | str) -> dict:
        tags = dict(self.tags)
        roles = {tags[key]: name for key, name in _ROLES.items() if tags[key] is not None}
        if not isinstance(turn, dict) or tags["role_tag"] not in turn:
            raise RowError(f"turn {where!r} of column {self.column('messages')!r} must be an object with the key "
                           f"{tags['role_tag']!r} (tags.role_tag) and {tags['content_tag']!r} (tags.content_tag)")
        role = turn[tags["role_tag"]]
        if role not in roles:
            raise RowError(f"turn {where!r} has the role {role!r}; {self.describe()} names the roles "
                           f"{sorted(roles)} (tags.user_tag, assistant_tag, observation_tag, function_tag, "
                           "system_tag)")
        return {"from": roles[role], "value": turn.get(tags["content_tag"])}


def _first_prompt(row: dict) -> str:
    """What LLaMA-Factory's stage pt trains on: the first prompt of the row (alpaca: the first history prompt,
    else prompt and query; sharegpt: the first turn after the system prompt)."""
    if "conversations" in row:
        turns = [t for t in row["conversations"] if t["from"] != "system"]
        return turns[0]["value"] if turns else ""
    history = row.get("history")
    if isinstance(history, list) and history and isinstance(history[0], (list, tuple)):
        return history[0][0]
    return row["instruction"]


_CACHE: dict[tuple[str, float], dict] = {}


def registry_path(dataset_dir: str | None) -> str:
    return os.path.join(dataset_dir or "data", REGISTRY)


def read_registry(dataset_dir: str | None) -> dict | None:
    """dataset_dir/dataset_info.json as a dict; None when there is no such file."""
    path = registry_path(dataset_dir)
    if not os.path.isfile(path):
        return None
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _CACHE:
        from roll.config.training import read_json_object

        _CACHE[key] = read_json_object(path, f"the dataset registry {path}")
    return _CACHE[key]


def lookup(name: str, dataset_dir: str | None) -> DatasetEntry | None:
    """The validated entry ``name`` of the registry, or None when it registers no such name."""
    registry = read_registry(dataset_dir)
    if registry is None or name not in registry:
        return None
    return parse_entry(name, registry[name], registry_path(dataset_dir), dataset_dir or "data")


def unknown_name(name: str, dataset_dir: str | None) -> str:
    """The end of the message for a ``dataset:`` entry that is neither a path nor a registered name."""
    registry = read_registry(dataset_dir)
    path = registry_path(dataset_dir)
    if registry is None:
        return f"not a file or directory, and there is no {path} registering dataset names (dataset_dir)"
    names = sorted(registry)
    hint = _closest(name, names)
    return (f"not a file or directory, nor a name registered in {path}"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + f"; its names: {', '.join(names[:40])}{' ...' if len(names) > 40 else ''}")


def parse_entry(name: str, raw: Any, registry: str, dataset_dir: str) -> DatasetEntry:
    """Validate one registry entry (ConfigError naming the entry and the key at fault)."""
    where = f"dataset {name!r} in {registry}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object (file_name, formatting, columns, ...), got "
                          f"{type(raw).__name__}.")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        hint = _closest(unknown[0], KEYS)
        raise ConfigError(f"{where} has the unknown key(s) {', '.join(unknown)}"
                          + (f" (did you mean {hint!r}?)" if hint else "") + f"; known: {', '.join(sorted(KEYS))}.")
    located = [key for key in LOCATIONS if key in raw]
    if len(located) != 1 or located[0] not in ("file_name", "hf_hub_url"):
        raise ConfigError(f"{where} must say where its rows are with exactly one of file_name or hf_hub_url"
                          + (f" (it has {', '.join(located)}; ModelScope, Modelers, script and cloud datasets "
                             "are not supported: download the rows and register their file)" if located else "")
                          + ".")
    for key in ("subset", "folder", "num_samples"):
        if raw.get(key) is not None:
            use = "use max_samples" if key == "num_samples" else "download the dataset and register its file"
            raise ConfigError(f"{where}: {key} is not supported yet; {use}.")
    formatting = raw.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(f"{where}: formatting must be alpaca or sharegpt, got {formatting!r} (OpenAI-style "
                          "messages are sharegpt with tags role_tag: role, content_tag: content, user_tag: user, "
                          "assistant_tag: assistant).")
    if not isinstance(raw.get("ranking", False), bool):
        raise ConfigError(f"{where}: ranking must be true or false, got {raw['ranking']!r}.")
    split = raw.get("split", "train")
    if split != "train":
        raise ConfigError(f"{where}: split {split!r} cannot be read (a file has the split train only); drop the "
                          "key or register the rows of that split as their own file.")
    columns, named = _mapping(raw, "columns", COLUMNS, where, REFUSED_COLUMNS)
    tags, tags_named = _mapping(raw, "tags", TAGS, where, {})
    if tags_named and not {"role_tag", "content_tag"} <= tags_named:
        raise ConfigError(f"{where}: tags must name role_tag and content_tag (with tags, only the tags named are "
                          "read, as in LLaMA-Factory).")
    hub = located[0] == "hf_hub_url"
    location = raw[located[0]]
    if not isinstance(location, str) or not location.strip():
        raise ConfigError(f"{where}: {located[0]} must be a non-empty string, got {location!r}.")
    return DatasetEntry(name=name, registry=registry, location=location if hub else os.path.join(dataset_dir, location),
                        hub=hub, formatting=formatting, ranking=raw.get("ranking", False),
                        columns=tuple(sorted(columns.items())), tags=tuple(sorted(tags.items())),
                        named=frozenset(named))


def _mapping(raw: dict, key: str, defaults: dict, where: str, refused: dict) -> tuple[dict, set]:
    given = raw.get(key, {})
    if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
        raise ConfigError(f"{where}: {key} must be an object of names to strings, got {json.dumps(given)[:80]}.")
    for name in given:
        if name in refused:
            raise ConfigError(f"{where}: {key}.{name}: {refused[name]}.")
        if name not in defaults:
            hint = _closest(name, defaults)
            raise ConfigError(f"{where}: {key}.{name} is not a {key[:-1]} LLaMA-Factory's registry knows"
                              + (f" (did you mean {hint!r}?)" if hint else "")
                              + f"; known: {', '.join(defaults)}.")
    if key not in raw:
        return dict(defaults), set()
    return {**{name: None for name in defaults}, **given}, set(given)  # LLaMA-Factory: only the named ones


def registered_entries(data_args) -> dict[str, DatasetEntry]:
    """The registry entries ``dataset:`` and ``eval_dataset:`` name (validated), by name."""
    entries = {}
    for spec in (data_args.dataset, data_args.eval_dataset):
        for part in (p.strip() for p in (spec or "").split(",") if p.strip()):
            entry = lookup(part, data_args.dataset_dir)
            if entry is not None:
                entries[part] = entry
    return entries


def check_sources(data_args) -> None:
    """At config time: every registered name of ``dataset:`` / ``eval_dataset:`` has a valid entry whose file
    exists, and a name-like entry that is no path is registered (when there is a registry)."""
    registry = read_registry(data_args.dataset_dir)
    for spec in (data_args.dataset, data_args.eval_dataset):
        for part in (p.strip() for p in (spec or "").split(",") if p.strip()):
            entry = lookup(part, data_args.dataset_dir)
            if entry is not None:
                if not entry.hub and not os.path.exists(entry.location):
                    raise ConfigError(f"{entry.describe()}: its file_name {entry.location!r} does not exist.")
                continue
            looks_like_name = os.sep not in part and "/" not in part and not os.path.splitext(part)[1]
            if registry is not None and looks_like_name and not os.path.exists(part):
                raise ConfigError(f"dataset {part!r}: {unknown_name(part, data_args.dataset_dir)}.")
