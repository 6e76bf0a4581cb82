"""Recipe + command line -> validated RunConfig. Precedence: defaults < recipe < command line."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from roll.config import llamafactory
from roll.config.coerce import CoercionError, closest, coerce, describe, is_bool_word
from roll.config.run import GROUPS, RunConfig
from roll.config.training import LAUNCH_ENV_FALLBACKS
from roll.errors import ConfigError
from roll.slurm import log_restart, restart_count

ENV_FALLBACKS = {"use_mca": "USE_MCA"}
"""Keys read from these environment variables when neither the recipe nor the command line sets them:
LLaMA-Factory's backend switch (``USE_MCA=1 llamafactory-cli train X.yaml``)."""

FLAGS = ("help", "print_config", "dry_run", "json", "version", "plan", "prepare_data", "sbatch")
"""Command-line switches that are not config keys."""


@dataclass
class CliOptions:
    """What the command line asked for, besides config values."""

    recipe: str | None = None
    help: bool = False
    print_config: bool = False
    dry_run: bool = False
    json: bool = False
    version: bool = False
    plan: bool = False
    prepare_data: bool = False
    sbatch: bool = False
    argv: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _FieldRef:
    group: str
    cls: type
    name: str
    type: Any


def _field_index() -> dict[str, _FieldRef]:
    index: dict[str, _FieldRef] = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            # Recipes are flat: a key must name exactly one field of one group.
            assert f.name not in index, f"key {f.name!r} is in groups {index[f.name].group!r} and {group!r}"
            index[f.name] = _FieldRef(group, cls, f.name, hints.get(f.name, Any))
    return index


FIELDS = _field_index()


def _normalise(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def _unknown_key_error(keys: list[str], source: str) -> ConfigError:
    parts = []
    for key in keys:
        hint = closest(key, FIELDS) or closest(key, FLAGS)
        parts.append(f"'{key}'" + (f" (did you mean '{hint}'?)" if hint else ""))
    noun = "key" if len(keys) == 1 else "keys"
    return ConfigError(f"unknown {noun} {', '.join(parts)} in {source}. "
                       "Run `roll-train --help` to list every valid key with its meaning.")


def split_command_line(argv: list[str]) -> tuple[CliOptions, dict[str, str]]:
    """Separate the recipe path, switches and ``key=value`` / ``--key value`` overrides."""
    options = CliOptions(argv=list(argv))
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token in ("-h", "--help"):
            options.help = True
            continue
        if not token.startswith("-") and "=" not in token:
            if options.recipe is not None:
                raise ConfigError(f"two recipe files given ({options.recipe!r} and {token!r}); pass one, "
                                  "and overrides as key=value.")
            options.recipe = token
            continue
        key, sep, value = token.partition("=")
        key = _normalise(key)
        if key in FLAGS:
            setattr(options, key, True)
            continue
        if not sep:  # --key value, or a bare --flag meaning true
            ref = FIELDS.get(key)
            takes_value = i < len(argv) and not argv[i].startswith("--") and "=" not in argv[i]
            if ref is not None and _is_bool(ref.type) and not (takes_value and is_bool_word(argv[i])):
                value = "true"
            elif ref is None and not takes_value and llamafactory.entry(key) is not None:
                value = "true"  # a bare switch of LLaMA-Factory's (--plot_loss)
            elif takes_value:
                value = argv[i]
                i += 1
            elif ref is None:  # an unknown switch: say so (and the closest key), not that it lacks a value
                raise _unknown_key_error([key], "the command line")
            else:
                raise ConfigError(f"command-line option '--{key}' needs a value: write --{key} VALUE or {key}=VALUE.")
        overrides[key] = value
    return options, overrides


def _is_bool(tp: Any) -> bool:
    return tp is bool or bool in typing.get_args(tp)


def load_recipe(path: str) -> dict[str, Any]:
    """Read a YAML recipe into a flat ``key -> value`` mapping."""
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        near = [os.path.join(os.path.dirname(path), name) for name in
                (os.listdir(folder) if os.path.isdir(folder) else []) if name.endswith((".yaml", ".yml"))]
        hint = closest(path, near)
        raise ConfigError(f"recipe file {path!r} does not exist" + (f" (did you mean {hint!r}?)" if hint else "")
                          + ". The shipped recipes are recipes/*.yaml and, for a CPU, recipes/demo/*.yaml.")
    try:
        with open(path, encoding="utf-8") as fh:
            content = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path!r} is not valid YAML: {exc}") from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ConfigError(f"recipe {path!r} must be a mapping of key: value, got {type(content).__name__}.")
    return {_normalise(str(k)): v for k, v in content.items()}


def _parse_cli_value(text: str, tp: Any) -> Any:
    """A command-line value read as YAML, except that ``save_strategy=no`` stays the text 'no'
    when the key does not take a boolean (quoting is awkward on a command line). A value that is no text
    (a LLaMA-Factory key's, already read: roll.config.llamafactory) is kept."""
    if not isinstance(text, str):
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, bool) and not _is_bool(tp):
        return text
    return value


def _parse_llamafactory_value(text: str) -> Any:
    """A command-line value of a key that is not roll's (a LLaMA-Factory key's, or an unknown one): read as YAML,
    true / false as booleans (``use_dora=false`` is LLaMA-Factory's default, accepted), other words as text."""
    if isinstance(text, str) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return _parse_cli_value(text, Any)


def resolve(recipe: dict[str, Any], overrides: dict[str, str], recipe_path: str | None) -> RunConfig:
    """Apply defaults < launch environment variables (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT; under a
    requeued SLURM job, SLURM_RESTART_COUNT >= 1, ``resume_from_checkpoint: auto``) < recipe < command line,
    check every key and type, then validate once."""
    source_of = {}
    values: dict[str, Any] = {}
    recipe_source = f"recipe {recipe_path}" if recipe_path else "recipe"
    recipe = llamafactory.translate(recipe, recipe_source, set(FIELDS))
    overrides = llamafactory.translate({k: v if k in FIELDS else _parse_llamafactory_value(v)
                                        for k, v in overrides.items()}, "the command line", set(FIELDS))
    unknown = [k for k in recipe if k not in FIELDS]
    if unknown:
        raise _unknown_key_error(unknown, recipe_source)
    unknown = [k for k in overrides if k not in FIELDS]
    if unknown:
        raise _unknown_key_error(unknown, "the command line")
    for key, var in {**LAUNCH_ENV_FALLBACKS, **ENV_FALLBACKS}.items():
        if os.environ.get(var, "").strip() and key not in recipe and key not in overrides:
            values[key], source_of[key] = _parse_cli_value(os.environ[var], FIELDS[key].type), f"environment variable {var}"
    restarts = restart_count()
    if restarts and "resume_from_checkpoint" not in recipe and "resume_from_checkpoint" not in overrides:
        # a requeued SLURM job reruns the same script: it continues from its latest complete checkpoint
        values["resume_from_checkpoint"] = "auto"  # roll.checkpoints.AUTO
        source_of["resume_from_checkpoint"] = f"SLURM_RESTART_COUNT={restarts}"
    explicit = frozenset(recipe) | frozenset(overrides)
    for key, value in recipe.items():
        values[key], source_of[key] = value, recipe_source
    for key, value in overrides.items():
        values[key], source_of[key] = _parse_cli_value(value, FIELDS[key].type), "the command line"

    kwargs: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    for key, value in values.items():
        ref = FIELDS[key]
        try:
            kwargs[ref.group][key] = coerce(value, ref.type)
        except CoercionError as exc:
            raise ConfigError(f"invalid value for '{key}' (from {source_of[key]}): {exc}. "
                              f"'{key}' takes {describe(ref.type)}.") from None
    # Each group's __post_init__ checks its own values and names the field in its message.
    groups = {group: cls(**kwargs[group]) for group, cls in GROUPS.items()}
    config = RunConfig(recipe_path=recipe_path, explicit_keys=explicit, **groups)
    config.validate()
    if source_of.get("resume_from_checkpoint", "").startswith("SLURM_RESTART_COUNT"):
        log_restart(restarts, config.training.output_dir)
    return config


def peek(argv: list[str], keys: tuple[str, ...]) -> dict[str, Any]:
    """The values the recipe and command line give ``keys`` (the command line first), typed; a key set in
    neither is absent. For what must be known before the full parse (``roll.slurm.adopt``); a mistake
    returns what was read so far, and the full parse then reports it."""
    found: dict[str, Any] = {}
    try:
        options, overrides = split_command_line(argv)
        recipe = load_recipe(options.recipe) if options.recipe else {}
        for key in keys:
            tp = FIELDS[key].type
            if key in overrides:
                found[key] = coerce(_parse_cli_value(overrides[key], tp), tp)
            elif key in recipe:
                found[key] = coerce(recipe[key], tp)
    except (ConfigError, CoercionError):
        pass
    return found


def parse_args(argv: list[str]) -> tuple[CliOptions, RunConfig | None]:
    """Parse the full command line; returns (options, config). config is None for --help/--version."""
    options, overrides = split_command_line(argv)
    if options.help or options.version:
        return options, None
    recipe = load_recipe(options.recipe) if options.recipe else {}
    return options, resolve(recipe, overrides, options.recipe)
