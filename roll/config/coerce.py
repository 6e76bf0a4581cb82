"""Turn recipe / command-line values into the types a config field declares."""

from __future__ import annotations

import difflib
import enum
import json
import types
import typing
from typing import Any, Literal

_NONE_STRINGS = {"none", "null", "~"}
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class CoercionError(ValueError):
    """The value does not fit the declared type; the message says what was expected."""


def closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate most similar to ``word`` (for 'did you mean' hints), or None."""
    matches = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def is_bool_word(text: str) -> bool:
    """Whether ``text`` spells a boolean: true/false, yes/no, on/off or 1/0, in any case."""
    return text.lower() in _TRUE | _FALSE


def describe(tp: Any) -> str:
    """Human-readable name of a type annotation, e.g. 'int or null', "one of pt, sft, dpo"."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` converted to annotation ``tp``; raise CoercionError when it cannot be."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp))
    if tp is type(None):
        if value is None or (isinstance(value, str) and value.lower() in _NONE_STRINGS):
            return None
        raise CoercionError(f"expected null, got {value!r}")
    if origin is Literal:
        return _coerce_literal(value, typing.get_args(tp))
    if tp is bool:
        return _coerce_bool(value)
    if tp is int:
        return _coerce_int(value)
    if tp is float:
        return _coerce_float(value)
    if tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads unquoted no/yes/off/on as booleans
            raise CoercionError(f"expected text, got the YAML boolean {str(value).lower()}; "
                                "put the value in quotes, e.g. \"no\"")
        if isinstance(value, (dict, list)):
            raise CoercionError(f"expected a string, got {type(value).__name__} {value!r}")
        return str(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _coerce_literal(value, tuple(m.value for m in tp))
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            raise CoercionError(f"expected a list, got {value!r}")
        args = typing.get_args(tp)
        return [coerce(v, args[0]) for v in value] if args else list(value)
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = _parse_mapping(value)
        if not isinstance(value, dict):
            raise CoercionError(f"expected a mapping, got {value!r}")
        return value
    return value


def _coerce_union(value: Any, arms: tuple) -> Any:
    if type(None) in arms and (value is None or (
            isinstance(value, str) and value.lower() in _NONE_STRINGS and str not in arms)):
        return None  # a string arm keeps 'none' as text: HF's report_to='none' means no reporter
    if isinstance(value, bool) and str in arms and bool not in arms:
        return coerce(value, str)  # raises with the advice to quote YAML's no/yes

    # Scalars first so '3' for `int | str` becomes 3; str before containers so 'none' for
    # `str | list[str]` stays the string HF expects.
    def rank(arm) -> int:
        if arm is str:
            return 1
        if arm in (list, dict) or typing.get_origin(arm) in (list, tuple, dict):
            return 2
        return 0

    for arm in sorted(arms, key=rank):
        if arm is type(None):
            continue
        try:
            return coerce(value, arm)
        except CoercionError:
            continue
    raise CoercionError(f"expected {describe(typing.Union[arms])}, got {value!r}")


def _coerce_literal(value: Any, choices: tuple) -> Any:
    for choice in choices:
        if value == choice or (isinstance(value, str) and str(choice) == value):
            return choice
        if choice is None and isinstance(value, str) and value.lower() in _NONE_STRINGS:
            return None
    same_letters = [str(c) for c in choices if str(c).lower() == str(value).lower()]  # stage: SFT -> sft
    hint = same_letters[0] if same_letters else closest(str(value), [str(c) for c in choices])
    message = f"{value!r} is not one of " + ", ".join(str(c) for c in choices)
    raise CoercionError(message + (f" (did you mean {hint!r}?)" if hint else ""))


def _coerce_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and is_bool_word(value):
        return value.lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise CoercionError(f"expected true or false, got {value!r}")


def _coerce_int(value: Any) -> int:
    if isinstance(value, bool):
        raise CoercionError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise CoercionError(f"expected an integer, got {value!r}")


def _coerce_float(value: Any) -> float:
    if isinstance(value, bool):
        raise CoercionError(f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:  # YAML 1.1 reads '1e-5' as a string: accept it as the number it means
            return float(value.strip())
        except ValueError:
            pass
    raise CoercionError(f"expected a number, got {value!r}")


def _parse_mapping(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
